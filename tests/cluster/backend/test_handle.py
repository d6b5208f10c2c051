"""What the backend keeps of a worker and hears from it (``cluster.backend.handle``): the hello
of a worker in this process, a pool worker as it starts, and ``engine_items``, a run on a real
``EngineRuntime`` told as a worker tells it (chunks, or one ``Prefilled``, then ``Finished``)."""
from __future__ import annotations

import os
import time

import pytest

from cluster.backend.handle import PoolWorker, WorkerHello, engine_items
from cluster.backend.protocol import TokenChunk
from cluster.backend.wire import Prefilled
from tests.support.bounded import run_bounded
from tests.support.forged_models import tiny_model
from tests.support.requests import generate_request
from workers.blas import openblas_in_use
from workers.engine.channel import Finished
from workers.engine.config import EngineConfig
from workers.engine.runtime import EngineRuntime
from workers.messages import ModelFacts

FACTS = ModelFacts("tiny", "r", 256, 2048, 16, 512)
PROMPT = tuple(range(20, 52))


RUNS = {"chunks": (3, True), "prefilled": (3, False), "one token": (1, False)}


@pytest.fixture(scope="module")
def told():
    """Each of ``RUNS`` on one tiny engine (opened once), as ``engine_items`` tells it."""
    async def scenario():
        runtime = EngineRuntime(None, time.monotonic)
        try:
            await runtime.open("w0", str(tiny_model()), EngineConfig(block_size=16),
                               time.monotonic)
            return {name: [item async for item in engine_items(
                        runtime, "w0", generate_request("r", PROMPT, max_tokens), chunks)]
                    for name, (max_tokens, chunks) in RUNS.items()}
        finally:
            await runtime.close()
    return run_bounded(scenario(), 60, "three runs told by engine_items")


class TestWorkerHello:
    def test_a_worker_here_reports_this_process(self):
        hello = WorkerHello.here("w3", "node-id", "10.0.0.2", FACTS)
        assert hello == WorkerHello("w3", "node-id", "10.0.0.2", os.getpid(), FACTS,
                                    openblas_in_use())


class TestPoolWorker:
    def test_starts_unstarted_idle_and_out_of_the_router(self):
        worker = PoolWorker("w0")
        assert (worker.state, worker.running, worker.in_router, worker.handle, worker.hello) \
            == ("starting", 0, False, None, None)


class TestEngineItems:
    def test_with_chunks_each_token_is_a_chunk_then_the_finished_run(self, told):
        items = told["chunks"]
        assert [type(i) for i in items] == [TokenChunk] * 3 + [Finished]
        assert all(c.request_id == "r" and len(c.token_ids) == 1 for c in items[:3])
        assert tuple(c.token_ids[0] for c in items[:3]) == items[-1].result.output_tokens

    def test_without_chunks_one_prefilled_stands_for_them(self, told):
        items = told["prefilled"]
        assert [type(i) for i in items] == [Prefilled, Finished]
        assert items[0] == Prefilled("r") and len(items[-1].result.output_tokens) == 3

    def test_one_token_asked_for_without_chunks_is_only_the_finished_run(self, told):
        items = told["one token"]
        assert [type(i) for i in items] == [Finished]
