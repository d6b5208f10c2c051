"""The engine runtime: a process's engines on one thread of their own, driven by typed commands.

MLX is driven from one thread, so every engine a process runs lives on one engine thread, and
the callers (an asyncio loop: the in-process backend, or a Ray worker actor) reach it only
through the command queue. This is the one place that drives an engine::

    caller's event loop                            engine thread
    ───────────────────                            ─────────────
    await open(worker_id, model_dir, config) ─ Open ───► Engine.open
    run(worker_id, request)  ────────────────── Submit ─► engine.submit  (ValueError ─► caller)
      yields TokenDelta ... Finished  ◄──────── sink ───┤ loop: one step of every busy engine
      closed before Finished ──────────────── Abort ───► engine.abort: leaves at the next step
    abort(request_id) (from elsewhere) ─────── Abort ───► the run ends without a result
    await call(worker_id, fn) ───────────────── Call ───► fn(engine)
    retire(worker_id) ───────────────────────── Retire ─► dropped; its runs raise WorkerFailed,
                                                          its store persisted (Engine.close)
    await close() ───────────────────────────── Stop ───► the thread returns
                                   on_events(EventBatch) ◄┤ after every step and call: the
                                                          │ store's block events, numbered
                                                          │ per worker (the router's feed),
                                                          │ with the engine's WorkerRates
                                                          └ idle: expired blocks dropped
                                                            every EXPIRE_EVERY_S

Between two steps the engine thread handles the commands queued at that moment, so a flood
of commands never starves decoding. An engine whose ``step`` raises is broken: every run on
it raises ``WorkerFailed`` (the caller retries elsewhere, ``cluster.backend.retry``) and the
engine is dropped. Once the engine thread ends (``close``, or a bug that escapes a command,
such as an ``on_events`` that raises), every run and call, those waiting and those after,
raises ``WorkerFailed`` saying why: no caller waits on a thread that is gone. Whoever consumes
a run and stops before its ``Finished`` (a cancelled stream, a deadline, a cancelled job)
aborts the request in the engine: cancelled work stops within one step.

The runtime keeps each engine's served counts (``WorkerStats``); the written tokens are the
store's own count (``Engine.written_tokens``), aborted requests' blocks included. The messages
that cross into and out of the engine thread are ``workers.engine.channel``'s.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from router.kv.events import EventBatch
from workers.cache.disk_tier import DiskStats
from workers.engine.channel import (Abort, Aborted, Answer, Answered, Call, Command, Failed,
                                    Finished, Holdings, Open, Reply, Retire, Sink, Stop, Submit)
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sequence import TokenDelta
from workers.messages import DiskTierStats, GenerateRequest, WorkerFailed, WorkerStats

__all__ = ["EXPIRE_EVERY_S", "IDLE_WAIT_S", "Aborted", "EngineRuntime", "Finished", "Holdings"]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05     # how long an idle engine thread waits for a command
EXPIRE_EVERY_S = 1.0   # how often idle engines drop expired blocks (and say so)


@dataclass(slots=True)
class _Slot:
    """One engine and what the engine thread keeps about it (engine thread only)."""

    engine: Engine
    seq: int = 0                  # last event batch published
    input_tokens: int = 0
    cached_tokens: int = 0
    served: int = 0
    runs: dict[str, Sink] = field(default_factory=dict)   # request id -> its sink


class EngineRuntime:
    """Engines on one thread; ``on_events`` hears every block event batch (engine thread)."""

    def __init__(self, on_events: Callable[[EventBatch], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "orchard-engines",
                 idle_wait_s: float = IDLE_WAIT_S) -> None:
        self._on_events = on_events
        self._clock = clock
        self._idle_wait_s = idle_wait_s  # an idle thread's wait for a command (busy: none)
        self._commands: queue.Queue[Command] = queue.Queue()       # any thread -> engine thread
        self._slots: dict[str, _Slot] = {}                          # engine thread only
        self._where: dict[str, str] = {}                            # engine thread: rid -> worker
        self._ended: str | None = None   # why the engine thread ended; set once, by that thread
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- the caller's side (any event loop) ----------------------------------------------

    async def open(self, worker_id: str, model_dir: str, config: EngineConfig,
                   clock: Callable[[], float] = time.monotonic) -> Engine:
        """Load ``worker_id``'s engine on the engine thread (``config`` with its
        ``worker_id``); returns it (read only its model facts)."""
        config = dataclasses.replace(config, worker_id=worker_id)
        return await self._ask(lambda reply: Open(worker_id, model_dir, config, clock, reply))

    async def call(self, worker_id: str, fn: Callable[[Engine], object]):
        """``fn(engine)`` on the engine thread; its block events are published after it."""
        return await self._ask(lambda reply: Call(worker_id, fn, reply))

    async def run(self, worker_id: str, request: GenerateRequest
                  ) -> AsyncIterator[TokenDelta | Finished]:
        """Run ``request``: its ``TokenDelta``s, then one ``Finished``.

        ``ValueError`` when the engine refuses it, ``WorkerFailed`` when the engine breaks.
        Closed (or cancelled) before ``Finished``, the request is aborted in the engine; a run
        aborted through ``abort`` just ends.
        """
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self._send(Submit(worker_id, request,
                          lambda item: loop.call_soon_threadsafe(items.put_nowait, item)))
        settled = False
        try:
            while True:
                match await items.get():
                    case TokenDelta() as delta:
                        yield delta
                    case Finished() as finished:
                        settled = True
                        yield finished
                        return
                    case Aborted():
                        settled = True
                        return
                    case Failed(error):
                        settled = True
                        raise error
                    case other:
                        raise RuntimeError(f"run {request.request_id}: {other!r} is no RunEvent")
        finally:
            if not settled:
                self._send(Abort(request.request_id))

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` wherever it runs: it leaves its batch at the next step."""
        self._send(Abort(request_id))

    def retire(self, worker_id: str) -> None:
        """Drop ``worker_id``'s engine; requests still on it raise ``WorkerFailed``."""
        self._send(Retire(worker_id))

    async def stats(self, worker_id: str) -> WorkerStats:
        return await self.call(worker_id, lambda _: self._stats(self._slots[worker_id]))

    async def holdings(self, worker_id: str) -> Holdings:
        """What the worker holds, with the sequence number of the last batch included."""
        return await self.call(worker_id, lambda _: self._holdings(worker_id))

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs: once it ended, nothing is answered but
        ``WorkerFailed`` (a worker whose runtime is not alive must be replaced)."""
        return self._thread.is_alive()

    async def close(self) -> None:
        if self._thread.is_alive():
            self._commands.put(Stop())
            await asyncio.to_thread(self._thread.join)

    async def _ask(self, command: Callable[[Reply], Command]):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._send(command(lambda answer: loop.call_soon_threadsafe(_settle, future, answer)))
        return await future

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        if self._ended is not None:  # nobody reads the queue any more: refuse it here
            self._refuse_queued(self._ended)

    # ---- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        why = "the engine runtime was closed"
        try:
            self._serve()
        except Exception as exc:  # a bug: fail every caller now rather than leave them waiting
            log.exception("the engine thread failed")
            why = f"the engine thread failed: {exc!r}"
        finally:
            self._ended = why   # callers refuse what they send from now on; this refuses the rest
            try:
                for worker_id in list(self._slots):
                    self._drop(worker_id, why)
            finally:
                self._refuse_queued(why)

    def _refuse_queued(self, why: str) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case Open(reply=reply) | Call(reply=reply):
                    reply(Failed(WorkerFailed(why)))
                case Submit(sink=sink):
                    sink(Failed(WorkerFailed(why)))

    def _serve(self) -> None:
        expired_at = self._clock()
        while True:
            busy = any(s.engine.busy for s in self._slots.values())
            try:
                command = self._commands.get(timeout=0 if busy else self._idle_wait_s)
            except queue.Empty:
                command = None
            # The commands queued now, then one step of every busy engine: requests submitted
            # together start in one batch, and no stream of commands starves the steps.
            behind = self._commands.qsize()
            while command is not None:
                if isinstance(command, Stop):
                    return  # ``_loop`` drops the engines: their runs raise ``WorkerFailed``
                self._command(command)
                command = self._next_queued() if behind > 0 else None
                behind -= 1
            if any(s.engine.busy for s in self._slots.values()):
                for worker_id, slot in list(self._slots.items()):
                    if slot.engine.busy:
                        self._step(worker_id, slot)
            elif self._clock() - expired_at >= EXPIRE_EVERY_S:
                expired_at = self._clock()
                for worker_id, slot in self._slots.items():
                    if slot.engine.expire():
                        self._publish(worker_id, slot)

    def _next_queued(self) -> Command | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _command(self, command: Command) -> None:
        match command:
            case Submit():
                self._submit(command)
            case Abort(request_id):
                self._abort(request_id)
            case Call(worker_id, fn, reply):
                slot = self._slots.get(worker_id)
                if slot is None:
                    reply(Failed(_no_engine(worker_id)))
                    return
                _answer(reply, lambda: fn(slot.engine))
                self._publish(worker_id, slot)
            case Open(reply=reply):
                _answer(reply, lambda: self._open(command))
            case Retire(worker_id):
                self._drop(worker_id, f"worker {worker_id} left mid-request")

    def _open(self, command: Open) -> Engine:
        slot = self._slots.get(command.worker_id)
        if slot is None:
            engine = Engine.open(command.model_dir, command.config, clock=command.clock)
            slot = self._slots[command.worker_id] = _Slot(engine)
        return slot.engine

    def _submit(self, command: Submit) -> None:
        slot = self._slots.get(command.worker_id)
        if slot is None:
            command.sink(Failed(_no_engine(command.worker_id)))
            return
        try:
            slot.engine.submit(command.request)
        except Exception as exc:  # refused (ValueError), or a bug: this run fails, not the thread
            command.sink(Failed(exc))
            return
        rid = command.request.request_id
        slot.runs[rid] = command.sink
        self._where[rid] = command.worker_id

    def _abort(self, request_id: str) -> None:
        worker_id = self._where.pop(request_id, None)
        slot = self._slots.get(worker_id) if worker_id is not None else None
        if slot is None:
            return  # finished (or never started) meanwhile: nothing to stop
        slot.engine.abort(request_id)
        sink = slot.runs.pop(request_id, None)
        if sink is not None:
            sink(Aborted(request_id))

    def _step(self, worker_id: str, slot: _Slot) -> None:
        try:
            out = slot.engine.step()
        except Exception as exc:  # the engine is broken: its requests fail over, it leaves
            log.exception("worker %s: engine step failed", worker_id)
            self._drop(worker_id, f"worker {worker_id} failed: {exc!r}")
            return
        self._publish(worker_id, slot)
        for delta in out.deltas:
            sink = slot.runs.get(delta.request_id)
            if sink is not None:
                sink(delta)
        done_ns = time.time_ns()  # after the step's cache writes: the worker's time ends here
        for result in out.finished:
            slot.input_tokens += result.input_tokens
            slot.cached_tokens += result.cached_tokens
            slot.served += 1
            self._where.pop(result.request_id, None)
            sink = slot.runs.pop(result.request_id, None)
            if sink is not None:
                sink(Finished(result, (done_ns - result.timings.received_ns) / 1e9))

    def _drop(self, worker_id: str, why: str) -> None:
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return
        for rid, sink in slot.runs.items():
            self._where.pop(rid, None)
            sink(Failed(WorkerFailed(why)))
        try:  # the memory tier goes to the disk tier, so a restarted worker keeps it
            slot.engine.close()
        except OSError:  # a full or failing disk loses the cache, never the shutdown
            log.exception("worker %s: persisting its prefix store at shutdown failed", worker_id)

    def _publish(self, worker_id: str, slot: _Slot) -> None:
        events = slot.engine.drain_events()
        if events and self._on_events is not None:
            slot.seq += 1
            self._on_events(EventBatch(worker_id, slot.seq, tuple(events),
                                       slot.engine.rates()))

    def _holdings(self, worker_id: str) -> Holdings:
        slot = self._slots[worker_id]
        self._publish(worker_id, slot)  # the batches before ``seq`` hold nothing it lacks
        return Holdings.of(slot.seq, slot.engine.holdings())

    def _stats(self, slot: _Slot) -> WorkerStats:
        s = slot.engine.store_stats()
        return WorkerStats(len(slot.runs), s.tensor_bytes, s.ledger.capacity_bytes,
                           s.ledger.blocks, slot.engine.written_tokens(), slot.input_tokens,
                           slot.cached_tokens, slot.served, s.ledger.evictions,
                           s.ledger.expirations, _disk_stats(s.disk))


def _no_engine(worker_id: str) -> WorkerFailed:
    return WorkerFailed(f"worker {worker_id} has no engine (not started, broken or retired)")


def _disk_stats(d: DiskStats | None) -> DiskTierStats | None:
    if d is None:
        return None
    return DiskTierStats(d.ledger.blocks, d.ledger.bytes, d.ledger.capacity_bytes, d.free_bytes,
                         d.corrupt, d.start.torn, d.start.outdated, d.full, d.ledger.evictions)


def _answer(reply: Reply, fn: Callable[[], object]) -> None:
    try:
        value = fn()
    except Exception as exc:  # handed to the awaiting caller, which raises it
        reply(Failed(exc))
    else:
        reply(Answered(value))


def _settle(future: asyncio.Future, answer: Answer) -> None:
    if future.done():
        return
    match answer:
        case Answered(value):
            future.set_result(value)
        case Failed(error):
            future.set_exception(error)
