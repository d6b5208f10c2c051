"""An intake's steps in worker threads (``cluster.api.intake_threads``); the commit's order
against a cancel is tested through ``accept_requests`` and ``accept_file`` in
``test_intake.py``."""
from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.api.intake_threads import in_thread
from tests.support.bounded import run_bounded


class TestInThread:
    def test_a_cancelled_step_ends_only_after_its_thread(self):
        """An intake's connection is one thread's at a time: a file cancelled mid-chunk aborts
        only once the chunk's thread has returned (``accept_file`` runs each step this way)."""
        entered, release = threading.Event(), threading.Event()
        returned: list[str] = []

        def step(name: str) -> int:
            entered.set()
            assert release.wait(60), "never released"
            returned.append(name)
            return 1

        async def scenario():
            task = asyncio.create_task(in_thread(step, "chunk"))
            await asyncio.to_thread(entered.wait, 60)
            task.cancel()
            await asyncio.sleep(0)       # the task has taken its cancel by now ...
            assert not task.done()       # ... and still waits for the thread
            seen: list[list[str]] = []
            task.add_done_callback(lambda _: seen.append(list(returned)))
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            return seen

        assert run_bounded(scenario(), 60, "a cancelled intake step") == [["chunk"]]
