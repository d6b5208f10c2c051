"""Waits on ``workers.engine.runtime.EngineRuntime`` that fail at once when an answer was lost.

The engine thread handles commands in the order they were sent and hands each answer to the
caller's loop as it handles it, so once a later command has been answered every earlier
answer is already here. ``answer`` sends two probes after a command (a call and a run for a
worker that does not exist, answered at once, one through the call path and one through the
run path) and fails, naming the command, if its answer is not here when a probe's is.
``to_the_end`` consumes a run: once the engine is idle everything for the run has been sent,
so a run that would wait for more fails, saying so, instead of waiting; so does a run on a
busy engine that yields nothing for ``STALL_S`` (its steps stopped), and a command when the
thread answers not even a probe for ``STALL_S`` (it takes no commands). A command whose engine
thread has ended without answering it fails at once, and ``closed`` closes a runtime, failing
at once if the thread still serves commands after its ``Stop``.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Awaitable, TypeVar

from router.kv.key import Namespace
from workers.messages import GenerateRequest, SamplingParams, WorkerFailed
from workers.engine.runtime import EngineRuntime

T = TypeVar("T")

NOBODY = "no-such-worker"
POLL_S = 0.02  # how often ``to_the_end`` asks a quiet engine whether it is idle
STALL_S = 10.0  # a busy engine that yields nothing this long takes no steps, a thread that
#                 answers no probe this long takes no commands (each takes milliseconds)


async def hold(runtime: EngineRuntime, worker_id: str = "w0"
               ) -> tuple[asyncio.Future, threading.Event]:
    """Keep the engine thread busy in a call, so that commands queue up behind it, until the
    returned event is set; the future is that call (``True`` once let go)."""
    entered, gate = threading.Event(), threading.Event()

    def held(engine) -> bool:
        entered.set()
        return gate.wait(10)

    await runtime.call(worker_id, lambda engine: None)   # what earlier waits sent is handled
    call = asyncio.ensure_future(runtime.call(worker_id, held))
    assert await asyncio.to_thread(entered.wait, 10), "the engine thread never took the call"
    return call, gate


async def closed(runtime: EngineRuntime) -> None:
    """``runtime.close()``, failing at once if the engine thread serves a command sent after
    it (its ``Stop`` was lost) instead of waiting for a thread that will not end."""
    closing = asyncio.ensure_future(runtime.close())
    await asyncio.sleep(0)   # its Stop is sent
    try:
        await answer(runtime, runtime.call(NOBODY, lambda engine: None), "a call after close")
    except WorkerFailed as refused:   # refused: the thread stopped (or had ended before)
        assert not str(refused).startswith(f"worker {NOBODY} "), (
            f"close: the engine thread still serves commands ({refused})")
    await closing


async def settle() -> None:
    """Let the loop run every callback already scheduled (the engine thread's answers)."""
    for _ in range(3):
        await asyncio.sleep(0)


async def answer(runtime: EngineRuntime, awaitable: Awaitable[T], what: str) -> T:
    """``await awaitable`` (a runtime command), failing at once if its answer was lost."""
    task = asyncio.ensure_future(awaitable)
    await asyncio.sleep(0)  # the task has sent its command
    if not task.done():
        probes = [asyncio.ensure_future(_probe_call(runtime)),
                  asyncio.ensure_future(_probe_run(runtime))]
        loop = asyncio.get_running_loop()
        since = loop.time()
        while not (await asyncio.wait(probes, timeout=POLL_S,
                                      return_when=asyncio.FIRST_COMPLETED))[0]:
            if not runtime.alive:   # the thread answered all it ever will before it ended
                break
            if loop.time() - since > STALL_S:
                task.cancel()
                raise AssertionError(f"{what}: the engine thread answered nothing, not even a "
                                     f"probe, for {STALL_S:g} s (it takes no commands)")
        for probe in probes:
            probe.cancel()
        await settle()
    if not task.done():
        task.cancel()
        if not runtime.alive:
            raise AssertionError(f"{what}: no answer, and the engine thread has ended")
        raise AssertionError(f"{what}: no answer, though a command sent after it was answered")
    return task.result()


async def to_the_end(runtime: EngineRuntime, run: AsyncIterator[T], what: str,
                     worker_id: str = "w0") -> list[T]:
    """Every item of ``run`` until it ends (its exception raised); fails at once if the
    engine is idle and the run still waits."""
    return await take(runtime, run, None, what, worker_id)


async def take(runtime: EngineRuntime, run: AsyncIterator[T], n: int | None, what: str,
               worker_id: str = "w0") -> list[T]:
    """The next ``n`` items of ``run`` (all, for ``None``), fewer if it ends; fails at once if
    the engine is idle and the run still waits."""
    loop = asyncio.get_running_loop()
    items: list[T] = []
    while n is None or len(items) < n:
        item = asyncio.ensure_future(anext(run))
        since = loop.time()
        while not (await asyncio.wait({item}, timeout=POLL_S))[0]:
            if await idle(runtime, worker_id):
                await settle()
                if not item.done():
                    item.cancel()
                    raise AssertionError(f"{what}: the engine is idle and the run waits for more "
                                         f"after {len(items)} items")
            elif loop.time() - since > STALL_S:
                item.cancel()
                raise AssertionError(f"{what}: the engine is busy, yet nothing came for "
                                     f"{STALL_S:g} s after {len(items)} items (no step)")
        try:
            items.append(item.result())
        except StopAsyncIteration:
            break
    return items


async def idle(runtime: EngineRuntime, worker_id: str) -> bool:
    """Whether the engine has nothing to step (or is gone): no more items will come."""
    try:
        return await answer(runtime, runtime.call(worker_id, lambda engine: not engine.busy),
                            "is the engine idle")
    except WorkerFailed:  # the engine is gone: nothing more will come
        return True


async def _probe_call(runtime: EngineRuntime) -> None:
    try:
        await runtime.call(NOBODY, lambda engine: None)
    except WorkerFailed:
        pass


async def _probe_run(runtime: EngineRuntime) -> None:
    request = GenerateRequest("probe", Namespace("probe", "probe"), (1,), SamplingParams(1))
    try:
        await anext(runtime.run(NOBODY, request))
    except WorkerFailed:
        pass
