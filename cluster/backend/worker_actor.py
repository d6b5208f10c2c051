"""The worker actor: a thin Ray shell around one engine on a ``workers.engine.runtime.EngineRuntime``.

``EngineWorker`` is a plain class (usable without Ray); ``WorkerActor`` is its one-line async
Ray actor. The runtime drives the engine on its own thread; the actor's event loop only hands
it work and relays what comes back. Requests reach ``generate`` over the frontend's own stream
(``listen``, ``cluster.backend.link``), not over Ray calls; everything else is a Ray call::

    actor event loop                               engine thread (workers.engine.runtime)
    ────────────────                               ─────────────
    generate(request, feed_after) ─ runtime.run ──► engine.submit, then step() while busy
      yields TokenChunk (or one Prefilled) ◄ TokenDelta ┤
      yields WorkerDone(result, events) ◄─── Finished ──┤
      closed early ──────────────────────── Abort ─────► engine.abort: out at the next step
    abort(request_id) ───────────────────── Abort ─────► the same, asked for by the caller
    outbox of EventBatch ◄──────────── on_events ──────┘ block events after every step
      (the newest one sent also carries the worker's measured links, ``link_meter``)
      ├─ piggybacked on WorkerDone: the batches after the caller's ``feed_after``
      └─ events(after): a streaming feed (evictions and TTL expiry between requests),
         and a ``FeedHeartbeat`` (the last batch's number) once the worker is quiet
    stats / invalidate / holdings ── runtime.call ─► run on the engine thread
    attach(secret): its hello and where it listens, for another frontend's stream

Every batch has a per-worker sequence number, so each frontend's router applies each once, in
order, and notices a gap (then rebuilds from ``holdings``, which say up to which batch they
reach). A gap shows when a later batch arrives; a router that lost the very last one (a result
that carried it never applied: its caller went away) learns of it from the heartbeat every
feed sends once no batch was published for ``HEARTBEAT_S``. The frontend reaches the actor
through its handle (``cluster.backend.ray_pool``).

Given ``TelemetrySettings`` the worker sets up its process's telemetry on ``start`` (service
``orchard-worker``, its id and node as resource attributes) and draws each finished request's
spans from the result's ``Timings`` under the context the request carried
(``cluster.telemetry.spans.record_engine``), off the path back: those finished within
``SPANS_AFTER_S`` together, once the results have gone; ``WorkerDone.traced`` tells the caller
not to draw them again.

The module imports ``workers`` first, so the actor's process loads OpenBLAS before MLX.
"""
from __future__ import annotations

import workers  # noqa: F401  (OpenBLAS before mlx, in the actor's process too)

import asyncio
import collections
import contextlib
import hmac
import os
import time
from dataclasses import replace
from typing import AsyncIterator, Callable, Sequence

import ray

from cluster.backend.bootstrap import node_address, node_id
from cluster.backend.handle import WorkerHello, engine_items
from cluster.backend.link import LinkServer
from cluster.backend.link_meter import LinkMeter
from cluster.backend.protocol import TokenChunk
from cluster.backend.pull import EngineBlocks, Pace, PullLog, PullServer, pull as pull_blocks
from cluster.backend.routing import FeedHeartbeat
from cluster.backend.wire import Prefilled, PullOutcome, PullPlan, WorkerDone
from cluster.telemetry import attrs as A
from cluster.telemetry import spans
from cluster.telemetry.setup import (SERVICE_WORKER, Telemetry, TelemetrySettings,
                                     process_settings, process_telemetry)
from router.kv.events import EventBatch
from router.kv.key import Namespace
from workers.engine.channel import Finished, Holdings
from workers.engine.config import EngineConfig
from workers.engine.runtime import EngineRuntime
from workers.messages import GenerateRequest, GenerateResult, WorkerFailed, WorkerStats

__all__ = ["EngineWorker", "Prefilled", "WorkerActor", "WorkerDone", "WorkerFailed",
           "WorkerHello", "WorkerStats"]

OUTBOX_BATCHES = 4096  # event batches kept for callers catching up (older: rebuild instead)
# The feed waits this long after a new batch and then sends only what no result carried
# meanwhile: while requests flow, results carry every batch and the feed stays quiet.
FEED_QUIET_S = 0.25
# A worker that published no batch for this long sends every feed its last batch's number
# (``FeedHeartbeat``): a router that lost that batch rebuilds within about this long plus the
# pool's check (``CHECK_EVERY_S``, 2 s), while a busy worker's next batch shows a gap anyway.
HEARTBEAT_S = 2.0


class QuietWatch:
    """Whether a worker published no batch between one look and the next (its heartbeat
    timer looks every ``HEARTBEAT_S``)."""

    def __init__(self, seq: int = 0) -> None:
        self._seen = seq

    def quiet(self, seq: int) -> bool:
        """``seq``: the last batch published now; True when it was already the last before."""
        was, self._seen = self._seen, seq
        return seq == was


# Finished requests' spans are drawn together this long after the first of them, not as each
# result leaves: drawing them (about 0.3 ms of this process's CPU a request, more under load)
# right after the WorkerDone frame took the CPU from the frontend and the client just as they
# handle the result, the Ray path's critical moment (docs/design-notes.md, the Ray path's
# overhead). The exporter batches them for seconds anyway.
SPANS_AFTER_S = 0.2


class EngineWorker:
    """One engine on a runtime thread, fed by async callers; block events to its feed."""

    def __init__(self, worker_id: str, model_dir: str, config: EngineConfig,
                 clock: Callable[[], float] = time.monotonic,
                 telemetry: TelemetrySettings | None = None,
                 runtime: EngineRuntime | None = None, pace: Pace | None = None,
                 heartbeat_s: float | None = HEARTBEAT_S,
                 spans_after_s: float = SPANS_AFTER_S) -> None:
        """``runtime``: a runtime of the caller's that hosts several workers' engines in one
        process (one engine thread, as MLX wants: ``orchard bench frontends``); its owner
        passes each worker's batches to that worker's ``on_events`` and closes it. Without,
        the worker runs its engine on a runtime of its own (a Ray actor's process). ``pace``:
        the sending side's rate limit on pulls (None: the link's own). ``heartbeat_s``: how
        long without a batch before the feeds' heartbeat (None: only when ``heartbeat`` is
        called). ``spans_after_s``: how long finished requests' spans wait to be drawn
        together (``close`` draws the rest)."""
        self._id = worker_id
        self._shared = runtime
        self._model_dir = model_dir
        self._config = config          # opened with this worker's id (``EngineRuntime.open``)
        self._clock = clock
        self._settings = telemetry
        self._tel: Telemetry | None = None
        self._runtime: EngineRuntime | None = None
        self._hello: WorkerHello | None = None
        self._decode: Callable[[Sequence[int]], str] = str
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: collections.deque[EventBatch] = collections.deque(maxlen=OUTBOX_BATCHES)
        self._fed = asyncio.Event()    # set when a batch enters the outbox or a heartbeat is
                                       # due (actor loop only)
        self._last_seq = 0             # the last batch published
        self._beats = 0                # heartbeats asked for so far
        self._heartbeat_s = heartbeat_s
        self._beater: asyncio.Task | None = None
        # router id -> the last batch a result carried to that router (actor loop only):
        # each frontend's router is fed by its own results and its own feed, so one
        # frontend's results never make another's feed skip a batch
        self._carried: dict[str, int] = {}
        self._link: LinkServer | None = None      # the frontend's request stream (``listen``)
        self._secret = b""                        # its secret, which peers' pulls use too
        self._address = ("", 0)                   # where it listens
        self._pace = pace        # the sending side's rate limit on pulls (None: the link's own)
        self._pull_failures = PullLog()
        self._links = LinkMeter()   # its links from the peers it pulled from (actor loop only)
        # finished requests whose spans are not drawn yet (actor loop only; ``_draw_spans``)
        self._undrawn: list[tuple[GenerateRequest, GenerateResult]] = []
        self._spans_after_s = spans_after_s

    async def start(self) -> WorkerHello:
        """Load the model on the engine thread; idempotent."""
        if self._tel is None:
            self._tel = process_telemetry(process_settings(
                self._settings, SERVICE_WORKER, ((A.WORKER, self._id),), node_address(),
                node_id()))
        if self._runtime is None:
            self._loop = asyncio.get_running_loop()
            self._runtime = self._shared or EngineRuntime(self.on_events, self._clock,
                                                          f"engine-{self._id}")
            if self._heartbeat_s is not None:
                self._beater = self._loop.create_task(self._beat(self._heartbeat_s),
                                                      name=f"heartbeat-{self._id}")
        if self._hello is None:
            engine = await self._runtime.open(self._id, self._model_dir, self._config,
                                              self._clock)
            tokenizer = engine.tokenizer
            self._decode = lambda ids: tokenizer.decode(list(ids))
            self._hello = WorkerHello.here(self._id, node_id(), node_address(), engine.facts)
        return self._hello

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest, feed_after: int | None = None,
                       chunks: bool = True, router_id: str = "",
                       pull: PullPlan | None = None
                       ) -> AsyncIterator[TokenChunk | Prefilled | WorkerDone]:
        """Run ``request``: its ``TokenChunk``s (or one ``Prefilled``), then one ``WorkerDone``.

        ``feed_after``: the last event batch the caller's router (``router_id``: one per
        frontend) applied; the ``WorkerDone`` carries the ones after it. ``pull``: first fill
        the prompt's prefix from that peer (``cluster.backend.pull``; whatever it does not
        bring is computed). Closed before its
        ``WorkerDone``, the request is aborted.
        """
        pulled = await self._pull(request, pull) if pull is not None else None
        if pulled is not None:
            self._links.observe(pulled)
        async with contextlib.aclosing(engine_items(self.runtime, self._id, request,
                                                    chunks)) as items:
            async for item in items:
                if isinstance(item, Finished):
                    yield self._done(request, item, feed_after, router_id, pulled)
                    return
                yield item

    async def _pull(self, request: GenerateRequest, plan: PullPlan) -> PullOutcome:
        if not self._secret:
            raise RuntimeError(f"worker {self._id} pulls only once it listens")
        blocks = EngineBlocks(self.runtime, self._id, self._hello.model.block_size)
        return await pull_blocks(plan, request.namespace, request.prompt, self._secret, blocks,
                                 self._pull_failures)

    async def run(self, request: GenerateRequest, feed_after: int | None = None,
                  router_id: str = "") -> WorkerDone:
        """``generate`` answered once, with the finished request only."""
        async with contextlib.aclosing(self.generate(request, feed_after, False,
                                                     router_id)) as items:
            async for item in items:
                if isinstance(item, WorkerDone):
                    return item
        raise WorkerFailed(f"worker {self._id}: {request.request_id} ended without a result "
                           "(aborted)")

    async def listen(self, secret: bytes, host: str = "") -> tuple[str, int]:
        """Serve ``generate`` to frontends that know ``secret`` on a stream of their own
        (``cluster.backend.link``), on ``host`` ("": this node's address, loopback outside
        Ray); returns (address, port)."""
        if self._link is not None:
            raise RuntimeError(f"worker {self._id} already listens")
        if self._hello is None:
            raise RuntimeError(f"worker {self._id} is not started: call start() first")
        if not host:
            host = node_address()
            host = "127.0.0.1" if host == "local" else host   # outside Ray: loopback
        self._secret = secret
        blocks = EngineBlocks(self.runtime, self._id, self._hello.model.block_size)
        self._link = LinkServer(self.generate, secret, PullServer(blocks, self._pace))
        self._address = (host, await self._link.start(host))
        return self._address

    async def attach(self, secret: bytes) -> tuple[WorkerHello, tuple[str, int]] | None:
        """For a frontend attaching to this worker (``cluster.backend.ray_attach``): its hello
        and where it listens, once it listens (None before: it is still starting).
        ``PermissionError`` unless ``secret`` is the one it listens with."""
        if self._link is None:
            return None
        if not hmac.compare_digest(secret, self._secret):
            raise PermissionError(f"worker {self._id}: not the secret it listens with")
        return self._hello, self._address

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` (the caller gave up on it): it leaves the batch at the next step."""
        self.runtime.abort(request_id)

    # ---- the block event feed ----------------------------------------------------------------

    async def events(self, after: int, router_id: str = ""
                     ) -> AsyncIterator[tuple[EventBatch, ...] | FeedHeartbeat]:
        """The event batches after ``after`` that no result carried to ``router_id``, as they
        come (a Ray streaming generator that lives as long as the caller reads it):
        evictions, TTL expiry and the blocks other frontends' requests stored reach the
        caller's router between its requests. (A router that missed batches all the same,
        past ``OUTBOX_BATCHES``, sees a gap in the sequence and rebuilds from ``holdings``.)
        When it starts, and at each heartbeat, with nothing to send it yields a
        ``FeedHeartbeat`` with the last batch's number, so a router that lost the last batch
        sees that gap too."""
        beats: int | None = None
        while True:
            fed, due = self._fed, self._beats   # what wakes the next pass, and its beats
            batches = self._since(max(after, self._carried.get(router_id, 0)))
            if batches:
                after = batches[-1].seq
                yield batches
            elif beats != due:
                yield FeedHeartbeat(self._last_seq)
            beats = due
            await fed.wait()
            if beats == self._beats:   # woken by a batch: let results carry it first
                await asyncio.sleep(FEED_QUIET_S)

    def heartbeat(self) -> None:
        """Have every feed with nothing to send send the last batch's number (on the
        actor's loop; the worker's timer calls it once quiet for ``heartbeat_s``)."""
        self._beats += 1
        self._wake()

    def on_events(self, batch: EventBatch) -> None:   # the engine thread
        self._loop.call_soon_threadsafe(self._feed, batch)

    def _feed(self, batch: EventBatch) -> None:        # the actor's loop
        self._outbox.append(batch)
        self._last_seq = batch.seq
        self._wake()

    def _wake(self) -> None:
        self._fed.set()
        self._fed = asyncio.Event()

    async def _beat(self, every_s: float) -> None:
        """A heartbeat whenever no batch was published for ``every_s``."""
        watch = QuietWatch(self._last_seq)
        while True:
            await asyncio.sleep(every_s)
            if watch.quiet(self._last_seq):
                self.heartbeat()

    def _since(self, after: int | None) -> tuple[EventBatch, ...]:
        if after is None:
            return ()
        newer = []
        for batch in reversed(self._outbox):
            if batch.seq <= after:
                break
            newer.append(batch)
        links = self._links.report()
        if newer and links:   # the newest batch sent carries the links as they are now
            newer[0] = replace(newer[0], links=links)
        return tuple(reversed(newer))

    # ---- admin ---------------------------------------------------------------------------------

    async def stats(self) -> WorkerStats:
        return await self.runtime.stats(self._id)

    async def invalidate(self, namespace: Namespace | None,
                         prefix_tokens: Sequence[int] | None) -> int:
        """Drop a namespace's blocks, or those under a prompt prefix; returns how many."""
        if namespace is None:
            raise ValueError("namespace: required; invalidation is per tenant namespace")
        return await self.runtime.call(
            self._id, lambda engine: engine.invalidate(namespace, prefix_tokens))

    async def holdings(self) -> Holdings:
        """Every block hash the store holds and the last event batch they include, for a
        router to rebuild its view of this worker."""
        return await self.runtime.holdings(self._id)

    async def ping(self) -> int:
        """Liveness, answered by the actor's event loop (not the engine thread)."""
        return os.getpid()

    async def close(self) -> None:
        """Stop the request stream and the engine thread, then flush and stop telemetry
        (spans not yet exported)."""
        if self._beater is not None:
            self._beater.cancel()
            self._beater = None
        if self._link is not None:
            await self._link.close()
            self._link = None
        if self._runtime is not None:
            if self._shared is None:
                await self._runtime.close()
            else:   # its owner closes it; this worker's engine leaves it
                self._runtime.retire(self._id)
            self._runtime = None
        if self._tel is not None:
            self._draw_spans()   # before the exporter's last flush
            await asyncio.to_thread(self._tel.shutdown)
            self._tel = None

    # ---- internals -----------------------------------------------------------------------------

    @property
    def runtime(self) -> EngineRuntime:
        if self._runtime is None or self._hello is None:
            raise RuntimeError(f"worker {self._id} is not started: call start() first")
        return self._runtime

    def _done(self, request: GenerateRequest, item: Finished, feed_after: int | None,
              router_id: str, pulled: PullOutcome | None) -> WorkerDone:
        events = self._since(feed_after)
        if events:
            self._carried[router_id] = max(self._carried.get(router_id, 0), events[-1].seq)
        traced = bool(request.trace_context) and self._tel is not None and self._tel.enabled
        if traced:  # an untraced request draws no orphan trace; spans after the result
            if not self._undrawn:
                self._loop.call_later(self._spans_after_s, self._draw_spans)
            self._undrawn.append((request, item.result))
        return WorkerDone(item.result, item.worker_s, traced, events, pulled)

    def _draw_spans(self) -> None:
        """The spans of every finished request not drawn yet (``SPANS_AFTER_S``)."""
        undrawn, self._undrawn = self._undrawn, []
        if self._tel is None:
            return
        for request, result in undrawn:
            spans.record_engine(self._tel, request, result, self._decode)


WorkerActor = ray.remote(EngineWorker)
