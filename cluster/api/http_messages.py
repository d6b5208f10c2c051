"""``POST /v1/messages``: Anthropic's Messages API over the same ``Work`` as the OpenAI
endpoints (validation, admission, tracing, dispatch), so the ``anthropic`` SDK and tools
built on it work against orchard unchanged. Shapes in ``cluster.api.anthropic_shapes``.

Authentication takes Anthropic's ``x-api-key: <key>`` (what the SDK sends) or
``Authorization: Bearer <key>``; errors come in Anthropic's shape, with the status orchard's
one mapping gives (``cluster.api.http_errors``). A request's ``diagnostics`` (Anthropic's:
the prompt compared with a named previous message's) is answered here, from the
fingerprints this frontend keeps (``cluster.api.anthropic_diagnostics``).
"""
from __future__ import annotations

import functools
import json
from typing import AsyncIterator, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.api import anthropic_diagnostics as diagnostics
from cluster.api import anthropic_shapes as shapes
from cluster.api.edge import Authenticator
from cluster.api.http_errors import error_parts, json_body, tenant_of
from cluster.api.http_feed import Feed
from cluster.api.validate import FieldError
from cluster.api.work import Work
from cluster.jobs.store import StoredResult


def anthropic_errors(endpoint):
    """Answer any exception an endpoint raises in Anthropic's error shape."""
    @functools.wraps(endpoint)
    async def wrapped(request: Request):
        try:
            return await endpoint(request)
        except HTTPException:
            raise
        except Exception as exc:
            status, body = error_parts(exc)
            return JSONResponse(shapes.error_body(status, body["error"]["message"]),
                                status_code=status)
    return wrapped


def api_key_tenant(auth: Authenticator, request: Request) -> str:
    """The tenant of Anthropic's ``x-api-key`` header, or of ``Authorization: Bearer``."""
    key = request.headers.get("x-api-key")
    return auth.tenant_of(key) if key else tenant_of(auth, request)


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class MessagesApi:
    def __init__(self, auth: Authenticator, work: Work):
        self._auth = auth
        self._work = work
        self._model_id = work.model.model_id
        self._prints = diagnostics.PromptPrints()

    def routes(self) -> list[Route]:
        return [Route(shapes.PATH, anthropic_errors(self.create), methods=["POST"])]

    async def create(self, request: Request) -> Response:
        tenant = api_key_tenant(self._auth, request)
        body = await json_body(request)
        if body.get("model") != self._model_id:
            raise FieldError("model", f"unknown model {body.get('model')!r}; this cluster "
                             f"serves {self._model_id!r}")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise FieldError("stream", "must be true or false")
        asked = diagnostics.asked(body.pop("diagnostics", None))
        orchard_request = shapes.request_of(body, dict(request.headers.items()))
        prompt, diagnosis = None, None
        if asked is not None:
            prompt = diagnostics.fingerprint(self._model_id, body.get("system"),
                                             body.get("messages"))
            if asked.previous_message_id:
                diagnosis = diagnostics.diagnose(
                    self._prints.get(tenant, asked.previous_message_id), prompt)
        record = None if prompt is None else functools.partial(self._record, tenant, prompt)
        feed = Feed(self._work.stream_one(tenant, orchard_request, "body",
                                          list(request.headers.items())))
        try:  # a request refused before its first item gets a status, not a broken stream
            first = await feed.next()
            if not stream:
                while not isinstance(first, StoredResult):
                    first = await feed.next()
        except StopAsyncIteration:
            raise RuntimeError("the backend's stream ended without a result") from None
        except BaseException:
            feed.cancel()
            raise
        if not stream:
            body = shapes.message_body(first, self._model_id, self._work.token_bytes)
            if record is not None:
                record(first)
                body["diagnostics"] = diagnosis
            return JSONResponse(body)
        extra = {} if prompt is None else {"diagnostics": diagnosis}
        return StreamingResponse(self._events(first, feed, extra, record),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    def _record(self, tenant: str, prompt: diagnostics.PromptPrint, result: StoredResult) -> None:
        self._prints.record(tenant, shapes.message_id(result.request_id), prompt,
                            result.prompt_tokens)

    async def _events(self, first, feed: Feed, extra: dict,
                      record: Callable[[StoredResult], None] | None) -> AsyncIterator[bytes]:
        finished = False
        try:
            item = first
            for name, data in shapes.start_events(item.request_id, self._model_id, extra):
                yield _event(name, data)
            while not isinstance(item, StoredResult):
                if item.text:
                    yield _event(*shapes.text_event(item.text))
                item = await feed.next()
            finished = True
            if record is not None:
                record(item)
            for name, data in shapes.end_events(item):
                yield _event(name, data)
        except StopAsyncIteration:
            yield _event("error", shapes.error_body(500, "the stream ended without a result"))
        except Exception as exc:  # after the first byte the status is sent: an error event
            status, body = error_parts(exc)
            yield _event("error", shapes.error_body(status, body["error"]["message"]))
        finally:
            if not finished:
                feed.cancel()  # a client that went away stops its request
