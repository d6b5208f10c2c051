"""The HTTP API's connection and request guards (``cluster.api.http_guard``) against raw clients.

A small Starlette app served by ``start_http`` on loopback, the way the frontend serves its own,
with timeouts of a few tenths of a second. Clients are raw asyncio streams that send exactly the
bytes a test names, dribble them, or stop; each test asserts the answer and that the server
closed the connection, within bounds many times the configured timeouts (a bound that runs out
fails the test naming what it waited for; no sleep's length decides a result).

Last, the frontend's own caps end to end (a real frontend over a LocalBackend, raw
``http.client`` requests): a body or an upload declared over its cap refused 413 unread.
"""
import asyncio
import json
import ssl

import h11
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.bounded import run_bounded
from cluster.api.http_app import start_http
from cluster.api.http_errors import openai_errors
from cluster.api.http_guard import BodyCap, HttpLimits, RequestGuard
from cluster.tls import TlsFiles, init_tls
from tests.support.http_api import (BODY_CAP, CHAT, INPUT_CONFIG, PROMPT_CAP, chat,
                                    connection, http_frontend, refused)

CAP = 1024
TIMEOUT_S = 0.3
BOUND_S = 20.0   # the longest any answer or close may take: many times TIMEOUT_S
LIMITS = HttpLimits(max_body_bytes=CAP, header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S,
                    max_connections_per_client=64)
HEAD = b"POST /echo HTTP/1.1\r\nhost: test\r\n"


def app(calls: list[str]) -> RequestGuard:
    async def echo(request: Request) -> JSONResponse:
        calls.append(request.url.path)
        return JSONResponse({"bytes": len(await request.body())})

    async def ignore(request: Request) -> JSONResponse:  # answers without reading the body
        calls.append(request.url.path)
        return JSONResponse({"read": False})

    routes = [Route("/echo", openai_errors(echo), methods=["POST"]),
              Route("/upload", openai_errors(echo), methods=["POST"]),
              Route("/ignore", openai_errors(ignore), methods=["POST"])]
    return RequestGuard(Starlette(routes=routes),
                        BodyCap(CAP, "[http] max_body_bytes", "send a smaller request"),
                        LIMITS.body_timeout_s,
                        {"/upload": BodyCap(4 * CAP, "an upload's own", "split it")})


def serve(scenario, limits: HttpLimits = LIMITS, tls: TlsFiles | None = None):
    """Run ``scenario(port, calls)`` against a served ``app``, bounded."""
    async def main():
        calls: list[str] = []
        server = await start_http(app(calls), "127.0.0.1", 0, tls, limits)
        try:
            return await scenario(server.port, calls)
        finally:
            await server.stop(0.1)
    return run_bounded(main(), 4 * BOUND_S, "an HTTP guard scenario")


class Response:
    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    @property
    def error(self) -> dict:
        return json.loads(self.body)["error"]


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One HTTP response read off ``reader`` (h11 parses it), within ``BOUND_S``."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "t")]))  # to expect one
    conn.send(h11.EndOfMessage())
    head, body = None, b""
    async with asyncio.timeout(BOUND_S):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Response(head.status_code, dict(head.headers), body)


async def closed(reader: asyncio.StreamReader) -> bytes:
    """What the server still sends before it closes the connection (within ``BOUND_S``)."""
    async with asyncio.timeout(BOUND_S):
        return await reader.read()


async def dribble(writer: asyncio.StreamWriter, pieces) -> None:
    """Send ``pieces`` one at a time, a twentieth of the timeout apart, until the server closes
    the connection (or the pieces run out)."""
    for piece in pieces:
        writer.write(piece)
        try:
            await writer.drain()
        except OSError:  # reset, or a TLS connection's close
            return
        if writer.is_closing() or writer.transport.is_closing():
            return
        await asyncio.sleep(TIMEOUT_S / 20)


def header_lines():
    n = 0
    while True:
        n += 1
        yield f"x-line-{n}: a\r\n".encode()


def test_a_head_dribbled_a_line_at_a_time_is_answered_408_and_closed():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD)
        sender = asyncio.ensure_future(dribble(writer, header_lines()))
        response = await read_response(reader)
        rest = await closed(reader)
        await sender
        return response, rest, calls

    response, rest, calls = serve(scenario)
    assert response.status == 408 and response.headers[b"connection"] == b"close"
    assert response.error == {
        "message": "request head: not whole within 0.3 s ([http] header_timeout_s); send the "
                   "request line and headers at once",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}
    assert rest == b"" and calls == []


def test_a_connection_that_sends_nothing_is_closed_without_an_answer():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return await closed(reader)

    assert serve(scenario) == b""


def test_the_next_head_on_a_kept_alive_connection_has_the_same_deadline():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b"content-length: 2\r\n\r\nhi")
        first = await read_response(reader)
        writer.write(HEAD)  # the next request's head, never finished
        sender = asyncio.ensure_future(dribble(writer, header_lines()))
        second = await read_response(reader)
        await closed(reader)
        await sender
        return first, second

    first, second = serve(scenario)
    assert (first.status, json.loads(first.body)) == (200, {"bytes": 2})
    assert b"connection" not in first.headers  # kept alive
    assert second.status == 408 and second.error["code"] == "request_timeout"


def test_a_head_dribbled_over_tls_is_cut_at_the_deadline(tmp_path):
    folder = init_tls(tmp_path, [])
    tls = TlsFiles(folder / "server.pem", folder / "server.key", None)
    context = ssl.create_default_context(cafile=str(folder / "ca.pem"))

    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.write(HEAD)
        sender = asyncio.ensure_future(dribble(writer, header_lines()))
        response = await read_response(reader)
        rest = await closed(reader)
        await sender
        return response, rest

    response, rest = serve(scenario, tls=tls)
    assert rest == b""
    assert response.status == 408 and response.error["code"] == "request_timeout"


def test_a_declared_length_over_the_cap_is_refused_413_before_the_body_is_read():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + f"content-length: {CAP + 1}\r\n\r\n".encode())  # and no body
        response = await read_response(reader)
        return response, await closed(reader), calls

    response, rest, calls = serve(scenario)
    assert response.status == 413 and response.headers[b"connection"] == b"close"
    assert response.error == {
        "message": "body: 1025 bytes exceed the limit of 1024 bytes ([http] max_body_bytes); "
                   "send a smaller request",
        "type": "invalid_request_error", "param": "body", "code": "request_too_large"}
    assert rest == b"" and calls == []  # the app never ran


def test_a_chunked_body_is_refused_413_once_past_the_cap():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b"transfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * 100
        writer.write((b"64\r\n" + chunk + b"\r\n") * 11)  # 1100 bytes and no last chunk
        response = await read_response(reader)
        return response, await closed(reader), calls

    response, rest, calls = serve(scenario)
    assert response.status == 413 and response.headers[b"connection"] == b"close"
    assert response.error["message"] == (
        "body: more than the limit of 1024 bytes ([http] max_body_bytes); send a smaller "
        "request")
    assert rest == b"" and calls == ["/echo"]


def test_a_body_at_the_cap_is_read_and_the_connection_kept():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for _ in range(2):  # twice on one connection
            writer.write(HEAD + f"content-length: {CAP}\r\n\r\n".encode() + b"y" * CAP)
            answers.append(await read_response(reader))
        writer.write(b"POST /upload HTTP/1.1\r\nhost: t\r\ncontent-length: 4096\r\n\r\n"
                     + b"z" * 4096)
        answers.append(await read_response(reader))
        return answers

    answers = serve(scenario)
    assert [(a.status, json.loads(a.body)) for a in answers] == [
        (200, {"bytes": CAP}), (200, {"bytes": CAP}), (200, {"bytes": 4 * CAP})]
    assert all(b"connection" not in a.headers for a in answers)


def test_a_path_with_a_cap_of_its_own_names_it():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /upload HTTP/1.1\r\nhost: t\r\ncontent-length: 4097\r\n\r\n")
        return await read_response(reader)

    assert serve(scenario).error["message"] == (
        "body: 4097 bytes exceed the limit of 4096 bytes (an upload's own); split it")


def test_a_body_that_stops_coming_is_answered_408_and_closed():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b"content-length: 100\r\n\r\n" + b"x" * 10)  # then nothing
        response = await read_response(reader)
        return response, await closed(reader)

    response, rest = serve(scenario)
    assert response.status == 408 and response.headers[b"connection"] == b"close"
    assert response.error == {
        "message": "body: nothing received for 0.3 s ([http] body_timeout_s); send the body "
                   "without pauses",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}
    assert rest == b""


def test_an_answer_before_the_body_was_read_closes_the_connection():
    async def scenario(port, calls):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /ignore HTTP/1.1\r\nhost: t\r\ncontent-length: 500\r\n\r\n")
        response = await read_response(reader)
        return response, await closed(reader)

    response, rest = serve(scenario)
    assert (response.status, response.headers[b"connection"]) == (200, b"close")
    assert rest == b""


def test_connections_past_the_per_client_cap_are_answered_429_and_closed():
    limits = HttpLimits(CAP, header_timeout_s=60.0, body_timeout_s=60.0,
                        max_connections_per_client=2)

    async def scenario(port, calls):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        refused = await read_response(reader)
        rest = await closed(reader)
        held[0][1].close()  # one of the two goes: a new connection is served again
        async with asyncio.timeout(BOUND_S):
            while True:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(HEAD + b"content-length: 0\r\n\r\n")
                served = await read_response(reader)
                if served.status != 429:
                    return refused, rest, served
                await closed(reader)

    refused, rest, served = serve(scenario, limits)
    assert refused.status == 429 and refused.headers[b"connection"] == b"close"
    assert refused.error == {
        "message": "connections: 2 already open from 127.0.0.1 ([http] "
                   "max_connections_per_client); reuse them, or retry when one closes",
        "type": "rate_limit_error", "param": None, "code": "resource_exhausted"}
    assert rest == b"" and served.status == 200


@pytest.mark.parametrize("key, value, message", [
    ("max_body_bytes", 0, "[http] max_body_bytes must be >= 1"),
    ("max_connections_per_client", 0, "[http] max_connections_per_client must be >= 1"),
    ("header_timeout_s", 0, "[http] header_timeout_s must be > 0 (seconds)"),
    ("body_timeout_s", -1.5, "[http] body_timeout_s must be > 0 (seconds)"),
])
def test_bad_http_limits_name_the_key(tmp_path, key, value, message):
    from cluster.config import load_config

    (tmp_path / "orchard.toml").write_text(f"[http]\n{key} = {value}\n")
    with pytest.raises(ValueError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{tmp_path / 'orchard.toml'}: {message}"


def test_http_limits_default_to_what_the_docs_say(tmp_path):
    from cluster.config import load_config

    (tmp_path / "orchard.toml").write_text("")
    http = load_config(tmp_path).http
    assert (http.max_body_bytes, http.header_timeout_s, http.body_timeout_s,
            http.max_connections_per_client) == (8 << 20, 10.0, 30.0, 64)


@pytest.fixture(scope="module")
def api_httpinput(tmp_path_factory):
    with http_frontend(tmp_path_factory, INPUT_CONFIG) as harness:
        yield harness


class TestTheFrontendsCaps:
    def test_a_body_over_the_configured_cap_is_refused_413_unread(self, api_httpinput):
        conn = connection(api_httpinput)
        try:
            conn.putrequest("POST", CHAT)
            conn.putheader("authorization", "Bearer key-acme")
            conn.putheader("content-length", str(256 << 20))  # 256 MiB declared, none sent
            conn.endheaders()
            response = conn.getresponse()
            assert (response.status, response.getheader("connection")) == (413, "close")
            assert json.loads(response.read()) == refused(
                413, "body", f"body: {256 << 20} bytes exceed the limit of {BODY_CAP} bytes ([http] "
                "max_body_bytes); send a smaller request", "request_too_large")
        finally:
            conn.close()
        status, answer = chat(api_httpinput, messages=[{"role": "user", "content": "x" * 60_000}])
        assert status == 400  # within the body cap: read, then refused by the prompt's own cap
        assert answer["error"]["message"] == (
            f"body.messages: 60000 bytes of text exceed the limit of {PROMPT_CAP} "
            "([limits] max_prompt_bytes); shorten the prompt")

    def test_an_upload_over_its_own_cap_is_refused_413_unread(self, api_httpinput):
        conn = connection(api_httpinput)
        try:
            conn.putrequest("POST", "/v1/files")
            conn.putheader("authorization", "Bearer key-acme")
            conn.putheader("content-type", "multipart/form-data; boundary=b")
            conn.putheader("content-length", str((200 << 20) + (64 << 10) + 1))
            conn.endheaders()
            response = conn.getresponse()
            assert response.status == 413
            assert json.loads(response.read())["error"]["message"] == (
                f"body: {(200 << 20) + (64 << 10) + 1} bytes exceed the limit of "
                f"{(200 << 20) + (64 << 10)} bytes (a 200 MiB file and its form); split the file")
        finally:
            conn.close()
