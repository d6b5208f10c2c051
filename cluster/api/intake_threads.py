"""An intake's steps in worker threads, and its commit ordered against the caller's cancel.

The store's intake (``cluster.jobs.store_intake.JobIntake``) is used from one thread at a time;
``cluster.api.intake`` runs each of its steps here, off the event loop:

    in_thread(step, ...)           a piece stored; a cancel waits for it, then propagates
    commit_in_thread(gate, commit) the commit; a cancel before it began stops it (the intake
                                   is aborted), one after it gets ``CancelledAfterCommit``
                                   with the job, which exists and must be launched
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from cluster.jobs.store import JobRecord


class CancelledAfterCommit(asyncio.CancelledError):
    """The caller was cancelled after its job's commit had begun: the job exists (a commit
    cannot be taken back), so the cancellation carries it, for the service to launch."""

    def __init__(self, job: JobRecord, created: bool):
        super().__init__(f"cancelled after {job.job_id} was committed")
        self.job, self.created = job, created


class CommitGate:
    """Orders a caller's cancellation against its intake's commit, which runs in a worker
    thread: whichever comes first wins. A cancel first: the thread does not commit, and the
    intake is aborted. The commit first: the cancel comes too late to stop it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = self._committing = False

    def begin_commit(self) -> None:
        """Called in the thread just before the commit; raises if the caller was cancelled."""
        with self._lock:
            if self._cancelled:
                raise asyncio.CancelledError
            self._committing = True

    def cancel(self) -> bool:
        """The caller was cancelled; whether that came before the commit began."""
        with self._lock:
            self._cancelled = not self._committing
            return self._cancelled


async def commit_in_thread(gate: CommitGate, commit: Callable[[], tuple[JobRecord, bool]]
                            ) -> tuple[JobRecord, bool]:
    """``commit()`` in a worker thread (it calls ``gate.begin_commit()`` first). Cancelled
    before the commit began: ``CancelledError``, and the thread stops short of it. Cancelled
    after: waits for the commit, then ``CancelledAfterCommit`` with its job (or the plain
    ``CancelledError`` if the commit failed)."""
    work = asyncio.ensure_future(asyncio.to_thread(commit))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        if gate.cancel():  # the thread stops short of the commit; its outcome is not ours
            work.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise
        await settled(work)
        if work.exception() is not None:
            raise
        raise CancelledAfterCommit(*work.result()) from None


async def settled(work: asyncio.Future) -> None:
    """Wait for a worker thread's ``work`` to finish, through further cancels and its own
    error (the caller looks at the outcome)."""
    while not work.done():
        try:
            await asyncio.shield(work)
        except BaseException:
            pass


async def in_thread(step: Callable[..., int], *args) -> int:
    """An intake step in a worker thread; a cancel waits for the step to finish, then
    propagates (the intake's connection is used by one thread at a time, so its abort must
    not overtake a piece still being stored)."""
    work = asyncio.ensure_future(asyncio.to_thread(step, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await settled(work)
        raise
