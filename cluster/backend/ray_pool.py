"""The worker pool behind ``RayBackend``: worker actors' lives, from start to drain or death.

    scale(n) ─► start:  WorkerActor on a node slot ─► start() loads the model ─► listen(secret):
                the frontend's request stream to it (``cluster.backend.link``) ─► routes.add
                (the frontend's router, fed by the worker) and the router actor's add;
                both rebuilt from its holdings (a restart's disk blocks, with their tier)
    drain(w) ─► drain_worker in both (no new requests) ─► last request done ─► retire:
                remove_worker in both (its blocks forgotten) ─► actor stopped
    died(w)  ─► remove_worker at once ─► actor killed ─► a replacement is started
                in the background when a slot is free (else the worker is just removed)
    check()  ─► workers pinged; stale views rebuilt from the workers' holdings; a lost
                router actor replaced and rebuilt the same way

The pool owns the worker table, each worker's request stream (``PoolWorker.link``, opened with
the pool's secret, made here and handed to the worker through Ray) and the router actor
(kept for other frontends and recovery: the workers feed it directly); ``RayBackend`` routes
with ``routes`` (``cluster.backend.routing``), asks the pool for workers and reports deaths.
All Ray calls are awaited (never ``ray.get``) so nothing here blocks the event loop.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from dataclasses import dataclass

import ray

from cluster.backend import bootstrap
from cluster.backend.bootstrap import NODE_RESOURCE, Placement
from cluster.backend.link import WorkerLink
from cluster.backend.protocol import UnknownWorker
from cluster.backend.router_actor import TracedRouterActor
from cluster.backend.routing import FrontendRouter
from cluster.telemetry.setup import TelemetrySettings
from cluster.backend.worker_actor import WorkerActor, WorkerHello
from workers.engine.engine import EngineConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0   # placing a worker and loading its model
CHECK_EVERY_S = 2.0       # idle workers pinged, stale router views rebuilt
PING_TIMEOUT_S = 10.0
GONE_KEPT = 16            # dead workers still listed, for operators


@dataclass(slots=True)
class PoolWorker:
    worker_id: str
    actor: ray.actor.ActorHandle
    hello: WorkerHello | None = None
    state: str = "starting"      # "starting" | "ready" | "draining" | "dead"
    running: int = 0             # requests in flight (event-loop side)
    in_router: bool = False      # added to the router (once ready)
    link: WorkerLink | None = None   # the request stream to it (once started)


class NoRoom(ValueError):
    """No node has a free ``orchard_node`` slot (or CPUs) for another worker."""


class WorkerPool:
    def __init__(self, model_dir: str, engine: EngineConfig, placement: Placement,
                 routes: FrontendRouter, start_timeout_s: float = START_TIMEOUT_S,
                 replace_dead: bool = True, telemetry: TelemetrySettings | None = None) -> None:
        self._model_dir = model_dir
        self._engine = engine
        self._placement = placement
        self.routes = routes
        self._router = None          # the router actor (``start_router``)
        self._start_timeout_s = start_timeout_s
        self._replace_dead = replace_dead
        self._telemetry = telemetry  # each worker sets up its process's telemetry from it
        self._workers: dict[str, PoolWorker] = {}
        self._gone: collections.deque[PoolWorker] = collections.deque(maxlen=GONE_KEPT)
        self._next_id = 0
        self._tasks: set[asyncio.Task] = set()
        self._secret = secrets.token_bytes(32)   # authenticates this frontend's streams
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

    async def scale(self, n: int) -> None:
        """Start or drain workers until ``n`` are ready (or starting)."""
        if n < 1:
            raise ValueError(f"workers: must be >= 1, got {n}")
        serving = [w for w in self._workers.values() if w.state in ("ready", "starting")]
        for worker in reversed(serving[n:]):
            await self.drain(worker.worker_id)
        missing = n - len(serving)
        if missing > 0:
            await self._check_room(missing)
            await asyncio.gather(*(self._start_one() for _ in range(missing)))

    async def drain(self, worker_id: str) -> PoolWorker:
        worker = self._workers.get(worker_id)
        if worker is None:
            known = ", ".join(self._workers) or "none"
            raise UnknownWorker(f"worker_id: no worker {worker_id!r}; known: {known}")
        if worker.state == "ready":
            worker.state = "draining"
            self.routes.drain_worker(worker_id)
            await self._router.drain_worker.remote(worker_id)
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

    @property
    def router_actor(self):
        return self._router

    async def start_router(self) -> None:
        """Start the router actor on this node."""
        self._router = await self._new_router()

    async def _new_router(self):
        router = TracedRouterActor.options(**bootstrap.on_this_node()).remote(
            self._engine.block_size, self._telemetry, index_bytes=self.routes.index_bytes)
        await router.ping.remote()
        return router

    async def _check_router(self) -> None:
        """A lost router actor is replaced, and rebuilt from the workers."""
        try:
            await asyncio.wait_for(self._router.ping.remote(), PING_TIMEOUT_S)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError) as exc:
            log.warning("router actor lost (%s): starting a new one, rebuilding from the "
                        "workers", exc)
            await self.attach_router(await self._new_router())

    async def attach_router(self, router) -> None:
        """Hand every live worker to a new router actor (the old one is gone), then use it.

        Each worker first points its block events at the new router, then is added to it
        (drained again if it was draining) and its index rebuilt from the worker's holdings,
        so the new router knows what the old one knew without a restart of any worker.
        """
        for worker in self.live():
            try:
                await worker.actor.set_router.remote(router)
                await router.add_worker.remote(worker.worker_id)
                if worker.state == "draining":
                    await router.drain_worker.remote(worker.worker_id)
                holdings = await worker.actor.holdings.remote()
                await router.rebuild.remote(worker.worker_id, holdings.blocks,
                                            holdings.disk_blocks)
                worker.in_router = True
                log.info("worker %s handed to the new router (%d blocks in memory, %d on disk)",
                         worker.worker_id, len(holdings.blocks), len(holdings.disk_blocks))
            except ray.exceptions.RayActorError as exc:
                self.died(worker, exc)
        self._router = router

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
        ray.kill(worker.actor, no_restart=True)
        if worker.link is not None:
            self._spawn(worker.link.close())
        if self._replace_dead and was_serving:
            self._spawn(self._replace(worker.worker_id))

    def start_checks(self) -> None:
        """Watch the pool in the background (see ``check``) until ``close``."""
        self._spawn(self._check_forever())

    async def check(self) -> None:
        """Ping the workers (a dead idle one is noticed before a request lands on it; a busy
        one whose node Ray declared dead, though its stream never closed, fails its requests
        over), rebuild the routers' view of any worker whose event batches had a gap, replace
        a lost router actor. A busy worker slow to answer is not dead: only idle ones are
        judged by the timeout."""
        live = self.live()
        pings = await asyncio.gather(
            *(asyncio.wait_for(w.actor.ping.remote(), PING_TIMEOUT_S) for w in live),
            return_exceptions=True)
        for worker, answer in zip(live, pings):
            if isinstance(answer, ray.exceptions.RayActorError) or (
                    isinstance(answer, asyncio.TimeoutError) and worker.running == 0):
                self.died(worker, answer)
        for worker_id in self.routes.stale_workers():
            worker = self._workers.get(worker_id)
            if worker is not None and worker.state in ("ready", "draining"):
                holdings = await worker.actor.holdings.remote()
                self.routes.rebuild(worker_id, holdings)
                log.info("view of %s rebuilt (%d blocks in memory, %d on disk)", worker_id,
                         len(holdings.blocks), len(holdings.disk_blocks))
        await self._check_router()
        for worker_id in await self._router.stale_workers.remote():
            worker = self._workers.get(worker_id)
            if worker is not None and worker.state in ("ready", "draining"):
                holdings = await worker.actor.holdings.remote()
                await self._router.rebuild.remote(worker_id, holdings.blocks,
                                                  holdings.disk_blocks)

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            try:
                await self.check()
            except ray.exceptions.RayError as exc:
                log.warning("pool check failed: %s", exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Closed, not just killed: each worker flushes the spans it has not exported yet.
        await asyncio.gather(*(self._stop(w) for w in list(self._workers.values())))
        self._workers.clear()
        await self.routes.close()

    # --------------------------------------------------------------- internals

    async def _start_one(self) -> PoolWorker:
        worker_id = f"w{self._next_id}"
        self._next_id += 1
        actor = WorkerActor.options(**self._placement.actor_options(), name=None).remote(
            worker_id, self._model_dir, self._engine, self._router, telemetry=self._telemetry)
        worker = self._workers[worker_id] = PoolWorker(worker_id, actor)
        try:
            hello = await asyncio.wait_for(actor.start.remote(), self._start_timeout_s)
            host, port = await actor.listen.remote(self._secret)
            worker.link = await WorkerLink.connect(worker_id, host, port, self._secret)
        except (asyncio.TimeoutError, ray.exceptions.RayError, OSError) as exc:
            self._workers.pop(worker_id, None)
            ray.kill(actor, no_restart=True)
            if isinstance(exc, asyncio.TimeoutError):
                raise NoRoom(f"worker {worker_id} did not start within "
                             f"{self._start_timeout_s:.0f} s: no node with a free "
                             f"{NODE_RESOURCE!r} slot and {self._placement.cpus_per_worker} "
                             "CPUs? add a node or raise workers per node") from None
            raise RuntimeError(f"worker {worker_id} failed to start: {exc}") from exc
        if not hello.openblas:
            log.warning("worker %s runs MLX without OpenBLAS (slow): install "
                        "libopenblas0-pthread on node %s", worker_id, hello.node_id)
        worker.hello = hello
        self.first_hello = self.first_hello or hello
        if worker.state == "starting":
            await self._router.add_worker.remote(worker_id)
            self.routes.add_worker(worker_id, actor)
            # a store that opened on a disk directory holding blocks (a restart) has them
            # already: both routers learn them, with their tier, before the first request
            holdings = await actor.holdings.remote()
            self.routes.rebuild(worker_id, holdings)
            await self._router.rebuild.remote(worker_id, holdings.blocks, holdings.disk_blocks)
            worker.in_router = True
            worker.state = "ready"
        else:  # drained while it was starting: it leaves without serving
            self.retire_if_drained(worker)
        return worker

    async def _check_room(self, missing: int) -> None:
        """Fail fast, with the fix, when the cluster has no slots for ``missing`` workers."""
        need = missing * self._placement.actor_options()["resources"][NODE_RESOURCE]
        total = (await asyncio.to_thread(ray.cluster_resources)).get(NODE_RESOURCE, 0.0)
        used = len([w for w in self._workers.values() if w.state != "dead"]) * (
            self._placement.actor_options()["resources"][NODE_RESOURCE])
        if used + need > total + 1e-6:
            raise NoRoom(
                f"workers: no room for {missing} more worker(s): the cluster offers "
                f"{total:g} {NODE_RESOURCE!r} slot(s), {used:g} in use, each worker takes "
                f"{need / missing:g}; add nodes (infra/README.md) or raise workers per node")

    async def _replace(self, dead_id: str) -> None:
        try:
            await self._check_room(1)
            worker = await self._start_one()
        except (NoRoom, RuntimeError) as exc:
            log.warning("worker %s not replaced: %s", dead_id, exc)
            return
        self.replaced += 1
        log.info("worker %s replaces dead worker %s", worker.worker_id, dead_id)

    def _forget(self, worker: PoolWorker) -> None:
        """The router drops the worker and every block it held (fire and forget: calls from
        this process reach the router actor in order, before any later routing call)."""
        if worker.in_router:
            worker.in_router = False
            self.routes.remove_worker(worker.worker_id)
            self._router.remove_worker.remote(worker.worker_id)

    async def _stop(self, worker: PoolWorker) -> None:
        if worker.link is not None:
            await worker.link.close()
        try:
            await asyncio.wait_for(worker.actor.close.remote(), 10.0)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            log.info("worker %s did not close cleanly: %s", worker.worker_id, exc)
        ray.kill(worker.actor, no_restart=True)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
