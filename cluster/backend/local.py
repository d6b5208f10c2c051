"""``LocalBackend``: the Backend protocol over in-process engines and the real router, no Ray.

The reference implementation of ``cluster.backend.protocol.Backend``, used by the fast tests
and by ``python -m cluster.api.frontend``. The engines run on one ``workers.engine.runtime``
``EngineRuntime`` (one engine thread, as MLX wants); the router and the per-worker tables live
on the event loop::

    event loop                                   engine thread (workers.engine.runtime)
    ──────────                                   ─────────────
    stream(): router.route ─► runtime.run ─────► engine.submit
                router.prefilled ◄─ first TokenDelta ┤ loop: step() every busy engine
                router.apply_events ◄── EventBatch ───┤ (block events, after every step)
                router.finished  ◄──── Finished ──────┘
              closed early (cancel, deadline) ─► Abort: the request leaves its batch
    admin calls ─────────── runtime.call / stats (stats, invalidate, open engines)

Each worker is one ``workers.engine.engine.Engine`` with its own prefix store; its block events reach
the router exactly as a Ray worker's would, so routing sees what each worker really holds. A
worker whose engine breaks leaves; its requests are retried elsewhere
(``cluster.backend.retry``).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from cluster.backend.protocol import (CacheStats, GenerateOutcome, ModelInfo, TokenChunk,
                                      UnknownWorker, WorkerInfo)
from cluster.backend.retry import retried
from cluster.config import engine_config
from router.index import DEFAULT_INDEX_BYTES
from router.kv.events import EventBatch
from router.kv.key import BlockHash, Namespace
from router.router import Router
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, WorkerFailed, WorkerStats
from workers.engine.runtime import EngineRuntime, Finished


@dataclass(slots=True)
class _Worker:
    """A worker as the event loop sees it (event loop only)."""

    worker_id: str
    state: str = "ready"            # "ready" | "draining"
    running: int = 0                # requests submitted and not finished


class LocalBackend:
    def __init__(self, model_dir: Path | str, workers: int = 1, engine: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 index_bytes: int = DEFAULT_INDEX_BYTES):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._model_dir = Path(model_dir)
        self._initial = workers
        self._engine_config = engine or EngineConfig()
        self._clock = clock
        self._router = Router(self._engine_config.block_size, clock=clock,  # event loop only
                              index_bytes=index_bytes)
        self._workers: dict[str, _Worker] = {}                               # event loop only
        self._streams: set[str] = set()                                      # event loop only
        self._runtime: EngineRuntime | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0
        self._info: ModelInfo | None = None

    @classmethod
    def from_config(cls, config, workers: int = 1) -> LocalBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.model.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        engine = engine_config(config)
        return cls(model_dir, workers=workers, engine=engine,
                   index_bytes=config.router.index_bytes)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._runtime is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._runtime = EngineRuntime(self._events_from_engine_thread, self._clock)
        await self.scale(self._initial)

    async def close(self) -> None:
        if self._runtime is None:
            return
        await self._runtime.close()
        self._runtime = None
        self._workers.clear()

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("model_info() before start(): start the backend first")
        return self._info

    @property
    def runtime(self) -> EngineRuntime:
        if self._runtime is None:
            raise RuntimeError("the backend is not started: call start() first")
        return self._runtime

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                       ) -> GenerateOutcome:
        async with contextlib.aclosing(self.stream(request, block_hashes)) as items:
            async for item in items:
                if isinstance(item, GenerateOutcome):
                    return item
        raise RuntimeError(f"request {request.request_id}: stream ended without a result")

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                     ) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        """Route and run; if the worker fails before the first token, retry on another."""
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already running; use a unique id")
        self._streams.add(rid)
        try:
            async with contextlib.aclosing(retried(
                    rid, lambda n: self._attempt(request, block_hashes, n),
                    lambda item: isinstance(item, GenerateOutcome))) as items:
                async for item in items:
                    yield item
        finally:
            self._streams.discard(rid)

    async def _attempt(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                       attempt: int) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        decision = self._router.route(request.namespace, block_hashes, len(request.prompt))
        worker = self._workers[decision.worker_id]
        rid = request.request_id
        self._router.started(rid, decision)
        worker.running += 1
        try:
            first = True
            async with contextlib.aclosing(self.runtime.run(worker.worker_id, request)) as run:
                async for item in run:
                    if isinstance(item, Finished):
                        yield GenerateOutcome(item.result, decision, attempt, worker.worker_id,
                                              item.worker_s)
                        return
                    if first:
                        self._router.prefilled(rid)
                        first = False
                    yield TokenChunk(rid, (item.token,), item.text)
            raise RuntimeError(f"worker {worker.worker_id}: {rid} ended without a result")
        except WorkerFailed:
            self._remove(worker)
            raise
        finally:
            self._router.finished(rid)
            worker.running -= 1
            self._retire_if_drained(worker)

    # ---------------------------------------------------------------- admin

    async def workers(self) -> list[WorkerInfo]:
        live = list(self._workers.values())
        stats = await asyncio.gather(*(self.runtime.stats(w.worker_id) for w in live),
                                     return_exceptions=True)
        loads = {s.worker_id: s for s in self._router.workers()}
        return [_info(w, s, loads.get(w.worker_id)) for w, s in zip(live, stats)
                if isinstance(s, WorkerStats)]

    async def scale(self, n: int) -> list[WorkerInfo]:
        if n < 1:
            raise ValueError(f"workers: must be >= 1, got {n}")
        ready = [w for w in self._workers.values() if w.state == "ready"]
        for worker in ready[n:]:
            await self.drain(worker.worker_id)
        for _ in range(n - len(ready)):
            worker_id = f"local-{self._next_id}"
            self._next_id += 1
            config = EngineConfig(**{**_fields(self._engine_config), "worker_id": worker_id})
            engine = await self.runtime.open(worker_id, str(self._model_dir), config,
                                             self._clock)
            self._workers[worker_id] = _Worker(worker_id)
            self._router.add_worker(worker_id)
            # a store that opened on a disk directory holding blocks (a restart) has them
            # already: the router learns them, with their tier, before the first request
            held = await self.runtime.holdings(worker_id)
            self._router.rebuild(worker_id, held.blocks, held.disk_blocks)
            if self._info is None:
                self._info = ModelInfo(engine.model_id, engine.revision, engine.vocab_size,
                                       engine.max_context, str(self._model_dir),
                                       engine.config.block_size, engine.kv_bytes_per_token,
                                       engine.disk_kv_bytes_per_token,
                                       engine.config.cache_secret)
        return await self.workers()

    async def drain(self, worker_id: str) -> WorkerInfo:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(f"worker_id: no worker {worker_id!r}; known: "
                                f"{', '.join(self._workers) or 'none'}")
        info = next(i for i in await self.workers() if i.worker_id == worker_id)
        worker.state = "draining"
        self._router.drain_worker(worker_id)
        self._retire_if_drained(worker)
        return WorkerInfo(**{**_fields(info), "state": "draining"})

    async def invalidate(self, namespace: Namespace | None, prefix_tokens: Sequence[int] | None
                         ) -> int:
        if namespace is None:
            raise ValueError("namespace: required; invalidation is per tenant namespace")
        counts = await asyncio.gather(*(
            self.runtime.call(w, lambda engine: engine.invalidate(namespace, prefix_tokens))
            for w in list(self._workers)))
        return sum(counts)

    async def cache_stats(self) -> CacheStats:
        stats = await asyncio.gather(*(self.runtime.stats(w) for w in list(self._workers)),
                                     return_exceptions=True)
        return CacheStats.of([s for s in stats if isinstance(s, WorkerStats)])

    # ---------------------------------------------------------- internals

    def _remove(self, worker: _Worker) -> None:
        """``worker`` broke: the router forgets it and its blocks, the runtime drops it."""
        if self._workers.get(worker.worker_id) is worker:
            del self._workers[worker.worker_id]
            self._router.remove_worker(worker.worker_id)
            self.runtime.retire(worker.worker_id)

    def _retire_if_drained(self, worker: _Worker) -> None:
        """A draining worker with nothing in flight leaves: the router forgets its blocks."""
        if worker.state == "draining" and worker.running == 0:
            self._remove(worker)

    def _events_from_engine_thread(self, batch: EventBatch) -> None:
        self._loop.call_soon_threadsafe(self._apply_events, batch)

    def _apply_events(self, batch: EventBatch) -> None:
        if batch.worker_id in self._workers:
            self._router.apply_events(batch)


def _info(w: _Worker, s: WorkerStats, load) -> WorkerInfo:
    return WorkerInfo(
        worker_id=w.worker_id, node="local", state=w.state, running=w.running,
        queued_tokens=load.queued_prefill_tokens if load else 0,
        cache_bytes=s.cache_bytes, cache_capacity_bytes=s.cache_capacity_bytes,
        cache_blocks=s.cache_blocks,
        hit_ratio=s.cached_tokens / s.input_tokens if s.input_tokens else 0.0,
        requests_served=s.requests_served, evictions=s.evictions, expirations=s.expirations,
        disk=s.disk)


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
