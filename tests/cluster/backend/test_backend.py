"""``Backend`` over worker handles (``cluster.backend.backend``), on in-process engines
(``LocalBackend``): a worker that breaks under a request is put down and the request run
elsewhere, pulls are planned only where the launcher's workers pull, bad arguments are refused
with the fix, and what an operator sees of a worker (``worker_info``), exactly."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.backend.backend import worker_info
from cluster.backend.handle import PoolWorker, WorkerHello
from cluster.backend.local import LocalBackend
from cluster.backend.protocol import GenerateOutcome, WorkerInfo
from router.kv.key import hash_blocks
from router.router import WorkerStatus
from tests.support.bounded import run_bounded
from tests.support.forged_models import tiny_model
from tests.support.requests import routed_request
from workers.engine.engine import EngineConfig
from workers.messages import (DiskTierStats, GenerateRequest, ModelFacts, SamplingParams,
                              WorkerStats)

BLOCK = 16
PROMPT = tuple(range(40, 40 + 6 * BLOCK + 5))   # 6 full blocks and 5 tokens
LONG_PROMPT = tuple(random.Random(5).randrange(1, 250) for _ in range(200))   # 12 full blocks


class TestRequests:
    def test_a_worker_whose_engine_breaks_is_listed_dead_and_its_request_runs_elsewhere(self):
        def break_engine(engine):
            def boom():
                raise RuntimeError("MLX fell over")
            engine.step = boom

        async def scenario():
            backend = LocalBackend(tiny_model(), workers=2, engine=EngineConfig(block_size=BLOCK))
            await backend.start()
            try:
                request, hashes = routed_request(backend, "a", PROMPT, 2)
                victim = backend.pool.routes.router.route(request.namespace, hashes,
                                                          len(PROMPT)).worker_id
                await backend.runtime.call(victim, break_engine)
                outcome = await backend.generate(request, hashes)
                states = {w.worker_id: w.state for w in await backend.workers()}
                serving = [s.worker_id for s in backend.pool.routes.router.workers()]
                return victim, outcome, states, serving, backend.pool.replaced, \
                    (await backend.cache_stats()).workers
            finally:
                await backend.close()

        victim, outcome, states, serving, replaced, counted = run_bounded(
            scenario(), 60, "a broken engine")
        (other,) = {"local-0", "local-1"} - {victim}
        assert (outcome.attempts, outcome.worker_id) == (2, other)
        assert len(outcome.result.output_tokens) == 2
        assert states == {victim: "dead", other: "ready"}
        assert serving == [other] and replaced == 0 and counted == 1

    def test_an_in_process_backend_plans_no_pulls(self):
        async def scenario():
            backend = LocalBackend(tiny_model(), workers=2, engine=EngineConfig(block_size=BLOCK))
            await backend.start()
            try:
                assert backend.pool.routes.router.links is None
                ns = backend.model_info().namespace("t")
                out = await backend.generate(GenerateRequest("r", ns, LONG_PROMPT,
                                                             SamplingParams(max_tokens=2)),
                                             hash_blocks(LONG_PROMPT, BLOCK, ns))
                assert isinstance(out, GenerateOutcome) and out.pulled is None
            finally:
                await backend.close()
        asyncio.run(scenario())


class TestArguments:
    def test_workers_and_the_policy_are_checked(self):
        with pytest.raises(ValueError, match=">= 1"):
            LocalBackend(tiny_model(), workers=0)
        with pytest.raises(ValueError, match="policy"):
            LocalBackend(tiny_model(), policy="random")

    def test_the_model_and_the_pool_are_asked_for_only_after_start(self):
        backend = LocalBackend(tiny_model())
        with pytest.raises(RuntimeError, match=r"^model_info\(\) before start\(\)"):
            backend.model_info()
        with pytest.raises(RuntimeError, match="not started"):
            backend.pool

    def test_invalidation_needs_a_namespace(self):
        backend = LocalBackend(tiny_model())
        with pytest.raises(ValueError, match="^namespace: required; invalidation is per "
                                             "tenant namespace$"):
            asyncio.run(backend.invalidate(None, (1, 2, 3)))


def _hello(node: str) -> WorkerHello:
    return WorkerHello("w0", "n0", node, 7, ModelFacts("tiny", "r", 256, 2048, 16, 512), True)


class TestWorkerInfo:
    def test_joins_the_pools_view_the_workers_counts_and_its_queued_prefill(self):
        disk = DiskTierStats(3, 300, 1000, 50, 0, 0, 0, False)
        worker = PoolWorker("w0", state="draining", running=2, hello=_hello("10.0.0.5"))
        stats = WorkerStats(2, 4096, 8192, 8, 128, 200, 50, 9, evictions=4, expirations=1,
                            disk=disk)
        load = WorkerStatus("w0", True, 96, 2, 2, 8)
        assert worker_info(worker, stats, load) == WorkerInfo(
            "w0", "10.0.0.5", "draining", 2, 96, 4096, 8192, 8, 0.25, 9, 4, 1, disk)

    def test_a_worker_that_gave_no_counts_reads_as_zeros(self):
        info = worker_info(PoolWorker("w1"), None, None)
        assert info == WorkerInfo("w1", "", "starting", 0, 0, 0, 0, 0, 0.0, 0, 0, 0, None)
