"""``LocalBackend``: the Backend protocol over in-process engines and the real router, no Ray.

The reference implementation of ``cluster.backend.protocol.Backend``, used by the fast tests and by
``python -m cluster.api.frontend``. Every engine lives on one thread of its own (MLX is driven from
one thread), and the router lives on the event loop:

    event loop                                engine thread
    ──────────                                ─────────────
    generate(): router.route ─► submit ─────► engine.submit(request)
                                              loop: step() every busy engine
                router.prefilled ◄─ first token ─┤
                router.apply_events ◄─ EventBatch (store's block events, after every step)
                router.finished  ◄─ GenerateResult
    admin calls ─────────── run on the engine thread (stats, invalidate, open/close engines)

Each worker is one ``workers.engine.Engine`` with its own prefix store; its block events reach
the router exactly as a Ray worker's would, so routing sees what each worker really holds.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from cluster.backend.protocol import (CacheStats, GenerateOutcome, ModelInfo, NoWorkersAvailable,
                             TokenChunk, UnknownWorker, WorkerInfo)
from cluster.config import engine_config
from router.events import EventBatch
from router.key import BlockHash, Namespace
from router.policy import NoWorkerAvailable
from router.router import Router
from workers.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
MAX_ATTEMPTS = 2


class WorkerFailed(RuntimeError):
    """A worker's engine raised while stepping: its requests fail over, the worker leaves."""


@dataclass(slots=True)
class _Worker:
    worker_id: str
    engine: Engine
    state: str = "ready"            # "ready" | "draining"
    running: int = 0                # requests submitted and not finished (event-loop side)
    input_tokens: int = 0
    cached_tokens: int = 0
    written_tokens: int = 0
    served: int = 0


@dataclass(frozen=True, slots=True)
class _Done:
    result: GenerateResult
    worker_s: float


@dataclass(slots=True)
class _Stream:
    """Where the engine thread delivers one request's chunks and result (on the loop)."""

    items: asyncio.Queue = field(default_factory=asyncio.Queue)


class LocalBackend:
    def __init__(self, model_dir: Path | str, workers: int = 1, engine: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._model_dir = Path(model_dir)
        self._initial = workers
        self._engine_config = engine or EngineConfig()
        self._clock = clock
        self._router = Router(self._engine_config.block_size, clock=clock)
        self._workers: dict[str, _Worker] = {}
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0
        self._event_seq: dict[str, int] = {}        # engine thread only
        self._active: dict[str, set[str]] = {}     # engine thread only: worker -> request ids
        self._info: ModelInfo | None = None

    @classmethod
    def from_config(cls, config, workers: int = 1) -> LocalBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        engine = engine_config(config)
        return cls(model_dir, workers=workers, engine=engine)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_thread, name="orchard-engines",
                                        daemon=True)
        self._thread.start()
        await self.scale(self._initial)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._workers.clear()

    def tokenizer_info(self) -> ModelInfo:
        if self._info is None:
            raise RuntimeError("tokenizer_info() before start(): start the backend first")
        return self._info

    # ------------------------------------------------------------ requests

    async def generate(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                       ) -> GenerateOutcome:
        async for item in self.stream(request, block_hashes):
            if isinstance(item, GenerateOutcome):
                return item
        raise RuntimeError(f"request {request.request_id}: stream ended without a result")

    async def stream(self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
                     ) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        """Route and run; if the worker fails before the first token, retry on another."""
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already running; use a unique id")
        for attempt in range(1, MAX_ATTEMPTS + 1):
            started = False
            try:
                async for item in self._attempt(request, block_hashes, attempt):
                    started = True
                    yield item
                return
            except WorkerFailed:
                if started or attempt == MAX_ATTEMPTS:
                    raise

    async def _attempt(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                       attempt: int) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        try:
            decision = self._router.route(request.namespace, block_hashes, len(request.prompt))
        except NoWorkerAvailable as exc:
            raise NoWorkersAvailable(str(exc)) from None
        worker = self._workers[decision.worker_id]
        rid = request.request_id
        self._streams[rid] = stream = _Stream()
        self._router.started(rid, decision)
        worker.running += 1
        self._commands.put(("submit", worker.worker_id, worker.engine, request))
        try:
            first = True
            while True:
                item = await stream.items.get()
                if isinstance(item, WorkerFailed):
                    self._remove_dead(worker)
                    raise item
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Done):
                    item, worker_s = item.result, item.worker_s
                    worker.input_tokens += item.input_tokens
                    worker.cached_tokens += item.cached_tokens
                    worker.written_tokens += item.written_tokens
                    worker.served += 1
                    yield GenerateOutcome(item, decision, attempt, worker.worker_id, worker_s)
                    return
                if first:
                    self._router.prefilled(rid)
                    first = False
                yield item
        finally:
            self._streams.pop(rid, None)
            self._router.finished(rid)
            worker.running -= 1
            self._retire_if_drained(worker)

    # ---------------------------------------------------------------- admin

    async def workers(self) -> list[WorkerInfo]:
        stats = await self._call(lambda: {w.worker_id: w.engine.store.stats()
                                          for w in list(self._workers.values())})
        loads = {s.worker_id: s for s in self._router.workers()}
        return [self._info_of(w, stats[w.worker_id], loads.get(w.worker_id))
                for w in self._workers.values() if w.worker_id in stats]

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
            engine = await self._call(lambda: Engine.open(self._model_dir, config,
                                                          clock=self._clock))
            self._workers[worker_id] = _Worker(worker_id, engine)
            self._router.add_worker(worker_id)
            if self._info is None:
                self._info = ModelInfo(engine.model_id, engine.revision, engine.vocab_size,
                                       engine.max_context, str(self._model_dir),
                                       engine.config.block_size)
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

        def run() -> int:
            removed = 0
            for w in list(self._workers.values()):
                store = w.engine.store
                if prefix_tokens is not None:
                    removed += store.invalidate_prefix(namespace, prefix_tokens)
                elif namespace.label() in store.ledger.namespaces():
                    removed += store.invalidate_namespace(namespace)
                self._publish(w.worker_id, w.engine)
            return removed
        return await self._call(run)

    async def cache_stats(self) -> CacheStats:
        infos = await self.workers()
        workers = list(self._workers.values())
        return CacheStats(
            workers=len(infos), cache_bytes=sum(i.cache_bytes for i in infos),
            cache_capacity_bytes=sum(i.cache_capacity_bytes for i in infos),
            cache_blocks=sum(i.cache_blocks for i in infos),
            input_tokens=sum(w.input_tokens for w in workers),
            cached_tokens=sum(w.cached_tokens for w in workers),
            computed_tokens=sum(w.input_tokens - w.cached_tokens for w in workers),
            written_tokens=sum(w.written_tokens for w in workers))

    # ---------------------------------------------------------- internals

    def _info_of(self, w: _Worker, stats, load) -> WorkerInfo:
        return WorkerInfo(
            worker_id=w.worker_id, node="local", state=w.state, running=w.running,
            queued_tokens=load.queued_prefill_tokens if load else 0,
            cache_bytes=stats.tensor_bytes, cache_capacity_bytes=stats.ledger.capacity_bytes,
            cache_blocks=stats.ledger.blocks,
            hit_ratio=w.cached_tokens / w.input_tokens if w.input_tokens else 0.0,
            requests_served=w.served, evictions=stats.ledger.evictions,
            expirations=stats.ledger.expirations)

    def _remove_dead(self, worker: _Worker) -> None:
        if self._workers.get(worker.worker_id) is worker:
            del self._workers[worker.worker_id]
            self._router.remove_worker(worker.worker_id)
            self._commands.put(("retire", worker.worker_id, worker.engine))

    def _retire_if_drained(self, worker: _Worker) -> None:
        """A draining worker with nothing in flight leaves: the router forgets its blocks."""
        if worker.state == "draining" and worker.running == 0 \
                and worker.worker_id in self._workers:
            del self._workers[worker.worker_id]
            self._router.remove_worker(worker.worker_id)
            self._commands.put(("retire", worker.worker_id, worker.engine))

    async def _call(self, fn):
        future = self._loop.create_future()
        self._commands.put(("call", fn, future))
        return await future

    def _deliver(self, rid: str, item) -> None:
        self._loop.call_soon_threadsafe(self._put, rid, item)

    def _put(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.items.put_nowait(item)

    def _publish(self, worker_id: str, engine: Engine) -> None:
        """Send the store's new block events to the router (on the loop), like a worker.

        Runs on the engine thread, which alone touches the engines and the sequence numbers.
        """
        events = engine.store.drain_events()
        if events:
            seq = self._event_seq[worker_id] = self._event_seq.get(worker_id, 0) + 1
            batch = EventBatch(worker_id, seq, tuple(events))
            self._loop.call_soon_threadsafe(self._apply_events, batch)

    def _apply_events(self, batch: EventBatch) -> None:
        if batch.worker_id in self._workers:
            self._router.apply_events(batch)

    # ---------------------------------------------------- the engine thread

    def _engine_thread(self) -> None:
        engines: dict[str, Engine] = {}
        while True:
            busy = any(e.busy for e in engines.values())
            try:
                command = self._commands.get(timeout=0 if busy else IDLE_WAIT_S)
            except queue.Empty:
                command = ()
            if command is None:
                return
            if command:
                self._run_command(command, engines)
                continue
            for worker_id, engine in list(engines.items()):
                if engine.busy:
                    self._step(worker_id, engine, engines)

    def _run_command(self, command: tuple, engines: dict[str, Engine]) -> None:
        kind = command[0]
        if kind == "submit":
            _, worker_id, engine, request = command
            try:
                engine.submit(request)
            except ValueError as exc:
                self._deliver(request.request_id, exc)
                return
            engines[worker_id] = engine
            self._active.setdefault(worker_id, set()).add(request.request_id)
        elif kind == "retire":
            engines.pop(command[1], None)
            for rid in self._active.pop(command[1], set()):
                self._deliver(rid, WorkerFailed(f"worker {command[1]} left mid-request"))
        elif kind == "call":
            _, fn, future = command
            try:
                result = fn()
            except Exception as exc:  # handed to the awaiting caller, which raises it
                self._loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self._loop.call_soon_threadsafe(_settle, future, result, None)

    def _step(self, worker_id: str, engine: Engine, engines: dict[str, Engine]) -> None:
        active = self._active.setdefault(worker_id, set())
        try:
            out = engine.step()
        except Exception as exc:  # the worker is broken: fail its requests over, drop it
            log.exception("worker %s failed", worker_id)
            engines.pop(worker_id, None)
            for rid in self._active.pop(worker_id, set()):
                self._deliver(rid, WorkerFailed(f"worker {worker_id} failed: {exc!r}"))
            return
        self._publish(worker_id, engine)
        for delta in out.deltas:
            self._deliver(delta.request_id,
                          TokenChunk(delta.request_id, (delta.token,), delta.text))
        done_ns = time.time_ns()  # after the step's cache writes: the worker's time ends here
        for result in out.finished:
            active.discard(result.request_id)
            self._deliver(result.request_id,
                          _Done(result, (done_ns - result.timings.received_ns) / 1e9))


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
