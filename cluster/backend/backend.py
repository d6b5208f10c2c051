"""``Backend``: the one implementation of ``cluster.backend.protocol.Backend``, over worker handles.

Whatever runs the workers (in-process engines, ``cluster.backend.local``; Ray worker actors,
``cluster.backend.ray_backend``), a request takes the same steps, written here once::

    generate / stream(request, block_hashes)
      ├─ routes.router.route + started       (in this process: ``cluster.backend.routing``;
      │                                       round robin for the ``orchard bench`` baseline)
      ├─ the chosen worker's handle.stream   (``cluster.backend.handle``)
      │      ─► Prefilled or TokenChunks ─► router.prefilled
      │      ─► WorkerDone(result, block events) ─► routes.apply
      └─ router.finished ─► GenerateOutcome(result, decision, attempts, ...)

A worker that dies under the request (``WorkerFailed``) is removed from the pool and the router
at once (its blocks forgotten) and the request routed again (``cluster.backend.retry``:
``generate`` can always retry, ``stream`` only until its first chunk has gone out). A request
given up before its result (a cancelled stream, a deadline, a cancelled job) is aborted on its
worker: closing the handle's stream does it. Scaling and draining act on the pool
(``cluster.backend.pool``), which keeps the workers' lives; the admin calls ask each live
worker's handle and turn its stats into a ``WorkerInfo`` here (``worker_info``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from typing import AsyncIterator, Callable, Sequence

from cluster.backend.handle import Launcher, PoolWorker
from cluster.backend.pool import WorkerPool
from cluster.backend.protocol import (CacheStats, GenerateOutcome, ModelInfo, NoWorkerAvailable,
                                      TokenChunk, WorkerInfo)
from cluster.backend.retry import retried
from cluster.backend.routing import FrontendRouter
from cluster.backend.wire import Prefilled, PullPlan, WorkerDone
from router.index import DEFAULT_INDEX_BYTES
from router.kv.key import BlockHash, Namespace
from router.policy import RoutingDecision
from router.pull_cost import PeerLinks
from router.router import WorkerStatus
from workers.messages import GenerateRequest, WorkerFailed, WorkerStats

POLICIES = ("orchard", "round_robin")
NO_STATS = WorkerStats(0, 0, 0, 0, 0, 0, 0, 0)   # a worker that gave no answer (or none yet)

Item = TokenChunk | GenerateOutcome


class Backend:
    """Routing, attempts, retries and the admin calls over a ``WorkerPool`` of handles."""

    def __init__(self, launcher: Launcher, workers: int = 1, policy: str = "orchard",
                 clock: Callable[[], float] = time.monotonic,
                 index_bytes: int = DEFAULT_INDEX_BYTES) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._launcher = launcher
        self._initial = workers
        self._policy = policy
        self._clock = clock
        self._index_bytes = index_bytes  # the router's prefix index budget ([router])
        self._pool: WorkerPool | None = None
        self._info: ModelInfo | None = None
        self._rr = itertools.count()
        self._running: set[str] = set()   # request ids in flight (event loop only)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._pool is not None:
            return
        self._pool = WorkerPool(self._launcher, FrontendRouter(
            self._launcher.engine.block_size, clock=self._clock, index_bytes=self._index_bytes))
        await self._pool.start()
        if self._launcher.owner:   # another frontend's workers: attach to those there are
            await self._pool.follow()
            if not self._pool.ready():
                await self._pool.close()
                self._pool = None
                raise NoWorkerAvailable(f"no worker of {self._launcher.owner} to attach to "
                                        "(none listens yet, or it stopped)")
        else:
            await self._pool.scale(self._initial)
        if self._launcher.pulls:   # the router may plan pulls between these workers
            self._pool.routes.router.links = PeerLinks(
                self._pool.first_hello.model.kv_bytes_per_token)
        if self._launcher.watch:
            self._pool.start_checks()
        self._info = ModelInfo.of(self._pool.first_hello.model, self._launcher.model_dir,
                                  self._launcher.engine.cache_secret)

    async def close(self) -> None:
        if self._pool is None:
            return
        await self._pool.close()
        self._pool = None

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("model_info() before start(): start the backend first")
        return self._info

    @property
    def pool(self) -> WorkerPool:
        if self._pool is None:
            raise RuntimeError("the backend is not started: call start() first")
        return self._pool

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                       ) -> GenerateOutcome:
        async with contextlib.aclosing(self._run(request, block_hashes, chunks=False)) as run:
            async for item in run:
                if isinstance(item, GenerateOutcome):
                    return item
        raise RuntimeError(f"request {request.request_id}: ended without a result")

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                     ) -> AsyncIterator[Item]:
        async with contextlib.aclosing(self._run(request, block_hashes, chunks=True)) as run:
            async for item in run:
                yield item

    async def _run(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                   chunks: bool) -> AsyncIterator[Item]:
        """Attempts on one worker after another (``cluster.backend.retry``)."""
        rid = request.request_id
        if rid in self._running:
            raise ValueError(f"request_id: {rid!r} is already running; use a unique id")
        self._running.add(rid)
        try:
            async with contextlib.aclosing(retried(
                    rid, lambda n: self._attempt(request, block_hashes, n, chunks),
                    lambda item: isinstance(item, GenerateOutcome))) as items:
                async for item in items:
                    yield item
        finally:
            self._running.discard(rid)

    async def _attempt(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                       attempt: int, chunks: bool) -> AsyncIterator[Item]:
        """Route here, then the request on the chosen worker's handle: its chunks (or one
        ``Prefilled``), then its ``WorkerDone``, which carries the block events the router
        has not seen. Closed before the result, the handle aborts the request."""
        pool = self.pool
        decision, worker = self._place(pool, request, block_hashes)
        rid = request.request_id
        routes = pool.routes
        if decision is not None:
            routes.router.started(rid, decision)
        worker.running += 1
        try:
            first = True
            async with contextlib.aclosing(worker.handle.stream(
                    request, routes.feed_after(worker.worker_id), chunks,
                    _pull_plan(pool, decision))) as items:
                async for item in items:
                    match item:
                        case WorkerDone():
                            routes.apply(worker.worker_id, item.events)
                            yield GenerateOutcome(item.result, decision, attempt,
                                                  worker.worker_id, worker_s=item.worker_s,
                                                  worker_traced=item.traced,
                                                  pulled=item.pulled)
                            return
                        case TokenChunk() | Prefilled():
                            if first and decision is not None:
                                routes.router.prefilled(rid)
                            first = False
                            if isinstance(item, TokenChunk):
                                yield item
            raise RuntimeError(f"worker {worker.worker_id}: stream of {rid} ended early")
        except WorkerFailed as exc:
            pool.died(worker, exc)
            raise WorkerFailed(f"worker {worker.worker_id} died under it: {exc}") from None
        finally:
            worker.running -= 1
            if decision is not None:
                routes.router.finished(rid)
            pool.retire_if_drained(worker)

    def _place(self, pool: WorkerPool, request: GenerateRequest,
               block_hashes: Sequence[BlockHash]) -> tuple[RoutingDecision | None, PoolWorker]:
        """Choose a ready worker: the router's decision, or round robin for the baseline."""
        if self._policy == "round_robin":
            ready = sorted(pool.ready(), key=lambda w: w.worker_id)
            if not ready:
                raise NoWorkerAvailable("no ready worker: scale up or wait for a restart")
            return None, ready[next(self._rr) % len(ready)]
        decision = pool.routes.router.route(request.namespace, block_hashes,
                                            len(request.prompt), request.cache.session)
        worker = pool.get(decision.worker_id)
        if worker is None or worker.state != "ready":  # the pool removes both at once
            raise RuntimeError(f"router chose {decision.worker_id}, which the pool does not "
                               "serve from: the two disagree")
        return decision, worker

    # ---------------------------------------------------------------- admin

    async def workers(self) -> list[WorkerInfo]:
        pool = self.pool
        loads = {s.worker_id: s for s in pool.routes.router.workers()}
        live = pool.live()
        stats = await asyncio.gather(*(w.handle.stats() for w in live))
        by_id = {w.worker_id: s for w, s in zip(live, stats)}
        return [worker_info(w, by_id.get(w.worker_id), loads.get(w.worker_id))
                for w in pool.known()]

    async def scale(self, n: int) -> list[WorkerInfo]:
        await self.pool.scale(n)
        return await self.workers()

    async def drain(self, worker_id: str) -> WorkerInfo:
        """Drain ``worker_id``; returns it as it was when draining began."""
        before = {i.worker_id: i for i in await self.workers()}
        worker = await self.pool.drain(worker_id)
        info = before.get(worker_id) or worker_info(worker, None, None)
        return dataclasses.replace(info, state=worker.state)

    async def invalidate(self, namespace: Namespace | None, prefix_tokens: Sequence[int] | None
                         ) -> int:
        if namespace is None:
            raise ValueError("namespace: required; invalidation is per tenant namespace")
        counts = await asyncio.gather(*(w.handle.invalidate(namespace, prefix_tokens)
                                        for w in self.pool.live()))
        return sum(counts)

    async def cache_stats(self) -> CacheStats:
        stats = await asyncio.gather(*(w.handle.stats() for w in self.pool.live()))
        return CacheStats.of([s for s in stats if s is not None])


def _pull_plan(pool: WorkerPool, decision: RoutingDecision | None) -> PullPlan | None:
    """The decision's pull, addressed to its source's stream (None: no pull, or a source
    that left meanwhile)."""
    if decision is None or decision.pull is None:
        return None
    source = pool.get(decision.pull.source)
    if source is None or source.state not in ("ready", "draining") or source.handle is None:
        return None
    address = source.handle.address
    if address is None:
        return None
    return PullPlan(decision.pull.source, address[0], address[1], decision.pull.blocks,
                    decision.pull.predicted_s)


def worker_info(worker: PoolWorker, stats: WorkerStats | None, load: WorkerStatus | None
                ) -> WorkerInfo:
    """What an operator sees of ``worker``: the pool's view, the worker's own counts (zero
    when it gave none) and the queued prefill the router accounts to it."""
    s = stats or NO_STATS
    return WorkerInfo(
        worker_id=worker.worker_id, node=worker.hello.node if worker.hello else "",
        state=worker.state, running=worker.running,
        queued_tokens=load.queued_prefill_tokens if load else 0,
        cache_bytes=s.cache_bytes, cache_capacity_bytes=s.cache_capacity_bytes,
        cache_blocks=s.cache_blocks,
        hit_ratio=s.cached_tokens / s.input_tokens if s.input_tokens else 0.0,
        requests_served=s.requests_served, evictions=s.evictions, expirations=s.expirations,
        disk=s.disk)
