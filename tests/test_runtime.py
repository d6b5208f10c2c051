"""``workers.runtime.EngineRuntime``: one engine thread, typed commands, aborts that stop work.

A real engine on a tiny forged model; the runtime is driven from an asyncio loop as the
in-process backend and the worker actor drive it.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.key import Namespace
from tests.forged_models import tiny_model
from workers.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams, WorkerFailed
from workers.runtime import EngineRuntime, Finished

BLOCK = 16


def _request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, Namespace("t", "tiny"), prompt,
                           SamplingParams(max_tokens=max_tokens))


async def _runtime(events: list) -> EngineRuntime:
    runtime = EngineRuntime(events.append)
    await runtime.open("w0", str(tiny_model()), EngineConfig(block_size=BLOCK, max_batch=4))
    return runtime


def test_a_run_yields_deltas_then_finished_and_counts_what_the_store_wrote():
    async def scenario():
        events: list = []
        runtime = await _runtime(events)
        prompt = tuple(range(30, 30 + 4 * BLOCK))
        items = [i async for i in runtime.run("w0", _request("a", prompt, 3))]
        assert len(items) == 4 and isinstance(items[-1], Finished)
        assert [d.token for d in items[:-1]] == list(items[-1].result.output_tokens)
        stats = await runtime.stats("w0")
        # 64 prompt tokens + 2 more in the cache at the end: 4 full blocks, written once
        assert stats.written_tokens == 4 * BLOCK == items[-1].result.written_tokens
        assert (stats.requests_served, stats.input_tokens, stats.running) == (1, 64, 0)
        assert [b.seq for b in events] == list(range(1, len(events) + 1))
        holdings = await runtime.holdings("w0")
        assert holdings.seq == events[-1].seq and len(holdings.blocks) == 4
        with pytest.raises(ValueError, match="vocabulary"):
            [i async for i in runtime.run("w0", _request("bad", (10**9,), 2))]
        with pytest.raises(WorkerFailed, match="no engine"):
            await runtime.call("nobody", lambda engine: engine.busy)
        await runtime.close()
    asyncio.run(scenario())


def test_closing_runs_early_aborts_them_before_the_next_step():
    async def scenario():
        runtime = await _runtime([])
        runs = [runtime.run("w0", _request(f"r{i}", tuple(range(40 + i, 72 + i)), 1500))
                for i in range(16)]
        firsts = await asyncio.gather(*(anext(r) for r in runs[:4]))  # 4 decode, 12 queued
        assert all(f.request_id == f"r{i}" for i, f in enumerate(firsts))
        for run in runs:
            await run.aclose()   # a consumer that gives up: the runtime sends Abort
        # Commands run in order on the engine thread: the aborts came first, so by this call
        # no step has run for them and the engine holds nothing.
        assert await runtime.call("w0", lambda engine: engine.busy) is False
        written = (await runtime.stats("w0")).written_tokens
        await asyncio.sleep(0.2)
        assert (await runtime.stats("w0")).written_tokens == written == 4 * 2 * BLOCK
        # nothing queues behind them: a new request finishes at once
        done = [i async for i in runtime.run("w0", _request("next", tuple(range(5, 40)), 2))]
        assert isinstance(done[-1], Finished) and done[-1].result.cached_tokens == 0
        await runtime.close()
    asyncio.run(scenario())


def test_abort_from_elsewhere_ends_the_run_without_a_result():
    async def scenario():
        runtime = await _runtime([])
        run = runtime.run("w0", _request("long", tuple(range(10, 50)), 1500))
        first = await anext(run)
        runtime.abort("long")
        rest = [i async for i in run]
        assert first.request_id == "long" and not any(isinstance(i, Finished) for i in rest)
        assert len(rest) < 1500 and await runtime.call("w0", lambda e: e.busy) is False
        await runtime.close()
    asyncio.run(scenario())


def test_a_broken_engine_fails_its_runs_and_leaves():
    async def scenario():
        runtime = await _runtime([])

        def break_engine(engine):
            def boom():
                raise RuntimeError("MLX fell over")
            engine.step = boom
        await runtime.call("w0", break_engine)
        with pytest.raises(WorkerFailed, match="MLX fell over"):
            async with contextlib.aclosing(runtime.run("w0", _request("x", (1, 2, 3), 4))) as run:
                async for _ in run:
                    pass
        with pytest.raises(WorkerFailed, match="no engine"):
            await runtime.stats("w0")
        await runtime.close()
    asyncio.run(scenario())


def test_retiring_or_stopping_an_engine_persists_its_store_for_the_next_start(tmp_path):
    prompt = tuple(range(30, 30 + 4 * BLOCK))

    async def held_after_restart(directory, stop) -> list:
        config = EngineConfig(block_size=BLOCK, max_batch=4, worker_id="w0",
                              disk_dir=str(directory), disk_bytes=64 * 2**20)
        runtime = EngineRuntime()
        await runtime.open("w0", str(tiny_model()), config)
        [i async for i in runtime.run("w0", _request("a", prompt, 3))]
        await stop(runtime)
        again = EngineRuntime()
        await again.open("w0", str(tiny_model()), config)
        held = await again.holdings("w0")
        await again.close()
        assert held.blocks == ()  # a restarted worker's cache is all on disk
        return held.disk_blocks

    async def retire(runtime):
        runtime.retire("w0")
        with pytest.raises(WorkerFailed, match="no engine"):  # the retire has been handled
            await runtime.stats("w0")
        await runtime.close()

    async def scenario():
        # nothing was evicted: only closing the engine wrote its 4 memory blocks to disk
        assert len(await held_after_restart(tmp_path / "retired", retire)) == 4
        assert len(await held_after_restart(tmp_path / "stopped", EngineRuntime.close)) == 4
    asyncio.run(scenario())
