"""``LinkedLauncher``: worker actors' classes in this process, reached over their streams.

Each worker is an ``EngineWorker`` (``cluster.backend.worker_actor``) on its own engine
runtime, serving its stream on loopback (``listen``) exactly as a Ray actor does on its node;
the frontend reaches it over a ``WorkerLink`` and the workers pull blocks from each other
over the same streams (``cluster.backend.pull``). What Ray adds (placement, processes, the
actor calls) is left out, so one machine runs the whole data path of a multi-host cluster::

    Backend ── WorkerLink ── TCP 127.0.0.1 ──► EngineWorker w0 (LinkServer) ◄─┐ PULL
            ── WorkerLink ── TCP 127.0.0.1 ──► EngineWorker w1 (LinkServer) ──┘

Used by ``orchard bench pull`` and the tests of pulls through the backend. ``pace`` (each
block's bytes, before the holder sends it) stands for a shaped link where none is.
"""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import AsyncIterator, Sequence

from cluster.backend.handle import Items, WorkerHello
from cluster.backend.link import WorkerLink
from cluster.backend.pull import Pace
from cluster.backend.routing import FeedItem, FrontendRouter
from cluster.backend.wire import PullPlan
from cluster.backend.worker_actor import EngineWorker
from router.kv.key import Namespace
from workers.engine.channel import Holdings
from workers.engine.config import EngineConfig
from workers.messages import GenerateRequest, WorkerStats


class LinkedWorker:
    """One in-process ``EngineWorker`` as the backend reaches it (``WorkerHandle``)."""

    def __init__(self, worker: EngineWorker, link: WorkerLink, address: tuple[str, int]
                 ) -> None:
        self._worker = worker
        self._link = link
        self.address = address

    def stream(self, request: GenerateRequest, feed_after: int, chunks: bool,
               pull: PullPlan | None = None) -> Items:
        return self._link.stream(request, feed_after, chunks, pull)

    def events(self, after: int) -> AsyncIterator[FeedItem]:
        return self._worker.events(after, self._link.router_id)

    async def stats(self) -> WorkerStats | None:
        return await self._worker.stats()

    async def invalidate(self, namespace: Namespace, prefix_tokens: Sequence[int] | None
                         ) -> int:
        return await self._worker.invalidate(namespace, prefix_tokens)

    async def holdings(self) -> Holdings:
        return await self._worker.holdings()

    async def ping(self) -> None:
        await self._worker.ping()

    def kill(self) -> None:
        return None   # ``close`` stops it: its stream, then its engine

    async def close(self) -> None:
        await self._link.close()
        await self._worker.close()


class LinkedLauncher:
    """Starts ``EngineWorker``s in this process, each on its loopback stream."""

    owner = ""
    prefix = "linked-"
    replace_dead = False
    watch = False
    pulls = True

    def __init__(self, model_dir: Path | str, engine: EngineConfig,
                 paces: dict[str, Pace] | None = None) -> None:
        self.model_dir = str(model_dir)
        self.engine = engine
        self._paces = paces or {}   # worker id -> the rate its pulls are served at
        self._secret = secrets.token_bytes(32)
        self._router_id = secrets.token_hex(6)   # names this backend's router to its workers

    async def start(self, routes: FrontendRouter) -> None:
        return None

    async def check_room(self, missing: int, in_use: int) -> None:
        return None

    async def launch(self, worker_id: str) -> tuple[LinkedWorker, WorkerHello]:
        worker = EngineWorker(worker_id, self.model_dir, self.engine,
                              pace=self._paces.get(worker_id))
        hello = await worker.start()
        host, port = await worker.listen(self._secret)
        link = await WorkerLink.connect(worker_id, host, port, self._secret, self._router_id)
        return LinkedWorker(worker, link, (host, port)), hello

    async def close(self, handles: Sequence[LinkedWorker]) -> None:
        for handle in handles:
            await handle.close()
