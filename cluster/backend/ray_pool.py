"""The Ray side of the worker pool: worker actors on node slots, each reached by its handle.

    RayLauncher.launch(w) ─► WorkerActor on a node slot ─► start() loads the model
                          ─► listen(secret): the frontend's request stream to it
                             (``cluster.backend.link``), opened with the pool's secret
    RayWorker (w's handle) ─ stream ─────────────────► over the link, not a Ray call
                           ─ stats, invalidate, holdings, ping, events (the block event
                             feed the frontend's router follows) ─► Ray calls to the actor
                           ─ kill (a dead worker) / close (a drained one, telemetry flushed)

The pool's lives (scale, drain, death, replacement, checks) are ``cluster.backend.pool``'s;
this module says how a Ray worker starts, answers and stops. Ray is started (embedded,
loopback only) or joined in ``start`` through ``cluster.backend.bootstrap``; ``close`` stops
what it started. All Ray calls are awaited (never ``ray.get``) so nothing here blocks the
event loop.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from typing import AsyncIterator, Sequence

import ray

from cluster.backend import bootstrap
from cluster.backend.bootstrap import NODE_RESOURCE, Placement
from cluster.backend.handle import Items, WorkerHello
from cluster.backend.link import WorkerLink
from cluster.backend.routing import FeedItem, FrontendRouter
from cluster.backend.wire import PullPlan
from cluster.backend.worker_actor import WorkerActor
from cluster.telemetry.setup import TelemetrySettings
from router.kv.key import Namespace
from workers.engine.channel import Holdings
from workers.engine.config import EngineConfig
from workers.messages import GenerateRequest, WorkerFailed, WorkerStats

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0   # placing a worker and loading its model
STATS_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0


class NoRoom(ValueError):
    """No node has a free ``orchard_node`` slot (or CPUs) for another worker."""


class RayWorker:
    """A worker actor as the frontend reaches it (``cluster.backend.handle.WorkerHandle``)."""

    def __init__(self, worker_id: str, actor: ray.actor.ActorHandle, link: WorkerLink,
                 address: tuple[str, int], owned: bool = True) -> None:
        """``owned``: this frontend started the actor, and stops it; else (a frontend attached
        to another's workers, ``cluster.backend.ray_attach``) only its own stream is closed."""
        self._id = worker_id
        self._actor = actor
        self._link = link
        self.address = address   # its stream, where its peers pull its blocks from
        self._owned = owned
        self._killed = not owned

    def stream(self, request: GenerateRequest, feed_after: int, chunks: bool,
               pull: PullPlan | None = None) -> Items:
        return self._link.stream(request, feed_after, chunks, pull)

    async def stats(self) -> WorkerStats | None:
        try:
            return await asyncio.wait_for(self._actor.stats.remote(), STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            log.info("worker %s: no stats (%s)", self._id, exc)
            return None

    async def invalidate(self, namespace: Namespace, prefix_tokens: Sequence[int] | None
                         ) -> int:
        prefix = None if prefix_tokens is None else list(prefix_tokens)
        return await self._actor.invalidate.remote(namespace, prefix)

    async def holdings(self) -> Holdings:
        try:
            return await self._actor.holdings.remote()
        except ray.exceptions.RayError as exc:
            raise WorkerFailed(f"worker {self._id}: no holdings ({exc})") from None

    async def ping(self) -> None:
        try:
            await self._actor.ping.remote()
        except ray.exceptions.RayActorError as exc:
            raise WorkerFailed(f"worker {self._id}: {exc}") from None

    async def events(self, after: int) -> AsyncIterator[FeedItem]:
        """The actor's block event feed (``EngineWorker.events``), until the actor is gone."""
        try:
            async for ref in self._actor.events.options(num_returns="streaming").remote(
                    after, self._link.router_id):
                yield await ref
        except ray.exceptions.RayError as exc:  # the pool's pings notice a dead worker
            log.info("worker %s: event feed ended (%s)", self._id, exc)

    def own(self) -> None:
        """This frontend takes the actor over (its owner died): it stops it from now on."""
        self._owned, self._killed = True, False

    def kill(self) -> None:
        if self._owned:
            self._killed = True
            ray.kill(self._actor, no_restart=True)

    async def close(self) -> None:
        await self._link.close()
        if not self._killed:
            try:
                await asyncio.wait_for(self._actor.close.remote(), CLOSE_TIMEOUT_S)
            except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
                log.info("worker %s did not close cleanly: %s", self._id, exc)
            self.kill()


def refuse_without_room(offered: dict[str, float], placement: Placement, missing: int,
                        in_use: int) -> None:
    """Raise ``NoRoom``, with the fix, when the resources a cluster ``offered`` hold no slots
    for ``missing`` more workers beside ``in_use``, at ``placement``'s share of a node each."""
    each = placement.actor_options()["resources"][NODE_RESOURCE]
    total = offered.get(NODE_RESOURCE, 0.0)
    if (in_use + missing) * each > total + 1e-6:
        raise NoRoom(
            f"workers: no room for {missing} more worker(s): the cluster offers "
            f"{total:g} {NODE_RESOURCE!r} slot(s), {in_use * each:g} in use, each worker "
            f"takes {each:g}; add nodes (infra/README.md) or raise workers per node")


class RayLauncher:
    """Starts worker actors on node slots; each opens its stream to this frontend.

    Each actor is named ``names`` + its worker id in Ray's ``orchard`` namespace, so that other
    frontends can find and attach to it (``cluster.backend.ray_attach``). On a cluster it
    joined (``address``) the actors are detached: they outlive this frontend's process, so a
    frontend attached to them goes on serving, and takes them over, when this one is killed;
    this frontend still stops them when it stops (``close``). ``names`` and ``secret``: those
    of workers started before (a frontend taking them over), else new ones."""

    prefix = "w"
    owner = ""     # its workers are this frontend's own
    watch = True   # pings notice dead idle workers; gaps in event batches are rebuilt
    pulls = True   # each worker's stream serves its blocks to its peers

    def __init__(self, model_dir: str, engine: EngineConfig, placement: Placement,
                 address: str | None, start_timeout_s: float = START_TIMEOUT_S,
                 replace_dead: bool = True, telemetry: TelemetrySettings | None = None,
                 initial: int = 1, names: str = "", secret: bytes = b"",
                 router_id: str = "") -> None:
        self.model_dir = model_dir
        self.engine = engine
        self.replace_dead = replace_dead
        self._placement = placement
        self._address = address
        self._start_timeout_s = start_timeout_s
        self._telemetry = telemetry   # each worker sets up its process's telemetry from it
        self._initial = initial       # workers the embedded cluster is sized for
        self._secret = secret or secrets.token_bytes(32)   # authenticates the streams
        self.names = names or f"orchard-{secrets.token_hex(4)}-"   # an actor's: this + its id
        self.placement = placement
        self.detached = address is not None   # the actors outlive this process
        self._router_id = router_id or secrets.token_hex(6)   # this frontend's router
        self._started_ray = False

    async def start(self, routes: FrontendRouter) -> None:
        if ray.is_initialized():
            return
        # ray.init blocks for seconds: off the event loop, which may be serving already
        if self._address:
            await asyncio.to_thread(bootstrap.join, self._address)
        else:
            await asyncio.to_thread(bootstrap.start_local,
                                    bootstrap.local_cpus(self._initial, self._placement))
        self._started_ray = True

    async def check_room(self, missing: int, in_use: int) -> None:
        """Fail fast, with the fix, when the cluster has no slots for ``missing`` workers."""
        offered = await asyncio.to_thread(ray.cluster_resources)
        refuse_without_room(offered, self._placement, missing, in_use)

    async def launch(self, worker_id: str) -> tuple[RayWorker, WorkerHello]:
        lifetime = {"lifetime": "detached"} if self.detached else {}
        actor = WorkerActor.options(**self._placement.actor_options(),
                                    name=self.names + worker_id, **lifetime).remote(
            worker_id, self.model_dir, self.engine, telemetry=self._telemetry)
        try:
            hello = await asyncio.wait_for(actor.start.remote(), self._start_timeout_s)
            host, port = await actor.listen.remote(self._secret)
            link = await WorkerLink.connect(worker_id, host, port, self._secret,
                                            self._router_id)
        except (asyncio.TimeoutError, ray.exceptions.RayError, OSError) as exc:
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
        return RayWorker(worker_id, actor, link, (host, port)), hello

    def secret(self) -> bytes:
        """The workers' stream secret, for the frontends that attach to them (their peers'
        pulls use it too)."""
        return self._secret

    async def close(self, handles: Sequence[RayWorker]) -> None:
        await asyncio.gather(*(h.close() for h in handles))
        if self._started_ray:
            bootstrap.shutdown()
            self._started_ray = False
