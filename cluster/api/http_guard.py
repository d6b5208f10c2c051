"""The HTTP API's guards against clients that send too much, or too slowly, or too often.

Measured before them: a 256 MiB JSON body took 25.8 s to refuse and grew the frontend by
1.5 GB; 100 TLS connections sending one header line every 10 s were all still open after 80 s
(each holds a file descriptor, which the gRPC server draws from too). Two layers, each
enforcing what it can see, with the limits of ``[http]`` (``HttpLimits``):

    the connection: ``GuardedH11Protocol`` (uvicorn's h11 protocol, two additions)
        max_connections_per_client  a connection from an address that already holds this
                                    many is answered 429 and closed before a byte is read
        header_timeout_s            the request head (request line and headers) must be whole
                                    this long after the connection opened, or after the
                                    previous response ended: per head, not per byte, so a
                                    header line every few seconds is cut at the deadline.
                                    A partial head is answered 408; a connection that sent
                                    nothing is closed without an answer (a keep-alive client
                                    could take a stray answer for its next request's)
    the request: ``RequestGuard`` (ASGI middleware around the app)
        max_body_bytes              a ``Content-Length`` above the cap is answered 413 before
                                    a byte of the body is read; a chunked body, as soon as
                                    the cap is passed (``body_caps`` set a path's own cap,
                                    the Files API's 200 MiB)
        body_timeout_s              the longest wait for the next piece of a body the app is
                                    reading: 408
        a response that starts before the body was read whole closes the connection, so the
        rest of a refused body is never read (uvicorn would otherwise read and drop it)

A TLS handshake happens before the protocol sees the connection; asyncio bounds it (60 s).
Errors are answered through ``cluster.api.http_errors`` like any other.
"""
from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cluster.api.http_errors import BodyTooLarge, SlowClient, error_parts, error_response
from cluster.jobs.admission import Overloaded

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

CLOSE = (b"connection", b"close")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """``[http]``'s limits, as plain values (``cluster.config.HttpConfig`` documents them)."""

    max_body_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections_per_client: int


@dataclass(frozen=True, slots=True)
class BodyCap:
    max_bytes: int
    source: str   # where the limit comes from, as the error names it
    advice: str   # what the caller should do instead


# ------------------------------------------------------------------ the connection

class ConnectionGuard:
    """Open connections per client address, against a cap. Used on the event loop only."""

    def __init__(self, max_per_client: int, header_timeout_s: float):
        self.max_per_client = max_per_client
        self.header_timeout_s = header_timeout_s
        self._open: dict[str, int] = {}

    def admit(self, address: str) -> bool:
        if self._open.get(address, 0) >= self.max_per_client:
            return False
        self._open[address] = self._open.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        left = self._open[address] - 1
        if left:
            self._open[address] = left
        else:
            del self._open[address]

    def open(self, address: str) -> int:
        return self._open.get(address, 0)


LINGER_S = 2.0  # how long an answered connection drains its client's input before closing


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a per-client connection cap and a request-head deadline.

    The deadline is armed when the connection opens and when a response ends with the next
    request's head still to come (h11's ``their_state`` is ``IDLE`` until a head is whole),
    and disarmed once a head has been parsed."""

    def __init__(self, config, server_state, app_state, _loop=None, *, guard: ConnectionGuard):
        super().__init__(config, server_state, app_state, _loop)
        self._guard = guard
        self._address: str | None = None  # counted against its client's cap while set
        self._head_deadline: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None  # answered: closing (see below)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        if not self._guard.admit(address):
            self._answer_and_close(Overloaded(
                f"connections: {self._guard.max_per_client} already open from {address} "
                "([http] max_connections_per_client); reuse them, or retry when one closes"))
            return
        self._address = address
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_received()
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        if self._address is not None:
            self._guard.release(self._address)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # answered and closing: what the client still sends is read and dropped
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()

    def _await_head(self) -> None:
        self._head_received()
        self._head_deadline = self.loop.call_later(self._guard.header_timeout_s,
                                                   self._head_too_slow)

    def _head_received(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if not self.conn.trailing_data[0]:  # nothing of a next request: just close
            self.transport.close()
            return
        self._answer_and_close(SlowClient(
            f"request head: not whole within {self._guard.header_timeout_s:g} s "
            "([http] header_timeout_s); send the request line and headers at once"))

    def _answer_and_close(self, exc: Exception) -> None:
        status, body = error_parts(exc)
        payload = json.dumps(body).encode()
        head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + payload)
        self._linger()

    def _linger(self) -> None:
        """Close without losing the answer: a socket closed with unread input sends a reset,
        and a client still sending (a dribbled head) would have its kernel drop the answer
        before it is read. So the write side is shut (the client reads the answer, then the
        end), what still arrives is read and dropped, and the socket closes ``LINGER_S``
        later or when the client closes first."""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)


# --------------------------------------------------------------------- the request

class RequestGuard:
    """ASGI middleware: the body's size cap (``default``, or a path's own in ``by_path``) and
    the wait for each piece of it."""

    def __init__(self, app: App, default: BodyCap, body_timeout_s: float,
                 by_path: Mapping[str, BodyCap]):
        self._app = app
        self._default = default
        self._body_timeout_s = body_timeout_s
        self._by_path = dict(by_path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # h11 has checked Content-Length and framing
        length = headers.get(b"content-length")
        declared = None if length is None else int(length)
        expected = b"transfer-encoding" in headers or bool(declared)
        body = _Body(receive, self._by_path.get(scope["path"], self._default),
                     self._body_timeout_s, expected)

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and body.unread:
                message = {**message, "headers": [*message.get("headers", ()), CLOSE]}
            await send(message)

        if declared is not None and declared > body.cap.max_bytes:
            await error_response(body.too_large(declared))(
                scope, body.receive, send_closing)
            return
        await self._app(scope, body.receive, send_closing)


class _Body:
    """One request's ``receive``, counting and timing the pieces of its body."""

    def __init__(self, receive: Receive, cap: BodyCap, timeout_s: float, expected: bool):
        self._receive = receive
        self.cap = cap
        self._timeout_s = timeout_s
        self.unread = expected  # until the body's last piece has been received
        self._received = 0

    async def receive(self) -> Message:
        if not self.unread:  # no body, or all of it: e.g. a streamed response's disconnect
            return await self._receive()
        try:
            async with asyncio.timeout(self._timeout_s):
                message = await self._receive()
        except TimeoutError:
            raise SlowClient(f"body: nothing received for {self._timeout_s:g} s ([http] "
                             "body_timeout_s); send the body without pauses") from None
        if message["type"] != "http.request":  # the client went away: nothing more comes
            self.unread = False
            return message
        self._received += len(message.get("body", b""))
        if self._received > self.cap.max_bytes:
            raise self.too_large(None)
        self.unread = message.get("more_body", False)
        return message

    def too_large(self, declared: int | None) -> BodyTooLarge:
        """The refusal: of a declared length, or of a body that has passed the cap."""
        size = "more than" if declared is None else f"{declared} bytes exceed"
        return BodyTooLarge("body", f"{size} the limit of {self.cap.max_bytes} bytes "
                            f"({self.cap.source}); {self.cap.advice}")
