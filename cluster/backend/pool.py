"""The worker pool: workers' lives, from start to drain or death, whatever runs them.

    scale(n) ─► launcher.launch: a worker started, its stream open ─► routes.add (the
                frontend's router, following the worker's feed), rebuilt from its holdings
                (a restart's disk blocks, with their tier) ─► ready
    drain(w) ─► routes.drain_worker (no new requests) ─► last request done ─► retire:
                routes.remove_worker (its blocks forgotten) ─► the worker closed
    died(w)  ─► routes.remove_worker at once ─► the worker killed ─► a replacement is started
                in the background when the launcher replaces the dead and a slot is free
    check()  ─► workers pinged; the view of any worker whose event batches had a gap rebuilt
                from its holdings
    follow() ─► (a launcher over another frontend's workers, ``owner`` set) the workers it
                finds now: new ones attached and added to the router, those gone forgotten;
                at start and at every check. Such a pool never scales, drains or replaces.

The pool owns the worker table (``PoolWorker``: state, requests in flight, the handle) and the
frontend's routing state (``routes``, ``cluster.backend.routing``); the ``Launcher`` says how
a worker of its kind starts and stops (``cluster.backend.local``: an engine on the process's
engine thread; ``cluster.backend.ray_pool``: a worker actor and its stream). The backend
(``cluster.backend.backend``) routes with ``routes``, asks the pool for workers and reports
deaths. Everything here runs on the frontend's event loop; nothing blocks it.
"""
from __future__ import annotations

import asyncio
import collections
import logging

from cluster.backend.handle import Launcher, PoolWorker, WorkerHello
from cluster.backend.protocol import NotOwned, UnknownWorker
from cluster.backend.routing import FrontendRouter
from workers.messages import WorkerFailed

log = logging.getLogger(__name__)

CHECK_EVERY_S = 2.0       # idle workers pinged, stale router views rebuilt
PING_TIMEOUT_S = 10.0
GONE_KEPT = 16            # dead workers still listed, for operators


class WorkerPool:
    def __init__(self, launcher: Launcher, routes: FrontendRouter) -> None:
        self._launcher = launcher
        self.routes = routes
        self._workers: dict[str, PoolWorker] = {}
        self._gone: collections.deque[PoolWorker] = collections.deque(maxlen=GONE_KEPT)
        self._next_id = 0
        self._tasks: set[asyncio.Task] = set()
        self.first_hello: WorkerHello | None = None
        self.replaced = 0

    # ---------------------------------------------------------------- queries

    def get(self, worker_id: str) -> PoolWorker | None:
        return self._workers.get(worker_id)

    def known(self) -> list[PoolWorker]:
        return [*self._workers.values(), *self._gone]

    def live(self) -> list[PoolWorker]:
        return [w for w in self._workers.values() if w.state in ("ready", "draining")]

    def ready(self) -> list[PoolWorker]:
        return [w for w in self._workers.values() if w.state == "ready"]

    # ---------------------------------------------------------------- changes

    async def start(self) -> None:
        await self._launcher.start(self.routes)

    async def scale(self, n: int) -> None:
        """Start or drain workers until ``n`` are ready (or starting)."""
        self._refuse_if_followed("scale")
        if n < 1:
            raise ValueError(f"workers: must be >= 1, got {n}")
        serving = [w for w in self._workers.values() if w.state in ("ready", "starting")]
        for worker in reversed(serving[n:]):
            await self.drain(worker.worker_id)
        missing = n - len(serving)
        if missing > 0:
            await self._launcher.check_room(missing, self._in_use())
            await asyncio.gather(*(self._start_one() for _ in range(missing)))

    async def drain(self, worker_id: str) -> PoolWorker:
        self._refuse_if_followed("drain")
        worker = self._workers.get(worker_id)
        if worker is None:
            known = ", ".join(self._workers) or "none"
            raise UnknownWorker(f"worker_id: no worker {worker_id!r}; known: {known}")
        if worker.state == "ready":
            worker.state = "draining"
            self.routes.drain_worker(worker_id)
        elif worker.state == "starting":
            worker.state = "draining"  # the router has not heard of it yet
        self.retire_if_drained(worker)
        return worker

    def retire_if_drained(self, worker: PoolWorker) -> None:
        """A draining worker with nothing in flight leaves: the router forgets its blocks."""
        if worker.state == "draining" and worker.running == 0 \
                and self._workers.get(worker.worker_id) is worker:
            del self._workers[worker.worker_id]
            self._forget(worker)
            self._spawn(self._stop(worker))

    def died(self, worker: PoolWorker, why: BaseException) -> None:
        """``worker`` failed under a request: forget it now, replace it in the background."""
        if self._workers.get(worker.worker_id) is not worker:
            return
        log.warning("worker %s died (%s): removing it, its requests go elsewhere",
                    worker.worker_id, why)
        was_serving = worker.state == "ready"
        worker.state = "dead"
        del self._workers[worker.worker_id]
        self._gone.append(worker)
        self._forget(worker)
        if worker.handle is not None:
            worker.handle.kill()
            self._spawn(worker.handle.close())
        if self._launcher.replace_dead and was_serving:
            self._spawn(self._replace(worker.worker_id))

    async def follow(self) -> None:
        """Attach to the owner's workers the launcher finds that this pool does not serve
        from yet (one that cannot be attached now, still starting, is tried at the next
        check), and forget those it no longer finds (the owner drained or lost them)."""
        found = await self._launcher.discover()
        for worker_id in found:   # workers started here later (after a takeover) count on
            number = worker_id.removeprefix(self._launcher.prefix)
            if number.isdigit():
                self._next_id = max(self._next_id, int(number) + 1)
        for worker in [w for w in self._workers.values() if w.worker_id not in found]:
            self.died(worker, WorkerFailed(f"worker {worker.worker_id}: no longer among "
                                           f"the workers of {self._launcher.owner}"))
        new = sorted(found - set(self._workers))
        started = await asyncio.gather(*(self._start_one(i) for i in new),
                                       return_exceptions=True)
        for worker_id, outcome in zip(new, started):
            if isinstance(outcome, RuntimeError):
                log.info("worker %s not attached yet: %s", worker_id, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                log.info("attached to worker %s of %s", worker_id, self._launcher.owner)

    def start_checks(self) -> None:
        """Watch the pool in the background (see ``check``) until ``close``."""
        self._spawn(self._check_forever())

    async def check(self) -> None:
        """Ping the workers (a dead idle one is noticed before a request lands on it; a busy
        one whose node died, though its stream never closed, fails its requests over) and
        rebuild the router's view of any worker whose event batches had a gap. A busy worker
        slow to answer is not dead: only idle ones are judged by the timeout. A pool over
        another frontend's workers first ``follow``s them."""
        if self._launcher.owner:
            await self.follow()
        live = self.live()
        pings = await asyncio.gather(
            *(asyncio.wait_for(w.handle.ping(), PING_TIMEOUT_S) for w in live),
            return_exceptions=True)
        for worker, answer in zip(live, pings):
            if isinstance(answer, WorkerFailed) or (
                    isinstance(answer, asyncio.TimeoutError) and worker.running == 0):
                self.died(worker, answer)
        for worker_id in self.routes.stale_workers():
            worker = self._workers.get(worker_id)
            if worker is not None and worker.state in ("ready", "draining"):
                holdings = await worker.handle.holdings()
                self.routes.rebuild(worker_id, holdings)
                log.info("view of %s rebuilt (%d blocks in memory, %d on disk)", worker_id,
                         len(holdings.blocks), len(holdings.disk_blocks))

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            try:
                await self.check()
            except WorkerFailed as exc:   # a worker that cannot say what it holds: the next
                log.warning("pool check failed: %s", exc)   # ping notices it

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Closed, not just killed: each worker flushes the spans it has not exported yet.
        handles = [w.handle for w in self._workers.values() if w.handle is not None]
        await self._launcher.close(handles)
        self._workers.clear()
        await self.routes.close()

    # --------------------------------------------------------------- internals

    def _refuse_if_followed(self, what: str) -> None:
        if self._launcher.owner:
            raise NotOwned(f"workers: this frontend attaches to the workers of "
                           f"{self._launcher.owner}; {what} them through that frontend")

    async def _start_one(self, worker_id: str | None = None) -> PoolWorker:
        """Start a worker (attach to ``worker_id``, the owner's, when following)."""
        if worker_id is None:
            worker_id = f"{self._launcher.prefix}{self._next_id}"
            self._next_id += 1
        worker = self._workers[worker_id] = PoolWorker(worker_id)
        try:
            worker.handle, worker.hello = await self._launcher.launch(worker_id)
        except BaseException:
            if self._workers.get(worker_id) is worker:
                del self._workers[worker_id]
            raise
        self.first_hello = self.first_hello or worker.hello
        if worker.state == "starting":
            # ready the moment the router knows it: a request routed there meanwhile is served
            self.routes.add_worker(worker_id, worker.handle.events)
            worker.in_router = True
            worker.state = "ready"
            # a store that opened on a disk directory holding blocks (a restart) has them
            # already: the router learns them, with their tier, before ``scale`` returns
            self.routes.rebuild(worker_id, await worker.handle.holdings())
        else:  # drained while it was starting (and retired then): it leaves without serving
            self._workers.pop(worker_id, None)
            self._spawn(self._stop(worker))
        return worker

    def _in_use(self) -> int:
        return len([w for w in self._workers.values() if w.state != "dead"])

    async def _replace(self, dead_id: str) -> None:
        try:
            await self._launcher.check_room(1, self._in_use())
            worker = await self._start_one()
        except (ValueError, RuntimeError) as exc:   # no room (NoRoom), or a failed start
            log.warning("worker %s not replaced: %s", dead_id, exc)
            return
        self.replaced += 1
        log.info("worker %s replaces dead worker %s", worker.worker_id, dead_id)

    def _forget(self, worker: PoolWorker) -> None:
        """The router drops the worker and every block it held."""
        if worker.in_router:
            worker.in_router = False
            self.routes.remove_worker(worker.worker_id)

    async def _stop(self, worker: PoolWorker) -> None:
        if worker.handle is not None:   # else: still starting; ``_start_one`` stops it
            await worker.handle.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
