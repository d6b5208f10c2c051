"""``RayBackend``: the Backend protocol over worker actors spread across Ray nodes.

    frontend ─► RayBackend.generate(request, block_hashes)
                 ├─ router actor: route_and_start ─► RoutingDecision (worker w)
                 ├─ worker actor w: run ─► WorkerDone        (stream: generate, streamed:
                 │      first token ─► router.prefilled        TokenChunk ... WorkerDone)
                 │      block events ─► router.apply_events    (both sent by the worker)
                 └─ router.finished (fire and forget) ─► GenerateOutcome(result, decision, ...)

If worker ``w`` dies under the request (its actor or its node is gone, or its engine broke),
the pool removes it from the router at once (its blocks are forgotten) and starts a
replacement in the background, and the request is routed again, up to ``MAX_ATTEMPTS``
workers. ``generate`` can always retry (it hands back only the final result); ``stream``
retries only until its first chunk has gone out, since chunks already sent cannot be taken
back. Scaling and draining act on the live pool (``cluster.backend.ray_pool``).

Given ``TelemetrySettings`` (``from_config`` narrows them from the cluster config) the router
actor and every worker actor set up telemetry in their own processes and draw their own spans
under the context ``GenerateRequest.trace_context`` carries (``cluster.backend.router_actor``,
``cluster.backend.worker_actor``); the outcome says so, and the frontend does not draw them again.

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
from cluster.backend.protocol import (CacheStats, GenerateOutcome, ModelInfo, NoWorkersAvailable,
                             TokenChunk, WorkerInfo)
from cluster.backend.bootstrap import Placement
from cluster.backend.ray_pool import PoolWorker, WorkerPool
from cluster.backend.router_actor import TracedRouterActor
from cluster.telemetry.setup import TelemetrySettings, settings_from_config
from cluster.backend.worker_actor import WorkerDone, WorkerFailed, WorkerStats
from router.key import BlockHash, Namespace
from router.policy import NoWorkerAvailable
from workers.engine import EngineConfig
from workers.messages import GenerateRequest

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
STATS_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
POLICIES = ("orchard", "round_robin")


class RayBackend:
    def __init__(self, model_dir: Path | str, workers: int = 1,
                 engine: EngineConfig | None = None, placement: Placement = Placement(),
                 address: str | None = None, policy: str = "orchard",
                 start_timeout_s: float = 300.0,
                 telemetry: TelemetrySettings | None = None) -> None:
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
        self._route_traced = False   # the router actor draws the routing spans
        self._router = None
        self._pool: WorkerPool | None = None
        self._info: ModelInfo | None = None
        self._rr = itertools.count()
        self._started_ray = False
        self._router_lock = asyncio.Lock()

    @classmethod
    def from_config(cls, config, workers: int = 1, address: str | None = None,
                    placement: Placement = Placement(), policy: str = "orchard") -> RayBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        engine = engine_config(config)
        return cls(model_dir, workers, engine, placement, address, policy,
                   telemetry=settings_from_config(config, "orchard"))

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
        await self._start_router()
        self._pool = WorkerPool(self._model_dir, self._engine, self._placement, self._router,
                                self._start_timeout_s, telemetry=self._telemetry)
        await self._pool.scale(self._initial)
        self._pool.start_checks()
        hello = self._pool.first_hello
        self._info = ModelInfo(hello.model_id, hello.revision, hello.vocab_size,
                               hello.max_context, self._model_dir, hello.block_size)

    async def _start_router(self) -> None:
        self._router = TracedRouterActor.options(**bootstrap.on_this_node()).remote(
            self._engine.block_size, self._telemetry)
        self._route_traced = await self._router.tracing.remote()

    async def _recover_router(self, lost) -> None:
        """The router actor died: start a new one and rebuild its index from the workers.

        Requests that find the router gone wait here for one recovery (``lost`` is the actor
        they saw fail; a caller that arrives after the recovery finds a new one and returns).
        """
        async with self._router_lock:
            if self._router is not lost:
                return
            log.warning("router actor lost: starting a new one, rebuilding from the workers")
            await self._start_router()
            await self.pool.attach_router(self._router)

    async def close(self) -> None:
        if self._pool is None:
            return
        await self._pool.close()
        try:  # spans the router drew but has not exported yet
            await asyncio.wait_for(self._router.flush.remote(), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            log.info("router telemetry not flushed: %s", exc)
        ray.kill(self._router, no_restart=True)
        self._pool = None
        if self._started_ray:
            bootstrap.shutdown()
            self._started_ray = False

    def tokenizer_info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("tokenizer_info() before start(): start the backend first")
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

    async def _run(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                   streaming: bool) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        """Attempts on one worker after another until one finishes the request.

        Not streaming, the worker answers once (one Ray round trip); streaming, each chunk is
        an object of a Ray streaming generator. The worker itself tells the router when the
        prefill is done (``routed``), so that costs the caller no round trip.
        """
        rid = request.request_id
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decision, worker = await self._place(request, block_hashes)
            routed = decision is not None
            worker.running += 1
            sent = False
            try:
                if not streaming:
                    done = await worker.actor.run.remote(request, routed)
                    yield self._outcome(done, decision, attempt, worker)
                    return
                async for ref in worker.actor.generate.options(
                        num_returns="streaming").remote(request, routed):
                    item = await ref
                    if isinstance(item, WorkerDone):
                        yield self._outcome(item, decision, attempt, worker)
                        return
                    sent = True
                    yield item
                raise RuntimeError(f"worker {worker.worker_id}: stream of {rid} ended early")
            except (ray.exceptions.RayActorError, WorkerFailed) as exc:
                self.pool.died(worker, exc)
                if sent or attempt == MAX_ATTEMPTS:
                    raise NoWorkersAvailable(
                        f"request {rid}: worker {worker.worker_id} died under it "
                        f"(attempt {attempt}); retry the request") from None
                log.info("request %s: retrying after worker %s died", rid, worker.worker_id)
            finally:
                worker.running -= 1
                if routed:
                    self._router.finished.remote(rid)
                self.pool.retire_if_drained(worker)

    def _outcome(self, done: WorkerDone, decision, attempt: int, worker: PoolWorker
                 ) -> GenerateOutcome:
        return GenerateOutcome(done.result, decision, attempt, worker.worker_id,
                               worker_s=done.worker_s,
                               route_traced=decision is not None and self._route_traced,
                               worker_traced=done.traced)

    async def _place(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                     ) -> tuple[object, PoolWorker]:
        """Choose a ready worker: the router's decision, or round robin for the baseline."""
        if self._policy == "round_robin":
            ready = sorted(self.pool.ready(), key=lambda w: w.worker_id)
            if not ready:
                raise NoWorkersAvailable("no ready worker: scale up or wait for a restart")
            return None, ready[next(self._rr) % len(ready)]
        for _ in range(MAX_ATTEMPTS):
            router = self._router
            try:
                decision = await router.route_and_start.remote(
                    request.request_id, request.namespace, list(block_hashes),
                    len(request.prompt), request.trace_context)
            except NoWorkerAvailable as exc:
                raise NoWorkersAvailable(str(exc)) from None
            except ray.exceptions.RayActorError:
                await self._recover_router(router)
                continue
            worker = self.pool.get(decision.worker_id)
            if worker is not None and worker.state == "ready":
                return decision, worker
            # Left between the router's choice and now (its removal is on its way): reroute.
            self._router.finished.remote(request.request_id)
        raise NoWorkersAvailable(f"request {request.request_id}: no ready worker found")

    # ---------------------------------------------------------------- admin

    async def workers(self) -> list[WorkerInfo]:
        pool = self.pool
        loads = {s.worker_id: s for s in await self._router.workers.remote()}
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
        stats = [s for s in await asyncio.gather(*(self._stats(w) for w in self.pool.live()))
                 if s is not None]
        return CacheStats(
            workers=len(stats), cache_bytes=sum(s.cache_bytes for s in stats),
            cache_capacity_bytes=sum(s.cache_capacity_bytes for s in stats),
            cache_blocks=sum(s.cache_blocks for s in stats),
            input_tokens=sum(s.input_tokens for s in stats),
            cached_tokens=sum(s.cached_tokens for s in stats),
            computed_tokens=sum(s.input_tokens - s.cached_tokens for s in stats),
            written_tokens=sum(s.stored_blocks for s in stats) * self._engine.block_size)

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
        requests_served=s.requests_served, evictions=s.evictions, expirations=s.expirations)
