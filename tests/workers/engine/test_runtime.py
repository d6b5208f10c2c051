"""``workers.engine.runtime.EngineRuntime``: one engine thread, typed commands, aborts that stop work.

A real engine on a tiny forged model; the runtime is driven from an asyncio loop as the
in-process backend and the worker actor drive it. Every wait is one that fails at once when
an answer was lost (``tests.engine_waits``), inside a wall-clock bound for the scenario.

``workers.engine.runtime.EngineRuntime`` once its engine thread ends: no caller waits on it.

A consumer of block events that raises (a bug on the engine thread) and a closed runtime both
end the thread; every run in flight, every call waiting and every later command raises
``WorkerFailed`` saying why, at once. A real engine on a tiny forged model.
"""
from __future__ import annotations

import asyncio
import time
import pytest
from router.kv.events import BlockRemoved
from router.kv.key import Namespace
from tests.support.bounded import run_bounded
from tests.support.engine_waits import answer, closed, hold, idle, settle, take, to_the_end
from tests.support.forged_models import tiny_model
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams, WorkerFailed, WorkerStats
from workers.engine.runtime import IDLE_WAIT_S, EngineRuntime, Finished
import os
import threading
from tests.support.engine_waits import answer, closed, hold, take, to_the_end
from tests.support.requests import generate_request
from workers.messages import GenerateRequest, SamplingParams, WorkerFailed
from workers.engine.runtime import EngineRuntime


BLOCK = 16

STEP_S = 5.0   # a step of the tiny model takes milliseconds: none in this long is a stall

NO_ENGINE = "^worker {} has no engine \\(not started, broken or retired\\)$"

async def _runtime(events: list, idle_wait_s: float = IDLE_WAIT_S, **config) -> EngineRuntime:
    runtime = EngineRuntime(events.append, idle_wait_s=idle_wait_s)
    await answer(runtime, runtime.open("w0", str(tiny_model()),
                                       EngineConfig(block_size=BLOCK, max_batch=4, **config)),
                 "open w0")
    return runtime


class TestBehaviour:
    def test_a_run_yields_deltas_then_finished_and_counts_what_the_store_wrote(self):
        async def scenario():
            events: list = []
            runtime = await _runtime(events)
            prompt = tuple(range(30, 30 + 4 * BLOCK))
            started = time.monotonic()
            items = await to_the_end(runtime, runtime.run("w0", generate_request("a", prompt, 3)), "run a")
            took = time.monotonic() - started
            assert len(items) == 4 and isinstance(items[-1], Finished)
            assert [d.token for d in items[:-1]] == list(items[-1].result.output_tokens)
            assert all(d.request_id == "a" for d in items[:-1])
            # the worker's time: from receipt to after the step's cache writes, within the run
            timings = items[-1].result.timings
            assert (timings.finished_ns - timings.received_ns) / 1e9 <= items[-1].worker_s <= took
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            kv = (await answer(runtime, runtime.call("w0", lambda e: e), "engine")).kv_bytes_per_token
            # 64 prompt tokens + 2 more in the cache at the end: 4 full blocks, written once
            assert stats == WorkerStats(running=0, cache_bytes=4 * BLOCK * kv,
                                        cache_capacity_bytes=1 << 30, cache_blocks=4,
                                        written_tokens=64, input_tokens=64, cached_tokens=0,
                                        requests_served=1, evictions=0, expirations=0)
            assert items[-1].result.written_tokens == 4 * BLOCK
            for rid in ("b", "c"):
                again = await to_the_end(runtime, runtime.run("w0", generate_request(rid, prompt, 1)), rid)
                assert again[-1].result.cached_tokens == 63  # a kept cache; the last token recomputed
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert (stats.requests_served, stats.input_tokens, stats.cached_tokens) == (3, 192, 126)
            assert [b.seq for b in events] == list(range(1, len(events) + 1))
            assert {b.worker_id for b in events} == {"w0"} and events[-1].rates is None  # no disk
            holdings = await answer(runtime, runtime.holdings("w0"), "holdings")
            assert holdings.seq == events[-1].seq and len(holdings.blocks) == 4
            assert holdings.disk_blocks == ()
            with pytest.raises(ValueError, match="vocabulary"):
                await to_the_end(runtime, runtime.run("w0", generate_request("bad", (10**9,), 2)), "bad")
            with pytest.raises(WorkerFailed, match=NO_ENGINE.format("nobody")):
                await answer(runtime, runtime.call("nobody", lambda engine: engine.busy), "nobody")
            with pytest.raises(WorkerFailed, match=NO_ENGINE.format("nobody")):
                await to_the_end(runtime, runtime.run("nobody", generate_request("n", (1, 2), 1)), "nobody")
            await closed(runtime)
        run_bounded(scenario(), 30, "a run, its stats and holdings")

    def test_a_call_answers_its_value_or_raises_its_exception_and_a_second_open_reuses(self):
        async def scenario():
            runtime = await _runtime([])
            engine = await answer(runtime, runtime.call("w0", lambda engine: engine), "the engine")
            assert await answer(runtime, runtime.call("w0", lambda e: e.vocab_size), "vocab") \
                == engine.vocab_size
            with pytest.raises(KeyError, match="'missing'"):
                await answer(runtime, runtime.call("w0", lambda e: {}["missing"]), "a raising call")
            again = await answer(runtime, runtime.open("w0", "/nowhere", EngineConfig()), "reopen")
            assert again is engine   # w0 is open: its engine, the model directory never read
            await closed(runtime)
        run_bounded(scenario(), 30, "a call's value or exception")

    def test_closing_runs_early_aborts_them_before_the_next_step(self):
        async def scenario():
            runtime = await _runtime([])
            runs = [runtime.run("w0", generate_request(f"r{i}", tuple(range(40 + i, 72 + i)), 1500))
                    for i in range(16)]
            firsts = [(await take(runtime, run, 1, f"r{i}"))[0] for i, run in enumerate(runs[:4])]
            assert [f.request_id for f in firsts] == ["r0", "r1", "r2", "r3"]  # 4 decode, 12 queued
            for run in runs:
                await run.aclose()   # a consumer that gives up: the runtime sends Abort
            # Commands run in order on the engine thread: the aborts came first, so by this call
            # no step has run for them and the engine holds nothing.
            assert await answer(runtime, runtime.call("w0", lambda e: e.busy), "busy") is False
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert (stats.written_tokens, stats.running, stats.requests_served) == (4 * 2 * BLOCK, 0, 0)
            # nothing queues behind them: a new request finishes at once
            done = await to_the_end(runtime, runtime.run("w0", generate_request("next", tuple(range(5, 40)), 2)),
                                    "next")
            assert isinstance(done[-1], Finished) and done[-1].result.cached_tokens == 0
            await closed(runtime)
        run_bounded(scenario(), 30, "closing runs early aborts them before the next step")

    def test_abort_from_elsewhere_ends_the_run_without_a_result(self):
        async def scenario():
            runtime = await _runtime([])
            run = runtime.run("w0", generate_request("long", tuple(range(10, 50)), 1500))
            first = (await take(runtime, run, 1, "long"))[0]
            assert (await answer(runtime, runtime.stats("w0"), "stats")).running == 1
            runtime.abort("long")
            rest = await to_the_end(runtime, run, "long, aborted")
            assert first.request_id == "long" and not any(isinstance(i, Finished) for i in rest)
            assert len(rest) < 1500
            assert await answer(runtime, runtime.call("w0", lambda e: e.busy), "busy") is False
            runtime.abort("long")          # already gone: nothing happens
            runtime.abort("never-sent")
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert (stats.running, stats.requests_served) == (0, 0)
            await closed(runtime)
        run_bounded(scenario(), 30, "abort from elsewhere ends the run without a result")

    def test_a_broken_engine_fails_its_runs_and_leaves(self, caplog):
        steps: list[int] = []

        def break_engine(engine):
            def boom():
                steps.append(1)
                raise RuntimeError("MLX fell over")
            engine.step = boom

        async def scenario():
            runtime = await _runtime([])
            await answer(runtime, runtime.call("w0", break_engine), "break the engine")
            run = runtime.run("w0", generate_request("x", (1, 2, 3), 4))
            first = asyncio.ensure_future(anext(run))
            while not first.done() and len(steps) < 2 and not await idle(runtime, "w0"):
                await asyncio.sleep(0.01)
            await settle()
            assert steps == [1], "the broken engine was stepped again: it was not dropped"
            with pytest.raises(WorkerFailed, match=r"^worker w0 failed: RuntimeError\('MLX fell over'\)$"):
                first.result()   # not done: InvalidStateError
            with pytest.raises(WorkerFailed, match=NO_ENGINE.format("w0")):
                await answer(runtime, runtime.stats("w0"), "stats")
            await closed(runtime)
        run_bounded(scenario(), 30, "a broken engine fails its runs and leaves")
        [record] = [r for r in caplog.records if r.name == "workers.engine.runtime"]
        assert (record.getMessage(), record.exc_info[1].args) == (
            "worker w0: engine step failed", ("MLX fell over",))

    def test_retiring_or_stopping_an_engine_persists_its_store_for_the_next_start(self, tmp_path):
        prompt = tuple(range(30, 30 + 4 * BLOCK))

        async def held_after_restart(directory, stop) -> list:
            config = EngineConfig(block_size=BLOCK, max_batch=4, worker_id="w0",
                                  disk_dir=str(directory), disk_bytes=64 * 2**20)
            events: list = []
            runtime = EngineRuntime(events.append)
            await answer(runtime, runtime.open("w0", str(tiny_model()), config), "open")
            await to_the_end(runtime, runtime.run("w0", generate_request("a", prompt, 3)), "a")
            assert events[-1].rates.disk_bytes_per_token > 0   # a disk tier: the router's rates
            await stop(runtime)
            again = EngineRuntime()
            await answer(again, again.open("w0", str(tiny_model()), config), "reopen")
            held = await answer(again, again.holdings("w0"), "holdings")
            await closed(again)
            assert held.blocks == () and held.seq == 0  # a restarted worker's cache is all on disk
            return held.disk_blocks

        async def retire(runtime):
            run = runtime.run("w0", generate_request("b", tuple(range(200, 240)), 1500))
            await take(runtime, run, 1, "b")
            runtime.retire("w0")
            with pytest.raises(WorkerFailed, match="^worker w0 left mid-request$"):
                await to_the_end(runtime, run, "b, retired")
            with pytest.raises(WorkerFailed, match=NO_ENGINE.format("w0")):
                await answer(runtime, runtime.stats("w0"), "stats")
            runtime.retire("w0")   # again: nothing left to drop, and the thread goes on
            with pytest.raises(WorkerFailed, match=NO_ENGINE.format("w0")):
                await answer(runtime, runtime.stats("w0"), "stats after a second retire")
            await closed(runtime)

        async def scenario():
            # nothing was evicted: only closing the engine wrote its memory blocks to disk (b's 2
            # full blocks too, when it was retired mid-request)
            assert len(await held_after_restart(tmp_path / "retired", retire)) == 6
            assert len(await held_after_restart(tmp_path / "stopped", closed)) == 4
        run_bounded(scenario(), 30, "retire or stop, then restart on the same directory")

    def test_idle_engines_drop_expired_blocks_once_a_second_of_the_runtime_clock(self, clock):
        async def scenario():
            clock.now = 100.0
            events: list = []
            runtime = EngineRuntime(events.append, clock=clock)   # its last expiry pass: 100.0
            config = EngineConfig(block_size=BLOCK, max_batch=4, ttl_s=0.5, kept_bytes=0)
            await answer(runtime, runtime.open("w0", str(tiny_model()), config, clock), "open")
            await to_the_end(runtime, runtime.run("w0", generate_request("a", tuple(range(30, 62)), 1)), "a")
            stored = [e.block for batch in events for e in batch.events]
            assert len(stored) == 2
            clock.now = 100.999   # past the blocks' TTL, not yet a second after the last pass
            await asyncio.sleep(0.5)   # ten idle turns of the engine thread
            held = await answer(runtime, runtime.holdings("w0"), "holdings")
            assert sorted(held.blocks) == sorted(stored) and len(events) == 1
            clock.now = 101.0     # a second after: the next idle turn drops them and says so
            while (held := await answer(runtime, runtime.holdings("w0"), "holdings")).blocks:
                await asyncio.sleep(0.01)   # bounded by the scenario's own limit
            assert held.seq == 2
            assert sorted(e.block for e in events[1].events) == sorted(stored)
            assert all(isinstance(e, BlockRemoved) for e in events[1].events)
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert (stats.expirations, stats.evictions, stats.cache_blocks) == (2, 0, 0)
            await closed(runtime)
        run_bounded(scenario(), 30, "idle expiry")

    def test_a_busy_engine_steps_without_waiting_for_commands(self):
        async def scenario():
            # an idle wait longer than a step may take: a busy loop that waited for commands
            # between steps would stall each one for 2 x STEP_S
            runtime = await _runtime([], idle_wait_s=2 * STEP_S)
            run = runtime.run("w0", generate_request("a", (5, 6, 7), 200))
            items = await take(runtime, run, 1, "a's first token")   # the prefill
            while True:   # no probes, which are commands: the engine gets none while it decodes
                try:
                    items.append(await asyncio.wait_for(anext(run), STEP_S))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise AssertionError(f"no step for {STEP_S:g} s after {len(items)} items: "
                                         "the busy loop waits between steps") from None
            assert len(items) == 201 and isinstance(items[-1], Finished)
            await closed(runtime)
        run_bounded(scenario(), 30, "a busy engine's steps")

    def test_commands_queued_together_are_all_handled_before_the_next_step(self):
        async def scenario():
            runtime = await _runtime([])
            held, gate = await hold(runtime)   # commands queue up behind it
            run = runtime.run("w0", generate_request("gone", (5, 6, 7), 50))
            first = asyncio.ensure_future(anext(run))
            await asyncio.sleep(0)   # its Submit is queued
            runtime.abort("gone")    # and its Abort right behind it
            gate.set()
            assert await answer(runtime, held, "the held call") is True
            with pytest.raises(StopAsyncIteration):   # aborted before any step: not one token
                await answer(runtime, first, "the run aborted behind its submit")
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert (stats.running, stats.requests_served, stats.written_tokens) == (0, 0, 0)
            await closed(runtime)
        run_bounded(scenario(), 30, "commands queued together")

    def test_a_run_left_open_after_its_finished_never_aborts_a_later_run_of_its_id(self):
        async def scenario():
            runtime = await _runtime([])
            first = runtime.run("w0", generate_request("same", (5, 6, 7), 2))
            items = await take(runtime, first, 3, "the first run")   # 2 tokens, then Finished
            assert isinstance(items[-1], Finished)
            second = runtime.run("w0", generate_request("same", (5, 6, 7), 50))
            await take(runtime, second, 1, "the second run's first token")
            await first.aclose()   # the first run ends only now, with the second running
            rest = await to_the_end(runtime, second, "the second run")
            assert len(rest) == 50 and isinstance(rest[-1], Finished)
            assert rest[-1].result.output_tokens[1:] == tuple(d.token for d in rest[:-1])
            await closed(runtime)
        run_bounded(scenario(), 30, "a finished run closed late")

    def test_a_call_s_block_events_are_published_under_its_worker(self):
        async def scenario():
            events: list = []
            runtime = await _runtime(events, kept_bytes=0)
            await to_the_end(runtime, runtime.run("w0", generate_request("a", tuple(range(30, 62)), 1)), "a")
            assert [(b.worker_id, b.seq, len(b.events)) for b in events] == [("w0", 1, 2)]
            dropped = await answer(runtime, runtime.call(
                "w0", lambda engine: engine.invalidate(Namespace("t", "tiny"))), "invalidate")
            assert dropped == 2
            assert [(b.worker_id, b.seq, len(b.events)) for b in events] == [("w0", 1, 2),
                                                                              ("w0", 2, 2)]
            assert all(isinstance(e, BlockRemoved) for e in events[1].events)
            await closed(runtime)
        run_bounded(scenario(), 30, "a call's events")

    def test_an_engine_keeps_time_by_the_clock_it_was_opened_with(self, clock):
        async def scenario():
            clock.now = 0.0
            runtime = EngineRuntime(clock=clock)
            config = EngineConfig(block_size=BLOCK, max_batch=4, ttl_s=10.0, kept_bytes=0)
            await answer(runtime, runtime.open("w0", str(tiny_model()), config, clock), "open")
            await to_the_end(runtime, runtime.run("w0", generate_request("a", tuple(range(30, 62)), 1)), "a")
            expire = runtime.call("w0", lambda engine: engine.expire())
            assert await answer(runtime, expire, "expire at 0 s") == 0
            assert len((await answer(runtime, runtime.holdings("w0"), "holdings")).blocks) == 2
            clock.now = 10.5   # past the TTL on the engine's clock (not 10 s of real time)
            await answer(runtime, runtime.call("w0", lambda engine: engine.expire()), "expire")
            assert (await answer(runtime, runtime.holdings("w0"), "holdings")).blocks == ()
            await closed(runtime)
        run_bounded(scenario(), 30, "the engine's clock")

    def test_a_store_that_cannot_be_persisted_at_retire_is_logged_and_the_runtime_goes_on(self, caplog):
        def no_space() -> None:
            raise OSError(28, "No space left on device")

        async def scenario():
            runtime = await _runtime([])
            await answer(runtime, runtime.call("w0", lambda engine: setattr(engine, "close", no_space)),
                         "a disk that fills at close")
            runtime.retire("w0")
            with pytest.raises(WorkerFailed, match=NO_ENGINE.format("w0")):
                await answer(runtime, runtime.stats("w0"), "stats")
            failed = [r for r in caplog.records if r.name == "workers.engine.runtime"]
            assert [(r.levelname, r.getMessage()) for r in failed] == [
                ("ERROR", "worker w0: persisting its prefix store at shutdown failed")]
            assert isinstance(failed[0].exc_info[1], OSError)
            assert runtime.alive
            await closed(runtime)
            assert not runtime.alive
        run_bounded(scenario(), 30, "a store that cannot be persisted")

    def test_stats_count_what_a_full_store_evicted(self):
        async def scenario():
            runtime = EngineRuntime()
            config = EngineConfig(block_size=BLOCK, max_batch=4, store_bytes=4 * BLOCK * 512,
                                  kept_bytes=0)
            engine = await answer(runtime, runtime.open("w0", str(tiny_model()), config), "open")
            assert engine.kv_bytes_per_token == 512   # room for 4 blocks of the tiny model
            for rid, first in (("a", 30), ("b", 130)):
                prompt = tuple(range(first, first + 4 * BLOCK))
                await to_the_end(runtime, runtime.run("w0", generate_request(rid, prompt, 3)), rid)
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert stats == WorkerStats(running=0, cache_bytes=4 * BLOCK * 512,
                                        cache_capacity_bytes=4 * BLOCK * 512, cache_blocks=4,
                                        written_tokens=128, input_tokens=128, cached_tokens=0,
                                        requests_served=2, evictions=4, expirations=0)
            await closed(runtime)
        run_bounded(scenario(), 30, "evictions in the stats")

    def test_two_engines_on_one_thread_step_while_either_is_busy_and_may_share_request_ids(self):
        async def scenario():
            runtime = await _runtime([], idle_wait_s=2 * STEP_S)   # a wait between steps: a stall
            await answer(runtime, runtime.open("w1", str(tiny_model()),
                                               EngineConfig(block_size=BLOCK, max_batch=4)), "open w1")
            run = runtime.run("w0", generate_request("a", (5, 6, 7), 200))
            items = []
            while True:   # w1 idle all along: the thread still steps w0 at once
                try:
                    items.append(await asyncio.wait_for(anext(run), STEP_S))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise AssertionError(f"no step for {STEP_S:g} s beside an idle engine") from None
            assert len(items) == 201
            # the same request id on both workers: each run ends with its own result
            runs = [runtime.run(w, generate_request("dup", (9, 10, 11), 5)) for w in ("w0", "w1")]
            done = await asyncio.gather(*(to_the_end(runtime, r, f"dup on {w}", w)
                                          for r, w in zip(runs, ("w0", "w1"))))
            assert [len(d) for d in done] == [6, 6]
            assert all(isinstance(d[-1], Finished) for d in done)
            served = [(await answer(runtime, runtime.stats(w), w)).requests_served for w in ("w0", "w1")]
            assert served == [2, 1]
            await closed(runtime)
        run_bounded(scenario(), 30, "two engines on one thread")


FAILED = r"^the engine thread failed: RuntimeError\('the feed is down'\)$"

CLOSED = r"^the engine runtime was closed$"

async def _opened(runtime: EngineRuntime) -> EngineRuntime:
    await answer(runtime, runtime.open("w0", str(tiny_model()),
                                       EngineConfig(block_size=BLOCK, max_batch=4)), "open")
    return runtime

def _cpu_s(thread: threading.Thread) -> float:
    """CPU time a thread of this process has used (Linux: its /proc task entry)."""
    with open(f"/proc/self/task/{thread.native_id}/stat", encoding="ascii") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


class TestEnds:
    def test_an_event_consumer_that_raises_fails_every_run_and_call_at_once(self, caplog):
        def feed(batch):
            raise RuntimeError("the feed is down")

        async def scenario():
            runtime = await _opened(EngineRuntime(feed))
            runs = [runtime.run("w0", generate_request(f"r{i}", tuple(range(30 + i, 30 + i + 2 * BLOCK)), 50))
                    for i in range(2)]
            with pytest.raises(WorkerFailed, match=FAILED):  # its step publishes: the feed raises
                await take(runtime, runs[0], 1, "the first run")
            with pytest.raises(WorkerFailed, match=FAILED):   # sent after the thread ended
                await take(runtime, runs[1], 1, "the second run")
            with pytest.raises(WorkerFailed, match=FAILED):
                await answer(runtime, runtime.call("w0", lambda engine: engine.busy), "a call")
            with pytest.raises(WorkerFailed, match=FAILED):
                await answer(runtime, runtime.open("w1", str(tiny_model()),
                                                   EngineConfig(block_size=BLOCK)), "an open")
            runtime.abort("r0")      # nothing to answer: neither raises nor waits
            runtime.retire("w0")
            await closed(runtime)
            logged = [r for r in caplog.records if r.name == "workers.engine.runtime"]
            assert [(r.levelname, r.getMessage()) for r in logged] == [
                ("ERROR", "the engine thread failed")]
            assert str(logged[0].exc_info[1]) == "the feed is down"
        run_bounded(scenario(), 30, "an event consumer that raises")

    def test_commands_queued_behind_a_close_are_refused_as_closed(self):
        async def scenario():
            runtime = await _opened(EngineRuntime())
            held, gate = await hold(runtime)   # commands queue up behind it
            closing = asyncio.ensure_future(runtime.close())
            await asyncio.sleep(0)   # its Stop is queued behind the held call
            call = asyncio.ensure_future(runtime.call("w0", lambda engine: engine.busy))
            run = asyncio.ensure_future(anext(runtime.run("w0", generate_request("late", (1, 2, 3), 2))))
            await asyncio.sleep(0)
            gate.set()
            assert await answer(runtime, held, "the held call") is True
            with pytest.raises(WorkerFailed, match=CLOSED):
                await answer(runtime, call, "a call queued behind the close")
            with pytest.raises(WorkerFailed, match=CLOSED):
                await answer(runtime, run, "a run queued behind the close")
            await closing
            assert not runtime.alive
        run_bounded(scenario(), 30, "commands queued behind a close")

    def test_a_closed_runtime_fails_its_runs_in_flight_and_refuses_what_comes_after(self):
        async def scenario():
            runtime = await _opened(EngineRuntime())
            run = runtime.run("w0", generate_request("long", tuple(range(10, 50)), 1500))
            await take(runtime, run, 1, "the first token")
            await closed(runtime)
            with pytest.raises(WorkerFailed, match=CLOSED):
                await to_the_end(runtime, run, "the run in flight")
            with pytest.raises(WorkerFailed, match=CLOSED):
                await answer(runtime, runtime.stats("w0"), "stats")
            with pytest.raises(WorkerFailed, match=CLOSED):
                await take(runtime, runtime.run("w0", generate_request("later", (1, 2, 3), 2)), 1, "later")
            await closed(runtime)   # a second close returns at once
        run_bounded(scenario(), 30, "a closed runtime")

    def test_the_engine_thread_is_a_named_daemon_that_lives_until_close(self):
        async def scenario():
            runtime, named = EngineRuntime(), EngineRuntime(name="engine-w7")
            await asyncio.sleep(0.1)
            threads = {t.name: t for t in threading.enumerate()}
            for name in ("orchard-engines", "engine-w7"):   # a daemon: never holds up an exit
                assert threads[name].is_alive() and threads[name].daemon is True, name
            await closed(runtime)
            await closed(named)
            assert not threads["engine-w7"].is_alive() and not threads["orchard-engines"].is_alive()
        run_bounded(scenario(), 30, "the engine thread")

    def test_a_request_the_engine_cannot_even_read_fails_alone(self):
        async def scenario():
            runtime = await _opened(EngineRuntime())
            broken = GenerateRequest("broken", Namespace("t", "tiny"), (1, 2, 3), None)
            with pytest.raises(AttributeError, match="'NoneType' object has no attribute"):
                await to_the_end(runtime, runtime.run("w0", broken), "a request without sampling")
            done = await to_the_end(runtime, runtime.run("w0", generate_request("next", (1, 2, 3), 2)), "next")
            assert len(done) == 3   # the engine thread lives on
            await closed(runtime)
        run_bounded(scenario(), 30, "a request the engine cannot read")

    @pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
    def test_an_idle_engine_thread_waits_for_commands_instead_of_spinning(self):
        async def scenario():
            runtime = await _opened(EngineRuntime(name="engine-idle"))
            [thread] = [t for t in threading.enumerate() if t.name == "engine-idle"]
            before = _cpu_s(thread)
            await asyncio.sleep(1.0)   # nothing to do: an engine thread waits on its queue
            used = _cpu_s(thread) - before
            assert used < 0.25, f"the idle engine thread used {used:.2f} s of CPU in 1 s"
            await closed(runtime)
        run_bounded(scenario(), 30, "an idle engine thread")

    def test_stats_count_what_a_full_disk_tier_evicted(self, tmp_path):
        """Memory and disk hold 4 blocks each: the second prompt's blocks spill the first's to
        disk, the third's spill the second's there, evicting the first's from disk for good."""
        async def scenario():
            runtime = EngineRuntime()
            probe = await answer(runtime, runtime.open("p", str(tiny_model()), EngineConfig(
                block_size=BLOCK, disk_dir=str(tmp_path / "probe"), disk_bytes=2**20)), "probe")
            disk_block = BLOCK * probe.disk_kv_bytes_per_token
            config = EngineConfig(block_size=BLOCK, max_batch=4, store_bytes=4 * BLOCK * 512,
                                  kept_bytes=0, disk_dir=str(tmp_path / "disk"),
                                  disk_bytes=4 * disk_block)
            await answer(runtime, runtime.open("w0", str(tiny_model()), config), "open")
            for rid, first in (("a", 30), ("b", 130), ("c", 230)):
                prompt = tuple(range(first, first + 4 * BLOCK))
                await to_the_end(runtime, runtime.run("w0", generate_request(rid, prompt, 3)), rid)
            stats = await answer(runtime, runtime.stats("w0"), "stats")
            assert (stats.evictions, stats.disk.evictions, stats.disk.blocks) == (8, 4, 4)
            await closed(runtime)
        run_bounded(scenario(), 30, "disk evictions in the stats")
