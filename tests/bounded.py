"""Wall-clock bounds for tests that wait on threads or tasks: a stuck wait fails, saying so.

``run_bounded(scenario(), 60, "what it does")`` is ``asyncio.run`` with a deadline. Past it the
scenario is cancelled and the test fails with an ``AssertionError`` naming the scenario, instead
of hanging: an engine thread that never answers, a slot never given back. The loop is closed
without waiting for the default executor (``asyncio.run`` would join a thread that may be the
stuck one).
"""
from __future__ import annotations

import asyncio
from typing import Coroutine, TypeVar

T = TypeVar("T")


def run_bounded(scenario: Coroutine[object, object, T], timeout_s: float, what: str) -> T:
    async def bounded() -> T:
        try:
            return await asyncio.wait_for(scenario, timeout_s)
        except TimeoutError:
            raise AssertionError(f"{what}: not finished after {timeout_s:g} s of wall-clock time "
                                 "(a wait that never ended)") from None

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(bounded())
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:  # cancelled tasks get a bounded moment to unwind
            loop.run_until_complete(asyncio.wait(left, timeout=5))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
