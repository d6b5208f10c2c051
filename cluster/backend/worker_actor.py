"""The worker actor: a thin Ray actor around one ``workers.engine.Engine`` and its prefix store.

``EngineWorker`` is a plain class (usable without Ray); ``WorkerActor`` is its one-line async
Ray actor. MLX is driven from one thread, so the engine lives on a thread of its own and the
actor's event loop only hands it work and relays what comes back::

    actor event loop                           engine thread
    ────────────────                           ─────────────
    generate(request) ─ submit ──────────────► engine.submit(request)
      yields TokenChunk ◄────── deltas ──────┤ loop: engine.step() while busy
      yields WorkerDone ◄────── finished ────┤   first token ─► router.prefilled.remote
      (run: WorkerDone only)                 ├► router.apply_events.remote(msgpack batch)
                                             └► finished: its spans (lookup, prefill, decode)
    stats / invalidate / holdings ── call ───► run on the engine thread

After every step the store's new block events go to the router actor as one msgpack-encoded
``EventBatch`` with a per-worker sequence number (fire and forget: the router notices a gap
and asks for ``holdings`` to rebuild).

Given ``TelemetrySettings`` the worker sets up its process's telemetry on ``start`` (service
``orchard-worker``, its id and node as resource attributes) and draws each finished request's
spans from the result's ``Timings`` under the context the request carried
(``cluster.telemetry.spans.record_engine``); ``WorkerDone.traced`` tells the caller not to draw them again.

The module imports ``workers`` first, so the actor's process loads OpenBLAS before MLX.
"""
from __future__ import annotations

import workers  # noqa: F401  (OpenBLAS before mlx, in the actor's process too)

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import ray

from cluster.telemetry import spans
from cluster.telemetry import attrs as A
from cluster.backend.protocol import TokenChunk
from cluster.telemetry.setup import (SERVICE_WORKER, Telemetry, TelemetrySettings, process_settings,
                               process_telemetry)
from router.events import EventBatch, encode_batch
from router.key import BlockHash, Namespace
from workers.blas import openblas_in_use
from workers.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
EXPIRE_EVERY_S = 1.0   # how often an idle engine drops expired blocks (and tells the router)


class WorkerFailed(RuntimeError):
    """The worker's engine broke mid-request: retry elsewhere, replace the worker."""


@dataclass(frozen=True, slots=True)
class WorkerHello:
    """What a started worker reports about itself and the model it loaded."""

    worker_id: str
    node_id: str
    node: str             # the node's address, as operators know it
    pid: int
    model_id: str
    revision: str
    vocab_size: int
    max_context: int
    block_size: int
    openblas: bool


@dataclass(frozen=True, slots=True)
class WorkerDone:
    """A finished request and the worker's own wall time on it (cache writes included)."""

    result: GenerateResult
    worker_s: float
    traced: bool = False   # the worker drew the request's spans (lookup, prefill, decode)


@dataclass(frozen=True, slots=True)
class WorkerStats:
    running: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_blocks: int
    stored_blocks: int
    input_tokens: int
    cached_tokens: int
    requests_served: int
    evictions: int = 0     # blocks the store evicted so far (capacity)
    expirations: int = 0   # blocks the store dropped after their TTL so far


class EngineWorker:
    """One engine on its own thread, fed by async callers; block events go to ``router``."""

    def __init__(self, worker_id: str, model_dir: str, config: EngineConfig, router=None,
                 clock: Callable[[], float] = time.monotonic,
                 telemetry: TelemetrySettings | None = None) -> None:
        self._id = worker_id
        self._model_dir = model_dir
        self._config = EngineConfig(**{**_fields(config), "worker_id": worker_id})
        self._router = router
        self._clock = clock
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Callable[[object], None]] = {}  # engine thread only
        self._requests: dict[str, GenerateRequest] = {}        # engine thread only
        self._settings = telemetry
        self._tel: Telemetry | None = None
        self._seq = 0                                           # engine thread only
        self._unprefilled: set[str] = set()  # engine thread only: routed, no token yet
        self._engine: Engine | None = None
        self._thread: threading.Thread | None = None
        self._input_tokens = 0
        self._cached_tokens = 0
        self._served = 0

    async def start(self) -> WorkerHello:
        """Load the model on the engine thread; idempotent."""
        if self._tel is None:
            self._tel = process_telemetry(process_settings(
                self._settings, SERVICE_WORKER, ((A.WORKER, self._id),), _node_address(),
                _node_id()))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"engine-{self._id}",
                                            daemon=True)
            self._thread.start()
        engine = await self._call(self._open)
        return WorkerHello(self._id, _node_id(), _node_address(), os.getpid(), engine.model_id, engine.revision,
                           engine.vocab_size, engine.max_context, engine.config.block_size,
                           openblas_in_use())

    async def generate(self, request: GenerateRequest, routed: bool = False
                       ) -> AsyncIterator[TokenChunk | WorkerDone]:
        """Run ``request``: its ``TokenChunk``s, then one ``WorkerDone``.

        ``routed``: the router placed it, so tell the router when its prefill is done.
        """
        self._check_started()
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self._commands.put(("submit", request, routed,
                            lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
        while True:
            item = await items.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, WorkerDone):
                self._input_tokens += item.result.input_tokens
                self._cached_tokens += item.result.cached_tokens
                self._served += 1
                yield item
                return
            yield item

    async def run(self, request: GenerateRequest, routed: bool = False) -> WorkerDone:
        """``generate`` answered once, with the finished request only."""
        async for item in self.generate(request, routed):
            if isinstance(item, WorkerDone):
                return item
        raise WorkerFailed(f"worker {self._id}: {request.request_id} ended without a result")

    async def stats(self) -> WorkerStats:
        def read(engine: Engine) -> WorkerStats:
            s = engine.store.stats()
            return WorkerStats(len(self._sinks), s.tensor_bytes, s.ledger.capacity_bytes,
                               s.ledger.blocks, s.ledger.stored_blocks, 0, 0, 0,
                               s.ledger.evictions, s.ledger.expirations)
        s = await self._call(read)
        return WorkerStats(s.running, s.cache_bytes, s.cache_capacity_bytes, s.cache_blocks,
                           s.stored_blocks, self._input_tokens, self._cached_tokens, self._served,
                           s.evictions, s.expirations)

    async def invalidate(self, namespace: Namespace | None,
                         prefix_tokens: Sequence[int] | None) -> int:
        """Drop a namespace's blocks, or those under a prompt prefix; returns how many."""
        def run(engine: Engine) -> int:
            store = engine.store
            if prefix_tokens is not None:
                removed = store.invalidate_prefix(namespace, list(prefix_tokens))
            elif namespace.label() in store.ledger.namespaces():
                removed = store.invalidate_namespace(namespace)
            else:
                removed = 0
            self._publish(engine)
            return removed
        if namespace is None:
            raise ValueError("namespace: required; invalidation is per tenant namespace")
        return await self._call(run)

    async def holdings(self) -> list[BlockHash]:
        """Every block hash the store holds, for the router to rebuild its index."""
        return await self._call(lambda engine: [h.block for h in engine.store.holdings()])

    async def ping(self) -> int:
        """Liveness, answered by the actor's event loop (not the engine thread)."""
        return os.getpid()

    async def close(self) -> None:
        """Stop the engine thread, then flush and stop telemetry (spans not yet exported)."""
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._tel is not None:
            await asyncio.to_thread(self._tel.shutdown)
            self._tel = None

    # ---------------------------------------------------------------- internals

    async def _call(self, fn: Callable[[Engine], object]):
        self._check_started()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn,
                            lambda ok, value: loop.call_soon_threadsafe(_settle, future, ok,
                                                                        value)))
        return await future

    def _traced(self, engine: Engine, result: GenerateResult) -> bool:
        """Draw a finished request's spans (engine thread); False when they were not."""
        request = self._requests.pop(result.request_id, None)
        if request is None or not request.trace_context or self._tel is None \
                or not self._tel.enabled:
            return False  # an untraced request draws no orphan trace
        return spans.record_engine(self._tel, request, result,
                                   lambda ids: engine.tokenizer.decode(list(ids)))

    def _check_started(self) -> None:
        if self._thread is None:
            raise RuntimeError(f"worker {self._id} is not started: call start() first")

    async def set_router(self, router) -> None:
        """Send block events to ``router`` from now on (the router actor was restarted)."""
        self._router = router

    def _open(self, engine: Engine | None) -> Engine:
        if self._engine is None:
            self._engine = Engine.open(self._model_dir, self._config, clock=self._clock)
        return self._engine

    def _publish(self, engine: Engine) -> None:
        events = engine.store.drain_events()
        if events and self._router is not None:
            self._seq += 1
            self._router.apply_events.remote(encode_batch(EventBatch(self._id, self._seq,
                                                                     tuple(events))))

    def _run(self) -> None:
        """The engine thread: commands when idle, one engine step at a time when busy, and
        expired blocks dropped now and then (so the router hears of them)."""
        expired_at = self._clock()
        while True:
            busy = self._engine is not None and self._engine.busy
            try:
                command = self._commands.get(timeout=0 if busy else IDLE_WAIT_S)
            except queue.Empty:
                command = ()
            if command is None:
                return
            if command:
                self._command(command)
            elif busy:
                self._step(self._engine)
            elif self._engine is not None and self._clock() - expired_at >= EXPIRE_EVERY_S:
                expired_at = self._clock()
                if self._engine.store.expire():
                    self._publish(self._engine)

    def _command(self, command: tuple) -> None:
        if command[0] == "submit":
            _, request, routed, sink = command
            if self._engine is None:
                sink(WorkerFailed(f"worker {self._id} has no engine (not started, or broken)"))
                return
            try:
                self._engine.submit(request)
            except ValueError as exc:
                sink(exc)
                return
            self._sinks[request.request_id] = sink
            self._requests[request.request_id] = request
            if routed and self._router is not None:
                self._unprefilled.add(request.request_id)
        else:
            _, fn, settle = command
            try:
                value = fn(self._engine)
            except Exception as exc:  # handed to the awaiting caller, which raises it
                settle(False, exc)
            else:
                settle(True, value)

    def _step(self, engine: Engine) -> None:
        try:
            out = engine.step()
        except Exception as exc:
            # A broken engine fails every request it holds with ``WorkerFailed``: the cluster
            # retries them elsewhere and replaces this worker. Nothing runs here afterwards.
            log.exception("worker %s: engine step failed", self._id)
            self._engine = None
            for sink in self._sinks.values():
                sink(WorkerFailed(f"worker {self._id} failed: {exc!r}"))
            self._sinks.clear()
            self._requests.clear()
            self._unprefilled.clear()
            return
        self._publish(engine)
        for delta in out.deltas:
            if delta.request_id in self._unprefilled:
                self._unprefilled.discard(delta.request_id)
                self._router.prefilled.remote(delta.request_id)
            sink = self._sinks.get(delta.request_id)
            if sink is not None:
                sink(TokenChunk(delta.request_id, (delta.token,), delta.text))
        done_ns = time.time_ns()
        for result in out.finished:
            traced = self._traced(engine, result)
            sink = self._sinks.pop(result.request_id, None)
            if sink is not None:
                sink(WorkerDone(result, (done_ns - result.timings.received_ns) / 1e9, traced))


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def _node_address() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "local"


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


WorkerActor = ray.remote(EngineWorker)
