"""The lease keeper: ticks this frontend's lease (``cluster.jobs.lease``) and hands the runner
what changed.

    start ─► tick ─► runner.adopt(taken)       its own unfinished jobs after a restart, jobs
       │             runner.abandon(lost)      nobody owns, a dead frontend's jobs
       └─ every ttl / 3: tick again ...
    close ─► the loop stops, the runner's jobs are stopped by the caller, then ``release``:
             the unfinished jobs become nobody's, taken at another frontend's next tick

The first tick runs in ``start``, before the frontend reports itself ready, so a restarted
frontend resumes its jobs at once when its old lease has expired (or was released). A tick is
a few short SQLite statements on the event loop, as every other job store call is.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from cluster.jobs.lease import FrontendLease, LeaseTick
from cluster.jobs.runner import JobRunner

log = logging.getLogger(__name__)

TICKS_PER_TTL = 3    # a lease survives two late ticks


class LeaseKeeper:
    def __init__(self, lease: FrontendLease, runner: JobRunner,
                 on_tick: Callable[[], None] = lambda: None) -> None:
        """``on_tick``: what else the frontend does at every tick (its address file)."""
        self.lease = lease
        self._runner = runner
        self._on_tick = on_tick
        self._task: asyncio.Task | None = None

    @property
    def every_s(self) -> float:
        return self.lease.ttl_ms / 1000 / TICKS_PER_TTL

    async def tick(self) -> LeaseTick:
        """One tick, applied: the jobs taken launched, the jobs lost stopped here."""
        tick = self.lease.tick(self._runner.running_jobs())
        for job_id in tick.lost:
            log.warning("job %s is no longer this frontend's (%s): stopping it here", job_id,
                        self.lease.frontend_id)
            await self._runner.abandon(job_id)
        if tick.taken:
            log.info("frontend %s takes %d job(s): %s", self.lease.frontend_id,
                     len(tick.taken), ", ".join(job.job_id for job in tick.taken))
            self._runner.adopt(tick.taken)
        self._on_tick()
        return tick

    async def start(self) -> LeaseTick:
        """The first tick now, then one every ``every_s`` in the background."""
        first = await self.tick()
        self._task = asyncio.get_running_loop().create_task(self._forever(),
                                                            name="lease-keeper")
        return first

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.tick()
            except Exception:  # a busy or failing store: the next tick tries again
                log.exception("lease tick of frontend %s failed", self.lease.frontend_id)

    async def stop(self) -> None:
        """Stop ticking (the lease runs out unless ``release`` follows)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def release(self) -> None:
        self.lease.release()
        self.lease.close()
