"""Requests outside any job (``runner.direct``: what ``Generate`` and the HTTP completions
run): streamed in one of the runner's slots with the tenant's namespace and block hashes,
stopped at the earlier of the two deadlines, counted by the runner's admission.

Over the in-process backend and a forged tiny model; every wait is bounded in wall-clock time
(``tests.bounded``).
"""
from __future__ import annotations

import asyncio

import pytest

from cluster.backend.local import LocalBackend
from cluster.backend.protocol import TokenChunk
from cluster.jobs.admission import Overloaded
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import JobStore, NewRequest, StoredResult
from router.kv.key import Namespace, hash_blocks
from tests.support.bounded import run_bounded
from tests.support.forged_models import tiny_model
from tests.support.runner_bodies import prepare_body
from workers.engine.engine import EngineConfig
from workers.messages import SamplingParams

BLOCK = 16
NS = Namespace("acme", "tiny")


def _runner(store: JobStore, backend, timeout_s: float = 10.0, pending: int = 1000,
            concurrent: int = 2) -> JobRunner:
    return JobRunner(store, backend, prepare_body,
                     RunnerLimits(max_concurrent=concurrent, max_pending_per_tenant=pending,
                                  max_pending_total=pending, request_timeout_s=timeout_s),
                     namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)


def _request(prompt: tuple[int, ...], max_tokens: int, custom_id: str = "") -> NewRequest:
    return NewRequest(custom_id=custom_id, prompt=prompt,
                      sampling=SamplingParams(max_tokens=max_tokens))


class StreamRecorder(LocalBackend):
    """The in-process backend, keeping each streamed request and its block hashes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.streams: list[tuple] = []

    def stream(self, request, block_hashes):
        self.streams.append((request, list(block_hashes)))
        return super().stream(request, block_hashes)


class SilentStream:
    """A backend whose stream never yields (a worker that stopped answering)."""

    async def stream(self, request, block_hashes):
        await asyncio.Event().wait()
        yield  # an async generator


def test_a_direct_request_streams_in_a_slot_with_its_tenants_namespace_and_hashes(tmp_path):
    async def scenario() -> None:
        backend = StreamRecorder(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend)
        prompt = tuple(range(50))
        items, slots = [], []
        async for item in runner.direct.stream("acme", _request(prompt, 3, "conv-1")):
            items.append(item)
            slots.append(runner.slots_in_use())
        assert runner.slots_in_use() == {}
        assert slots == [{"acme": 1}] * len(items)  # the slot is held throughout
        [(sent, hashes)] = backend.streams
        assert (sent.namespace, sent.prompt, sent.batch) == (NS, prompt, False)
        assert hashes == hash_blocks(prompt, BLOCK, NS) and len(hashes) == 3
        chunks, result = items[:-1], items[-1]
        assert {type(c) for c in chunks} == {TokenChunk} and type(result) is StoredResult
        assert sent.request_id.startswith("gen-") and result.request_id == sent.request_id
        assert (result.index, result.custom_id, result.ok) == (0, "conv-1", True)
        assert result.output_tokens == tuple(t for c in chunks for t in c.token_ids)
        assert len(result.output_tokens) == 3
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a direct request")


@pytest.mark.parametrize("timeout_s, remaining_s", [(0.05, None), (60.0, 0.05), (60.0, -1.0)])
def test_a_direct_request_stops_at_the_earlier_of_its_two_deadlines(tmp_path, timeout_s,
                                                                    remaining_s):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, SilentStream(), timeout_s=timeout_s)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async for _ in runner.direct.stream("acme", _request((1, 2, 3), 1), (),
                                                remaining_s):
                pass
        assert loop.time() - start < 30.0  # never the 60 s request timeout
        assert runner.slots_in_use() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 45, "a direct request's deadline")


def test_a_direct_request_is_admitted_for_as_long_as_its_block_runs(tmp_path):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, SilentStream(), pending=2)
        with runner.direct.admitted("acme"):
            assert runner.pending() == {"acme": 1}
            with runner.direct.admitted("acme"):
                assert runner.pending() == {"acme": 2}
                with pytest.raises(Overloaded, match="tenant 'acme' has 2 requests pending"):
                    with runner.direct.admitted("acme"):
                        pass
                assert runner.pending() == {"acme": 2}  # the refused one counted nothing
        assert runner.pending() == {}
        with pytest.raises(KeyError):
            with runner.direct.admitted("acme"):
                raise KeyError("a failure inside the block")
        assert runner.pending() == {}
        runner.admit("acme", 2)  # a job's requests count against the same limit
        with pytest.raises(Overloaded):
            with runner.direct.admitted("acme"):
                pass
        runner.release("acme", 2)
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a direct request's admission")


def test_a_caller_that_leaves_mid_stream_is_traced_with_its_prompt(tmp_path):
    """The caller stops reading after the first chunk: the request span still says how many
    prompt tokens were admitted, that the client disconnected, and is marked CANCELLED."""
    from cluster.telemetry import attrs as A
    from cluster.telemetry.job_tracing import JobTracing
    from cluster.telemetry.observe import RequestObserver, ServedCache
    from router.cost import PriceTable
    from tests.support.telemetry_factories import in_memory

    async def scenario() -> None:
        tel, exporter, _ = in_memory(tmp_path)
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", BLOCK, 300.0, 10_000)))
        backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = JobRunner(store, backend, prepare_body,
                           RunnerLimits(max_concurrent=2, max_pending_per_tenant=10,
                                        max_pending_total=10, request_timeout_s=10.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK,
                           tracing=tracing)
        stream = runner.direct.stream("acme", _request(tuple(range(40)), 1500))
        assert type(await anext(stream)) is TokenChunk
        await stream.aclose()
        [span] = [s for s in exporter.get_finished_spans()
                  if s.attributes.get(A.SPAN_KIND) == "request"]
        assert span.attributes[A.GEN_AI_INPUT_TOKENS] == 40
        assert span.attributes[A.CLIENT_DISCONNECTED] is True
        assert span.attributes[A.ERROR_TYPE] == "CANCELLED"
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a caller that leaves")
