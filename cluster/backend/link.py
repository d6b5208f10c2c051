"""The token data path: one persistent, multiplexed stream between the frontend and a worker.

Ray stays the control plane (placement, start, health, drain, stats, the block event feed);
requests and their tokens go over a TCP stream of ``cluster.backend.wire`` frames that the
worker actor serves on its node's address (loopback on a single machine), because a Ray call
on this path costs more than the whole budget (an actor call about 1.2 ms, a streaming
generator about 3 ms, against about 0.07 ms for a round trip on an open stream)::

    frontend (WorkerLink)                              worker actor (LinkServer)
    ─────────────────────                              ─────────────────────────
    connect ──────────────────── TCP ───────────────► nonce
            ◄─────────────────────────────────────────
            HMAC(secret, nonce) ─────────────────────► checked, else closed
    stream(request) ── GENERATE sid ─────────────────► task: EngineWorker.generate
          yields    ◄─ ITEM sid: TokenChunk/Prefilled ┤
          returns   ◄─ ITEM sid: WorkerDone ──────────┤ (block events piggybacked)
          raises    ◄─ ERROR sid: refused / failed ───┘
    closed early ───── ABORT sid ────────────────────► task cancelled: engine.abort
    connection lost ──► every open stream raises WorkerFailed; the server cancels them all

Streams are numbered by the frontend, so many requests share the connection. The secret is
made by the frontend's pool and handed to the worker through Ray (``EngineWorker.listen``).
A connection whose first frame is PULL, after the same authentication, is another worker
pulling this one's blocks (``cluster.backend.pull``): it serves that transfer, then closes.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import AsyncIterator, Callable

from cluster.backend import wire
from cluster.backend.protocol import TokenChunk
from cluster.backend.pull import PullServer
from cluster.backend.wire import ErrorKind, Kind, Prefilled, PullPlan, WorkerDone
from workers.messages import GenerateRequest, WorkerFailed

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
_LOST = object()   # put on every open stream's queue when the connection is gone

Items = AsyncIterator[TokenChunk | Prefilled | WorkerDone]
Generate = Callable[[GenerateRequest, int, bool, str, PullPlan | None], Items]


class LinkServer:
    """The worker side: serves ``generate(request, feed_after, chunks, router_id, pull)`` to
    authenticated frontends, one task per stream (``router_id``: the calling frontend's
    router, whose results carry its block events), and its blocks to authenticated peers
    (a connection that starts with PULL, ``cluster.backend.pull``)."""

    def __init__(self, generate: Generate, secret: bytes, pulls: PullServer | None = None
                 ) -> None:
        self._generate = generate
        self._secret = secret
        self._pulls = pulls
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str) -> int:
        """Listen on ``host`` (the node's own address); returns the port."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(asyncio.current_task())
        streams: dict[int, asyncio.Task] = {}
        try:
            nonce = wire.new_nonce()
            writer.write(nonce)
            if not wire.accepts(self._secret, nonce, await asyncio.wait_for(
                    reader.readexactly(wire.ANSWER_BYTES), CONNECT_TIMEOUT_S)):
                log.warning("link: a peer at %s failed authentication",
                            writer.get_extra_info("peername"))
                return
            while True:
                kind, sid, body = await wire.read_frame(reader)
                if kind == Kind.PULL and not streams and self._pulls is not None:
                    await self._pulls.serve(reader, writer, body,
                                            writer.get_extra_info("peername"))
                    return
                if kind == Kind.GENERATE:
                    request, feed_after, chunks, router_id, pull = body
                    task = asyncio.create_task(self._stream(writer, sid, request, feed_after,
                                                            chunks, router_id, pull))
                    streams[sid] = task
                    task.add_done_callback(lambda _, sid=sid: streams.pop(sid, None))
                elif kind == Kind.ABORT and sid in streams:
                    streams[sid].cancel()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as exc:
            log.info("link: connection closed (%s)", exc or type(exc).__name__)
        finally:
            for task in list(streams.values()):
                task.cancel()   # each aborts its request in the engine
            await asyncio.gather(*streams.values(), return_exceptions=True)
            writer.close()
            self._connections.discard(asyncio.current_task())

    async def _stream(self, writer: asyncio.StreamWriter, sid: int, request: GenerateRequest,
                      feed_after: int, chunks: bool, router_id: str,
                      pull: PullPlan | None) -> None:
        try:
            async with contextlib.aclosing(self._generate(request, feed_after, chunks,
                                                          router_id, pull)) as items:
                async for item in items:
                    writer.write(wire.frame(Kind.ITEM, sid, item))
                    await writer.drain()
        except ValueError as exc:
            writer.write(wire.frame(Kind.ERROR, sid, [int(ErrorKind.REFUSED), str(exc)]))
        except WorkerFailed as exc:
            writer.write(wire.frame(Kind.ERROR, sid, [int(ErrorKind.FAILED), str(exc)]))
        except ConnectionError:
            return   # the frontend is gone: ``_serve`` notices and cancels the rest
        except Exception as exc:  # the caller raises it; the worker keeps serving
            log.exception("link: request %s failed", request.request_id)
            writer.write(wire.frame(Kind.ERROR, sid, [int(ErrorKind.OTHER),
                                                      f"{type(exc).__name__}: {exc}"]))


class WorkerLink:
    """The frontend side: one connection to one worker, shared by all its requests;
    ``router_id`` names the frontend's router to the worker."""

    def __init__(self, worker_id: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, router_id: str = "") -> None:
        self._worker_id = worker_id
        self.router_id = router_id
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}
        self._lost: str | None = None
        self._reading = asyncio.create_task(self._read(), name=f"link-{worker_id}")

    @classmethod
    async def connect(cls, worker_id: str, host: str, port: int, secret: bytes,
                      router_id: str = "") -> WorkerLink:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                CONNECT_TIMEOUT_S)
        nonce = await asyncio.wait_for(reader.readexactly(wire.NONCE_BYTES), CONNECT_TIMEOUT_S)
        writer.write(wire.answer(secret, nonce))
        return cls(worker_id, reader, writer, router_id)

    async def stream(self, request: GenerateRequest, feed_after: int, chunks: bool,
                     pull: PullPlan | None = None) -> Items:
        """The worker's items for ``request`` (its prefix first pulled from a peer as ``pull``
        says, when given), its ``WorkerDone`` last. ``ValueError`` when
        the engine refused it, ``WorkerFailed`` when the worker broke or the link is lost.
        Closed before the ``WorkerDone``, the request is aborted on the worker."""
        if self._lost is not None:
            raise WorkerFailed(f"worker {self._worker_id}: {self._lost}")
        sid = next(self._ids)
        queue = self._streams[sid] = asyncio.Queue()
        settled = False
        try:
            self._writer.write(wire.frame(Kind.GENERATE, sid, [request, feed_after, chunks,
                                                               self.router_id, pull]))
            while True:
                kind, body = await queue.get()
                if kind is _LOST:
                    settled = True
                    raise WorkerFailed(f"worker {self._worker_id}: {self._lost}")
                if kind == Kind.ERROR:
                    settled = True
                    raise _error(self._worker_id, *body)
                if isinstance(body, WorkerDone):
                    settled = True
                    yield body
                    return
                yield body
        finally:
            del self._streams[sid]
            if not settled and self._lost is None:
                self._writer.write(wire.frame(Kind.ABORT, sid))  # out at its next step

    async def close(self) -> None:
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)
        self._writer.close()

    async def _read(self) -> None:
        try:
            while True:
                kind, sid, body = await wire.read_frame(self._reader)
                queue = self._streams.get(sid)
                if queue is not None:  # else: a stream its caller closed meanwhile
                    queue.put_nowait((kind, body))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._lose(f"its stream closed ({type(exc).__name__})")
        except asyncio.CancelledError:
            self._lose("its stream was closed by the frontend")
            raise

    def _lose(self, why: str) -> None:
        self._lost = why
        for queue in self._streams.values():
            queue.put_nowait((_LOST, None))


def _error(worker_id: str, kind: int, message: str) -> Exception:
    if kind == ErrorKind.REFUSED:
        return ValueError(message)
    if kind == ErrorKind.FAILED:
        return WorkerFailed(message)
    return RuntimeError(f"worker {worker_id}: {message}")
