"""The gRPC API's test frontends and requests, shared by the servicers', the edge's, the
validation's and ``Work``'s tests (tests/cluster/api/test_servicer.py, test_servicer_admin.py,
test_edge.py, test_validate.py, test_work.py).

``grpc_frontend(tmp_path_factory, config, workers)`` runs a real frontend over a LocalBackend
(real engines and router) from a fresh run directory; ``held_frontend`` runs one worker with a
``HeldTokenizer``, which a test can hold inside tokenizing for as long as it needs. Requests
are built as the client library builds them (``chat``, ``tokens``, ``messages``).
"""
from __future__ import annotations

import contextlib
import threading

import grpc
import pytest

from cluster.api.chat import ChatTokenizer
from cluster.api.client import chat_request
from proto.orchard.v1 import orchard_pb2 as pb
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import TWO_TENANTS_CONFIG, running_frontend

CONFIG = TWO_TENANTS_CONFIG + """
[limits]
max_requests_per_job = 16
max_pending_per_tenant = 12
max_concurrent = 4
"""

SYSTEM = "You are a careful assistant who answers briefly. " * 6

BLOCK = 16  # the harness's block size

MIB = 1 << 20

FILLER = "The quick brown fox jumps over the lazy dog, again and again. "


def finished_exactly(output_tokens: int, max_tokens: int, finish_reason: str) -> bool:
    """A result stops at ``max_tokens`` ("length") or earlier at EOS ("stop"), never else."""
    return (finish_reason == "length" and output_tokens == max_tokens) or (
        finish_reason == "stop" and 1 <= output_tokens <= max_tokens)


def chat(custom_id, user, max_tokens=4, system=SYSTEM):
    return chat_request(custom_id, [{"role": "system", "content": system},
                                    {"role": "user", "content": user}], max_tokens)


def run_job(client, requests):
    job = client.submit(requests)
    job = client.wait(job.job_id, poll_s=0.05, timeout_s=120)
    return job, list(client.results(job.job_id))


def tokens(ids, max_tokens=2):
    return pb.Request(custom_id="t", tokens=pb.TokenIds(ids=ids),
                      sampling=pb.SamplingParams(max_tokens=max_tokens))


def messages(*msgs, max_tokens=2):
    return chat_request("m", list(msgs), max_tokens)


class HeldTokenizer(ChatTokenizer):
    """The frontend's tokenizer, holding any conversation of over 100,000 characters in its
    thread (``entered`` set) until ``release`` is set: a big prompt's tokenizing made as long
    as a test needs, whatever the machine's speed."""

    def __init__(self, model_dir) -> None:
        super().__init__(model_dir)
        self.entered, self.release = threading.Event(), threading.Event()

    def _apply(self, messages, add_generation_prompt, tools):
        if sum(len(str(m.get("content", ""))) for m in messages) > 100_000:
            self.entered.set()
            assert self.release.wait(120), "the held tokenizer was never released"
        return super()._apply(messages, add_generation_prompt, tools)


@contextlib.contextmanager
def grpc_frontend(tmp_path_factory, config: str, workers: int, tokenizer=None):
    """A real frontend under ``config`` with ``workers`` engines, in a run dir of its own."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(config)
    with running_frontend(run_dir, tiny_model(), workers=workers, tokenizer=tokenizer) as harness:
        yield harness


@contextlib.contextmanager
def held_frontend(tmp_path_factory):
    """One worker under two tenants, its tokenizer a ``HeldTokenizer`` (``harness.tokenizer``),
    released unless a test holds it."""
    tokenizer = HeldTokenizer(tiny_model())
    tokenizer.release.set()  # held only where a test clears it
    with grpc_frontend(tmp_path_factory, TWO_TENANTS_CONFIG, 1, tokenizer) as harness:
        harness.tokenizer = tokenizer
        yield harness


# The fixtures the gRPC tests share (imported by name; a module that wants more workers
# defines its own ``api``, and ``acme`` follows it).

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """A real frontend under ``CONFIG`` with one worker, for the module."""
    with grpc_frontend(tmp_path_factory, CONFIG, workers=1) as harness:
        yield harness


@pytest.fixture(scope="module")
def acme(api):
    """A client of ``api`` as tenant acme."""
    with api.client("acme") as client:
        yield client


@pytest.fixture(scope="module")
def api_hostile(tmp_path_factory):
    """``held_frontend``, for the module."""
    with held_frontend(tmp_path_factory) as harness:
        yield harness


@pytest.fixture(scope="module")
def channel(api_hostile):
    """A raw gRPC channel to ``api_hostile``, for bytes no client would send."""
    with grpc.insecure_channel(api_hostile.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def tokenizer():
    """The model's chat template, to know each prompt's tokens (read only)."""
    tok = ChatTokenizer(tiny_model())
    yield tok
    tok.close()
