"""The Anthropic-compatible HTTP API's test frontend, shared by the Messages API's and the
Message Batches' tests: a real frontend over one real engine that keeps no caches (so every
cached token counted is the store's), and the real ``anthropic`` SDK against it."""
from __future__ import annotations

import contextlib
import json

import anthropic
import pytest

from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
from workers.engine.config import EngineConfig

SYSTEM = "You are a careful assistant who answers briefly and never rambles on. " * 3
MODEL = "llama"
GREEDY = {"temperature": 0}  # the SDK has no temperature argument: sent as an extra field


@contextlib.contextmanager
def messages_frontend(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    engine = EngineConfig(block_size=16, max_batch=4, kept_bytes=0)
    with running_frontend(run_dir, tiny_model(), workers=1, engine=engine) as harness:
        yield harness


def address(api) -> str:
    return json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]


def claude_client(api) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=address(api), api_key="key-acme", max_retries=0)


# The fixtures the Messages tests share (imported by name).

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """``messages_frontend``, for the module."""
    with messages_frontend(tmp_path_factory) as harness:
        yield harness


@pytest.fixture(scope="module")
def claude(api) -> anthropic.Anthropic:
    """The Anthropic SDK's client of ``api``."""
    return claude_client(api)
