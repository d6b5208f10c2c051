"""``workers.engine.runtime.EngineRuntime`` once its engine thread ends: no caller waits on it.

A consumer of block events that raises (a bug on the engine thread) and a closed runtime both
end the thread; every run in flight, every call waiting and every later command raises
``WorkerFailed`` saying why, at once. A real engine on a tiny forged model.
"""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from router.kv.key import Namespace
from tests.bounded import run_bounded
from tests.engine_waits import answer, closed, hold, take, to_the_end
from tests.forged_models import tiny_model
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams, WorkerFailed
from workers.engine.runtime import EngineRuntime

BLOCK = 16
FAILED = r"^the engine thread failed: RuntimeError\('the feed is down'\)$"
CLOSED = r"^the engine runtime was closed$"


def _request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, Namespace("t", "tiny"), prompt,
                           SamplingParams(max_tokens=max_tokens))


async def _opened(runtime: EngineRuntime) -> EngineRuntime:
    await answer(runtime, runtime.open("w0", str(tiny_model()),
                                       EngineConfig(block_size=BLOCK, max_batch=4)), "open")
    return runtime


def test_an_event_consumer_that_raises_fails_every_run_and_call_at_once(caplog):
    def feed(batch):
        raise RuntimeError("the feed is down")

    async def scenario():
        runtime = await _opened(EngineRuntime(feed))
        runs = [runtime.run("w0", _request(f"r{i}", tuple(range(30 + i, 30 + i + 2 * BLOCK)), 50))
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


def test_commands_queued_behind_a_close_are_refused_as_closed():
    async def scenario():
        runtime = await _opened(EngineRuntime())
        held, gate = await hold(runtime)   # commands queue up behind it
        closing = asyncio.ensure_future(runtime.close())
        await asyncio.sleep(0)   # its Stop is queued behind the held call
        call = asyncio.ensure_future(runtime.call("w0", lambda engine: engine.busy))
        run = asyncio.ensure_future(anext(runtime.run("w0", _request("late", (1, 2, 3), 2))))
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


def test_a_closed_runtime_fails_its_runs_in_flight_and_refuses_what_comes_after():
    async def scenario():
        runtime = await _opened(EngineRuntime())
        run = runtime.run("w0", _request("long", tuple(range(10, 50)), 1500))
        await take(runtime, run, 1, "the first token")
        await closed(runtime)
        with pytest.raises(WorkerFailed, match=CLOSED):
            await to_the_end(runtime, run, "the run in flight")
        with pytest.raises(WorkerFailed, match=CLOSED):
            await answer(runtime, runtime.stats("w0"), "stats")
        with pytest.raises(WorkerFailed, match=CLOSED):
            await take(runtime, runtime.run("w0", _request("later", (1, 2, 3), 2)), 1, "later")
        await closed(runtime)   # a second close returns at once
    run_bounded(scenario(), 30, "a closed runtime")


def test_the_engine_thread_is_a_named_daemon_that_lives_until_close():
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


def test_a_request_the_engine_cannot_even_read_fails_alone():
    async def scenario():
        runtime = await _opened(EngineRuntime())
        broken = GenerateRequest("broken", Namespace("t", "tiny"), (1, 2, 3), None)
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute"):
            await to_the_end(runtime, runtime.run("w0", broken), "a request without sampling")
        done = await to_the_end(runtime, runtime.run("w0", _request("next", (1, 2, 3), 2)), "next")
        assert len(done) == 3   # the engine thread lives on
        await closed(runtime)
    run_bounded(scenario(), 30, "a request the engine cannot read")


def _cpu_s(thread: threading.Thread) -> float:
    """CPU time a thread of this process has used (Linux: its /proc task entry)."""
    with open(f"/proc/self/task/{thread.native_id}/stat", encoding="ascii") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
def test_an_idle_engine_thread_waits_for_commands_instead_of_spinning():
    async def scenario():
        runtime = await _opened(EngineRuntime(name="engine-idle"))
        [thread] = [t for t in threading.enumerate() if t.name == "engine-idle"]
        before = _cpu_s(thread)
        await asyncio.sleep(1.0)   # nothing to do: an engine thread waits on its queue
        used = _cpu_s(thread) - before
        assert used < 0.25, f"the idle engine thread used {used:.2f} s of CPU in 1 s"
        await closed(runtime)
    run_bounded(scenario(), 30, "an idle engine thread")
