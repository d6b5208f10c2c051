"""``RayBackend``: the Backend protocol over worker actors spread across Ray nodes.

    frontend ─► RayBackend.generate(request, block_hashes)
                 ├─ routes.router.route + started  (in this process: no Ray hop,
                 │                                  ``cluster.backend.routing``)
                 ├─ worker w's stream (``cluster.backend.link``, not a Ray call): generate
                 │      ─► Prefilled or TokenChunks ─► router.prefilled
                 │      ─► WorkerDone(result, block events) ─► apply
                 └─ router.finished ─► GenerateOutcome(result, decision, ...)

No Ray call per request: Ray places, starts, watches and drains the workers (the control
plane), while each request goes over a persistent stream the frontend holds to its worker (a
Ray call alone costs more than the path's 5 ms budget on a small machine). The worker's block
events reach the frontend's router on its results and, between requests (evictions, TTL
expiry), on a Ray feed each worker streams (``EngineWorker.events``).

If worker ``w`` dies under the request (its stream closes, Ray declares its actor or node
dead, or its engine broke), the pool removes it from the router at once (its blocks are
forgotten) and starts a replacement in the background, and the request is routed again
(``cluster.backend.retry``: ``generate`` can always retry, ``stream`` only until its first
chunk has gone out). A request given up before its result (a cancelled stream, a deadline, a
cancelled job) is aborted on its worker (an ABORT on the stream). Scaling and draining act on
the live pool (``cluster.backend.ray_pool``), which also keeps the router actor (other
frontends, recovery) fed and replaced when lost.

Given ``TelemetrySettings`` (``from_config`` narrows them from the cluster config) every
worker actor sets up telemetry in its own process and draws its own spans under the context
``GenerateRequest.trace_context`` carries (``cluster.backend.worker_actor``); the outcome says
so, and the frontend does not draw them again. The routing span is the frontend's.

``policy="round_robin"`` skips the router and cycles through ready workers: the baseline of
``orchard bench cluster``. Ray is started (embedded, loopback only) or joined by ``start``
through ``cluster.backend.bootstrap``; ``close`` stops what it started.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from pathlib import Path
from typing import AsyncIterator, Sequence

import ray

from cluster.backend import bootstrap
from cluster.config import engine_config
from cluster.backend.bootstrap import Placement
from cluster.backend.protocol import (CacheStats, GenerateOutcome, ModelInfo, NoWorkerAvailable,
                                      TokenChunk, WorkerInfo)
from cluster.backend.ray_pool import PoolWorker, WorkerPool
from cluster.backend.retry import retried
from cluster.backend.routing import FrontendRouter
from cluster.backend.wire import WorkerDone
from cluster.telemetry.setup import TelemetrySettings, settings_from_config
from router.index import DEFAULT_INDEX_BYTES
from router.kv.key import BlockHash, Namespace
from router.policy import RoutingDecision
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, WorkerFailed, WorkerStats

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
POLICIES = ("orchard", "round_robin")


class RayBackend:
    def __init__(self, model_dir: Path | str, workers: int = 1,
                 engine: EngineConfig | None = None, placement: Placement = Placement(),
                 address: str | None = None, policy: str = "orchard",
                 start_timeout_s: float = 300.0,
                 telemetry: TelemetrySettings | None = None,
                 index_bytes: int = DEFAULT_INDEX_BYTES) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._model_dir = str(model_dir)
        self._initial = workers
        self._engine = engine or EngineConfig()
        self._placement = placement
        self._address = address
        self._policy = policy
        self._start_timeout_s = start_timeout_s
        self._telemetry = telemetry  # each actor sets up its own process's from it
        self._index_bytes = index_bytes  # the routers' prefix index budget ([router])
        self._pool: WorkerPool | None = None
        self._info: ModelInfo | None = None
        self._rr = itertools.count()
        self._started_ray = False

    @classmethod
    def from_config(cls, config, workers: int = 1, address: str | None = None,
                    placement: Placement = Placement(), policy: str = "orchard") -> RayBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.model.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        engine = engine_config(config)
        return cls(model_dir, workers, engine, placement, address, policy,
                   telemetry=settings_from_config(config, "orchard"),
                   index_bytes=config.router.index_bytes)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._pool is not None:
            return
        if not ray.is_initialized():
            # ray.init blocks for seconds: off the event loop, which may be serving already
            if self._address:
                await asyncio.to_thread(bootstrap.join, self._address)
            else:
                await asyncio.to_thread(bootstrap.start_local,
                                        bootstrap.local_cpus(self._initial, self._placement))
            self._started_ray = True
        self._pool = WorkerPool(self._model_dir, self._engine, self._placement,
                                FrontendRouter(self._engine.block_size,
                                               index_bytes=self._index_bytes),
                                self._start_timeout_s, telemetry=self._telemetry)
        await self._pool.start_router()
        await self._pool.scale(self._initial)
        self._pool.start_checks()
        hello = self._pool.first_hello
        self._info = ModelInfo(hello.model_id, hello.revision, hello.vocab_size,
                               hello.max_context, self._model_dir, hello.block_size,
                               hello.kv_bytes_per_token, hello.disk_kv_bytes_per_token,
                               self._engine.cache_secret)

    async def close(self) -> None:
        if self._pool is None:
            return
        await self._pool.close()
        router = self._pool.router_actor
        try:  # spans the router drew but has not exported yet
            await asyncio.wait_for(router.flush.remote(), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            log.info("router telemetry not flushed: %s", exc)
        ray.kill(router, no_restart=True)
        self._pool = None
        if self._started_ray:
            bootstrap.shutdown()
            self._started_ray = False

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
        async with contextlib.aclosing(self._run(request, block_hashes, streaming=False)) as run:
            async for item in run:
                return item
        raise RuntimeError(f"request {request.request_id}: ended without a result")

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                     ) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        async with contextlib.aclosing(self._run(request, block_hashes, streaming=True)) as run:
            async for item in run:
                yield item

    def _run(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
             streaming: bool) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        """Attempts on one worker after another (``cluster.backend.retry``)."""
        return retried(request.request_id,
                       lambda n: self._attempt(request, block_hashes, n, streaming),
                       lambda item: isinstance(item, GenerateOutcome))

    async def _attempt(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                       attempt: int, streaming: bool
                       ) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        """Route here, then the request on the chosen worker's stream
        (``cluster.backend.link``): its chunks (streaming) or one ``Prefilled`` (not
        streaming), then its ``WorkerDone``, which carries the block events the router has
        not seen. Closed before the result (cancelled, a deadline), the link aborts the
        request on the worker."""
        decision, worker = self._place(request, block_hashes)
        rid = request.request_id
        routes = self.pool.routes
        if decision is not None:
            routes.router.started(rid, decision)
        worker.running += 1
        try:
            first = True
            async with contextlib.aclosing(worker.link.stream(
                    request, routes.feed_after(worker.worker_id), streaming)) as items:
                async for item in items:
                    if isinstance(item, WorkerDone):
                        routes.apply(worker.worker_id, item.events)
                        yield self._outcome(item, decision, attempt, worker)
                        return
                    if first and decision is not None:
                        routes.router.prefilled(rid)
                    first = False
                    if isinstance(item, TokenChunk):
                        yield item
            raise RuntimeError(f"worker {worker.worker_id}: stream of {rid} ended early")
        except WorkerFailed as exc:
            self.pool.died(worker, exc)
            raise WorkerFailed(f"worker {worker.worker_id} died under it") from None
        finally:
            worker.running -= 1
            if decision is not None:
                routes.router.finished(rid)
            self.pool.retire_if_drained(worker)

    def _outcome(self, done: WorkerDone, decision: RoutingDecision | None, attempt: int,
                 worker: PoolWorker) -> GenerateOutcome:
        return GenerateOutcome(done.result, decision, attempt, worker.worker_id,
                               worker_s=done.worker_s, worker_traced=done.traced)

    def _place(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
               ) -> tuple[RoutingDecision | None, PoolWorker]:
        """Choose a ready worker: the router's decision, or round robin for the baseline."""
        if self._policy == "round_robin":
            ready = sorted(self.pool.ready(), key=lambda w: w.worker_id)
            if not ready:
                raise NoWorkerAvailable("no ready worker: scale up or wait for a restart")
            return None, ready[next(self._rr) % len(ready)]
        decision = self.pool.routes.router.route(request.namespace, block_hashes,
                                                 len(request.prompt))
        worker = self.pool.get(decision.worker_id)
        if worker is None or worker.state != "ready":  # the pool removes both at once
            raise RuntimeError(f"router chose {decision.worker_id}, which the pool does not "
                               "serve from: the two disagree")
        return decision, worker

    # ---------------------------------------------------------------- admin

    async def workers(self) -> list[WorkerInfo]:
        pool = self.pool
        loads = {s.worker_id: s for s in pool.routes.router.workers()}
        live = pool.live()
        stats = await asyncio.gather(*(self._stats(w) for w in live))
        by_id = {w.worker_id: s for w, s in zip(live, stats)}
        return [_info(w, by_id.get(w.worker_id), loads.get(w.worker_id)) for w in pool.known()]

    async def scale(self, n: int) -> list[WorkerInfo]:
        await self.pool.scale(n)
        return await self.workers()

    async def drain(self, worker_id: str) -> WorkerInfo:
        """Drain ``worker_id``; returns it as it was when draining began."""
        before = {i.worker_id: i for i in await self.workers()}
        worker = await self.pool.drain(worker_id)
        info = before.get(worker_id) or _info(worker, None, None)
        return WorkerInfo(**{**_fields(info), "state": worker.state})

    async def invalidate(self, namespace: Namespace | None, prefix_tokens: Sequence[int] | None
                         ) -> int:
        if namespace is None:
            raise ValueError("namespace: required; invalidation is per tenant namespace")
        prefix = None if prefix_tokens is None else list(prefix_tokens)
        counts = await asyncio.gather(*(w.actor.invalidate.remote(namespace, prefix)
                                        for w in self.pool.live()))
        return sum(counts)

    async def cache_stats(self) -> CacheStats:
        stats = await asyncio.gather(*(self._stats(w) for w in self.pool.live()))
        return CacheStats.of([s for s in stats if s is not None])

    async def _stats(self, worker: PoolWorker) -> WorkerStats | None:
        try:
            return await asyncio.wait_for(worker.actor.stats.remote(), STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            log.info("worker %s: no stats (%s)", worker.worker_id, exc)
            return None


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def _info(worker: PoolWorker, stats: WorkerStats | None, load) -> WorkerInfo:
    s = stats or WorkerStats(0, 0, 0, 0, 0, 0, 0, 0)
    return WorkerInfo(
        worker_id=worker.worker_id, node=worker.hello.node if worker.hello else "",
        state=worker.state, running=worker.running,
        queued_tokens=load.queued_prefill_tokens if load else 0,
        cache_bytes=s.cache_bytes, cache_capacity_bytes=s.cache_capacity_bytes,
        cache_blocks=s.cache_blocks,
        hit_ratio=s.cached_tokens / s.input_tokens if s.input_tokens else 0.0,
        requests_served=s.requests_served, evictions=s.evictions, expirations=s.expirations,
        disk=s.disk)
