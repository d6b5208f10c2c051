"""The OpenAI-compatible HTTP API: a Starlette app served by uvicorn on the frontend's loop.

    GET  /v1/models                        the served model
    POST /v1/chat/completions              chat, streamed (server-sent events) or not
    POST /v1/completions                   text or token-id prompt, streamed or not
    /v1/files, /v1/batches                 the Batch API (cluster.api.http_batches)
    GET  /metrics                          Prometheus, an admin key (cluster.api.http_metrics)
    POST /v1/messages                      Anthropic's Messages API (cluster.api.http_messages)
    /v1/messages/batches                   its Message Batches (cluster.api.http_message_batches)

It is a second edge beside gRPC over the same objects: the same ``Authenticator`` (keys and
tenants, ``Authorization: Bearer``), the same ``Work`` (validation, admission and
backpressure, tracing, dispatch: one trace per request), errors mapped in one place
(``cluster.api.http_errors``). ``start_http`` binds its own port (``[http] port``, 0 picks
one) with the same TLS files as gRPC and runs uvicorn as a task on the running event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import ssl
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.api import openai_shapes as shapes
from cluster.api.openai_stream import StreamedAnswer
from cluster.api.priority import http_priority
from cluster.api.edge import Authenticator
from cluster.api.http_batches import Batches
from cluster.api.http_feed import Feed
from cluster.api.http_message_batches import MessageBatches
from cluster.api.http_messages import MessagesApi
from cluster.api.http_errors import (EXCEPTION_HANDLERS, describe, error_body, json_body,
                                     openai_errors, tenant_of)
from cluster.api.http_guard import (App, BodyCap, ConnectionGuard, GuardedH11Protocol,
                                    HttpLimits, RequestGuard)
from cluster.api.http_metrics import MetricsEndpoint
from cluster.tls import TlsFiles
from cluster.api.validate import FieldError
from cluster.api.work import Work
from cluster.jobs.store import StoredResult


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class HttpApi:
    def __init__(self, auth: Authenticator, work: Work, encode: shapes.Encode,
                 batches: Batches, clock_s: Callable[[], float] = time.time,
                 metrics: MetricsEndpoint | None = None,
                 message_batches: MessageBatches | None = None):
        self._auth = auth
        self._metrics = metrics  # GET /metrics, asking for an admin key; None: not served
        self._work = work
        self._encode = encode
        self._batches = batches
        self._message_batches = message_batches
        self._clock_s = clock_s
        self._model_id = work.model.model_id

    def app(self, limits: HttpLimits) -> RequestGuard:
        """The routes, behind the body's size cap and timeout (``cluster.api.http_guard``)."""
        routes = [Route("/v1/models", openai_errors(self.models), methods=["GET"]),
                  Route("/v1/models/{model_id:path}", openai_errors(self.model),
                        methods=["GET"]),
                  Route(shapes.CHAT, openai_errors(self.chat), methods=["POST"]),
                  Route(shapes.COMPLETIONS, openai_errors(self.completions), methods=["POST"]),
                  *self._batches.routes(), *MessagesApi(self._auth, self._work).routes(),
                  *(self._message_batches.routes() if self._message_batches else ())]
        if self._metrics is not None:
            routes.append(self._metrics.route(self._auth))
        json_cap = BodyCap(limits.max_body_bytes, "[http] max_body_bytes",
                           "send a smaller request")
        return RequestGuard(Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS),
                            json_cap, limits.body_timeout_s, self._batches.body_caps())

    def _model_card(self) -> dict:
        return {"id": self._model_id, "object": "model", "created": 0, "owned_by": "orchard"}

    async def models(self, request: Request) -> Response:
        tenant_of(self._auth, request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        tenant_of(self._auth, request)
        if request.path_params["model_id"] != self._model_id:
            raise FieldError("model", f"unknown model {request.path_params['model_id']!r}; "
                             f"this cluster serves {self._model_id!r}")
        return JSONResponse(self._model_card())

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, shapes.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, shapes.COMPLETIONS)

    async def _complete(self, request: Request, endpoint: str) -> Response:
        tenant = tenant_of(self._auth, request)
        body = await json_body(request)
        shapes.check_model(body, self._model_id)
        mode = shapes.streaming(body)
        orchard_request = shapes.request_of(body, endpoint, self._encode,
                                            headers=dict(request.headers.items()))
        outputs = shapes.Outputs(self._work.token_bytes, orchard_request.tools,
                                 self._work.tool_format)
        priority = http_priority(body, request.headers)
        items = self._work.stream_one(tenant, orchard_request, "body",
                                      list(request.headers.items()), priority=priority)
        created = int(self._clock_s())
        feed = Feed(items)
        if not mode.stream:  # answered at the result; the request's trace finishes after
            try:
                result = await feed.next()
                while not isinstance(result, StoredResult):
                    result = await feed.next()
            except StopAsyncIteration:
                raise RuntimeError("the backend's stream ended without a result") from None
            except BaseException:  # a failure, or the client went away: stop the request
                feed.cancel()
                raise
            # the worker's own time, as OpenAI reports its processing time in a header
            return JSONResponse(shapes.response_body(endpoint, result, self._model_id, created,
                                                     outputs),
                                headers={"orchard-worker-ms": f"{result.worker_s * 1e3:.3f}"})
        try:  # a request refused before its first token gets a status, not a broken stream
            first = await feed.next()
        except BaseException:
            feed.cancel()
            raise
        answer = StreamedAnswer(endpoint, self._model_id, created, mode, outputs)
        return StreamingResponse(self._events(answer, first, feed),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def _events(self, answer: StreamedAnswer, first, feed: Feed
                      ) -> AsyncIterator[bytes]:
        finished = False
        try:
            item = first
            while not isinstance(item, StoredResult):
                for chunk in answer.on_chunk(item):
                    yield _sse(chunk)
                item = await feed.next()
            finished = True
            for chunk in answer.on_result(item):
                yield _sse(chunk)
            yield _sse("[DONE]")
        except StopAsyncIteration:
            yield _sse(error_body(*describe(RuntimeError("the stream ended without a result"))))
        except Exception as exc:  # after the first byte the status is sent: an error event
            yield _sse(error_body(*describe(exc)))
        finally:
            if not finished:
                feed.cancel()  # a client that went away stops its request


# ------------------------------------------------------------------ the server

class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the frontend's process owns its signals; uvicorn must not take them


@dataclass(slots=True)
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task
    host: str
    port: int
    scheme: str

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, grace_s + 5)
        except TimeoutError:
            self.task.cancel()


async def start_http(app: App, host: str, port: int, tls: TlsFiles | None,
                     limits: HttpLimits, setting: str = "[http] port") -> HttpServer:
    """Serve the ASGI ``app`` on ``host:port`` (0: a free port) on this event loop, TLS when
    given, each connection held to ``limits`` (``cluster.api.http_guard``); a port that
    cannot be bound is a ``ValueError`` naming ``setting``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind {setting} to {host}:{port} ({exc.strerror}); set "
                         f"{setting} = 0 to pick a free one") from None
    sock.set_inheritable(True)
    options: dict = {}
    if tls is not None:
        options = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
        if tls.client_ca is not None:
            options |= {"ssl_ca_certs": str(tls.client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    guard = ConnectionGuard(limits.max_connections_per_client, limits.header_timeout_s)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1, ws="none",
                            http=functools.partial(GuardedH11Protocol, guard=guard), **options)
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, host, sock.getsockname()[1],
                      "https" if tls is not None else "http")
