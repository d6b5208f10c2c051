"""A prefix pulled from a peer worker: the transfer stream between two workers' stores.

The router may send a request to a worker together with a ``PullPlan`` (``wire``): before the
request runs there, the worker (the receiver) fills the prompt's blocks it lacks from the
holder named in the plan, over a direct TCP stream to the holder's ``LinkServer``, with the
request stream's authentication (nonce, HMAC of the cluster secret)::

    receiver (pull)                                   holder (PullServer)
    ───────────────                                   ───────────────────
    begin: the blocks memory lacks, room for them?    (PullRefused: no pull, recompute)
    connect ───────────────────── TCP ──────────────► nonce; HMAC checked, else closed
    PULL [ns, tokens, start, stop, window] ─────────► serve a window (engine thread, between
         ◄──────────────────────── BLOCK i, i+1 ... ┤ steps: the holder's decodes wait at most
    adopt the window: each block checked, stored     │ one window's encoding)
    NEXT ───────────────────────────────────────────►│ the next window
         ◄───────────────────────────────── END n ──┘ (fewer than asked: it lacks the rest)

The receiver holds at most one window of blocks that are not yet in its store. Whatever
happens (refused, corrupted, another model, a truncated stream, a holder gone, a deadline),
``pull`` returns a ``PullOutcome`` and never raises: the blocks stored so far stay, the
request computes the rest, and each kind of failure is logged once per peer.

``WINDOW = 8`` blocks (128 tokens at block 16, 5.9 MB of SmolLM2-135M K/V in float32): small
enough that one window's encoding on the holder's engine thread stays under a decode step
there, large enough that a window's round trip (one NEXT) is a small part of its transfer.
The deadline is ``DEADLINE_FACTOR`` times the router's predicted pull time plus
``DEADLINE_MIN_S``: a link much slower than measured stops the pull, and the request
computes the rest.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Awaitable, Callable, Sequence

from cluster.backend import wire
from cluster.backend.wire import Kind, PullOutcome, PullPlan
from router.kv.key import Namespace
from workers.cache.transfer import Adopted, PullRefused, PullStart
from workers.engine.runtime import EngineRuntime

log = logging.getLogger(__name__)

WINDOW = 8
MAX_WINDOW = 64          # a PULL asking for more per window is refused
DEADLINE_FACTOR = 4.0
DEADLINE_MIN_S = 2.0
READ_TIMEOUT_S = 10.0    # the holder waits this long for the receiver's NEXT

Pace = Callable[[int], Awaitable[None]]   # called with each block's bytes before it is sent


class EngineBlocks:
    """A worker's engine as a transfer reaches it: its ``BlockTransfer`` on the engine
    thread, one command per window (``workers.engine.runtime``)."""

    def __init__(self, runtime: EngineRuntime, worker_id: str, block_size: int) -> None:
        self._runtime = runtime
        self._id = worker_id
        self.block_size = block_size

    async def begin(self, namespace: Namespace, tokens: Sequence[int], blocks: int
                    ) -> PullStart:
        return await self._runtime.call(
            self._id, lambda e: e.transfer.begin(namespace, tokens, blocks))

    async def serve(self, namespace: Namespace, tokens: Sequence[int], start: int, stop: int
                    ) -> list[bytes]:
        return await self._runtime.call(
            self._id, lambda e: e.transfer.serve(namespace, tokens, start, stop))

    async def adopt(self, namespace: Namespace, tokens: Sequence[int], index: int,
                    frames: Sequence[bytes]) -> Adopted:
        return await self._runtime.call(
            self._id, lambda e: e.transfer.adopt(namespace, tokens, index, frames))


class PullLog:
    """Logs each kind of failed pull once per peer (a bad peer fills no log)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def failed(self, peer: str, why: str) -> None:
        # the kind: what was wrong, whichever block it was ("block 3: corrupted in transit")
        kind = re.sub(r"^block \d+: ", "", why).split(":", 1)[0].split(" (", 1)[0]
        if (peer, kind) in self._seen:
            return
        self._seen.add((peer, kind))
        log.warning("pull from %s refused: %s; the request computes the prefix itself",
                    peer, why)


class PullServer:
    """The holder's side: one transfer connection served to its end."""

    def __init__(self, blocks: EngineBlocks, pace: Pace | None = None) -> None:
        self._blocks = blocks
        self._pace = pace

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    body: object, peer: object) -> None:
        try:
            namespace, tokens, start, stop, window = _pull_body(body)
        except ValueError as exc:
            log.warning("pull: a PULL from %s refused: %s", peer, exc)
            return
        i = start
        while i < stop:
            frames = await self._blocks.serve(namespace, tokens, i, min(i + window, stop))
            for n, data in enumerate(frames, start=i):
                if self._pace is not None:
                    await self._pace(len(data))
                writer.write(wire.frame(Kind.BLOCK, n, data))
                await writer.drain()
            i += len(frames)
            if len(frames) < window or i >= stop:
                break
            kind, _, _ = await asyncio.wait_for(wire.read_frame(reader), READ_TIMEOUT_S)
            if kind != Kind.NEXT:
                return
        writer.write(wire.frame(Kind.END, 0, i - start))
        await writer.drain()


def _pull_body(body: object) -> tuple[Namespace, tuple[int, ...], int, int, int]:
    try:
        namespace, tokens, start, stop, window = body   # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError("the body is not [namespace, tokens, start, stop, window]") from None
    if not isinstance(namespace, Namespace):
        raise ValueError("namespace: not a Namespace")
    if not isinstance(tokens, tuple) or not all(isinstance(t, int) for t in tokens):
        raise ValueError("tokens: not a list of token ids")
    if not all(isinstance(v, int) for v in (start, stop, window)) or not 0 <= start <= stop:
        raise ValueError(f"start {start!r}, stop {stop!r}: want 0 <= start <= stop")
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window {window!r}: want 1 to {MAX_WINDOW}")
    return namespace, tokens, start, stop, window


async def pull(plan: PullPlan, namespace: Namespace, tokens: Sequence[int], secret: bytes,
               blocks: EngineBlocks, failures: PullLog, *, window: int = WINDOW,
               clock: Callable[[], float] = time.monotonic) -> PullOutcome:
    """Fill ``tokens``' first ``plan.blocks`` blocks from ``plan.peer``; never raises."""
    began = clock()
    progress = _Progress()
    try:
        where = await blocks.begin(namespace, tokens, plan.blocks)
        if where.start < where.stop:
            deadline = DEADLINE_FACTOR * plan.predicted_s + DEADLINE_MIN_S
            await asyncio.wait_for(_receive(plan, namespace, tokens, secret, blocks, where,
                                            window, progress), deadline)
    except PullRefused as exc:
        progress.refused = str(exc)
    except asyncio.TimeoutError:
        progress.refused = "too slow: the pull's deadline passed"
    except asyncio.IncompleteReadError:
        progress.refused = "truncated: the stream ended before its last block"
    except (ConnectionError, OSError) as exc:
        progress.refused = f"the link failed ({type(exc).__name__}: {exc})"
    if progress.refused:
        failures.failed(plan.peer, progress.refused)
    return PullOutcome(plan.peer, progress.stored, progress.stored * blocks.block_size,
                       progress.nbytes, clock() - began, progress.refused)


class _Progress:
    def __init__(self) -> None:
        self.stored = 0
        self.nbytes = 0
        self.refused = ""


async def _receive(plan: PullPlan, namespace: Namespace, tokens: Sequence[int], secret: bytes,
                   blocks: EngineBlocks, where: PullStart, window: int, progress: _Progress
                   ) -> None:
    reader, writer = await asyncio.open_connection(plan.host, plan.port)
    try:
        writer.write(wire.answer(secret, await reader.readexactly(wire.NONCE_BYTES)))
        prefix = tuple(tokens[:where.stop * blocks.block_size])
        writer.write(wire.frame(Kind.PULL, 0, [namespace, prefix, where.start, where.stop,
                                               window]))
        index, pending = where.start, []
        while True:
            kind, sid, body = await wire.read_frame(reader)
            if kind == Kind.END:
                break
            if kind != Kind.BLOCK or not isinstance(body, bytes):
                raise PullRefused(f"a {kind.name} frame where a block was expected")
            if sid != index + len(pending):
                raise PullRefused(f"block {sid} sent where block {index + len(pending)} was due")
            pending.append(body)
            progress.nbytes += len(body)
            if len(pending) == window:
                await _keep(blocks, namespace, prefix, index, pending, progress)
                index, pending = index + len(pending), []
                if index < where.stop:
                    writer.write(wire.frame(Kind.NEXT, 0))
        if pending:
            await _keep(blocks, namespace, prefix, index, pending, progress)
    finally:
        writer.close()


async def _keep(blocks: EngineBlocks, namespace: Namespace, prefix: tuple[int, ...], index: int,
                pending: list[bytes], progress: _Progress) -> None:
    adopted = await blocks.adopt(namespace, prefix, index, pending)
    progress.stored += adopted.stored
    if adopted.refused:
        raise PullRefused(adopted.refused)
