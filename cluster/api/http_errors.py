"""The HTTP edge: who is calling, and the one place where exceptions become OpenAI errors.

``tenant_of`` reads ``Authorization: Bearer <key>`` and asks the same ``Authenticator`` as
the gRPC edge; ``json_body`` reads a request's JSON object or raises a ``FieldError``.

A domain error first gets its gRPC status from ``cluster.api.edge.status_of`` (so both edges
agree on what each error is), and each status has one HTTP status and OpenAI error type:

    gRPC status          HTTP  type                    code
    INVALID_ARGUMENT     400   invalid_request_error   invalid_value (param: the field)
    UNAUTHENTICATED      401   authentication_error    invalid_api_key
    PERMISSION_DENIED    403   permission_error        permission_denied
    NOT_FOUND            404   not_found_error         not_found
    FAILED_PRECONDITION  409   invalid_request_error   failed_precondition
    RESOURCE_EXHAUSTED   429   rate_limit_error        resource_exhausted
    INTERNAL             500   server_error            internal
    UNAVAILABLE          503   server_error            unavailable
    DEADLINE_EXCEEDED    504   server_error            deadline_exceeded

HTTP has statuses of its own for two refusals of the transport that gRPC folds into the codes
above; they are looked up first (``OWN_STATUS``):

    BodyTooLarge   413   invalid_request_error   request_too_large   (RESOURCE_EXHAUSTED)
    SlowClient     408   invalid_request_error   request_timeout     (DEADLINE_EXCEEDED)

A refusal that knows when a retry could pass (``RetryLater``: shed under load, or over a
tenant's quota) carries a ``Retry-After`` header in whole seconds, as gRPC's ``retry-after``
trailer does. The body is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``. Starlette's own
HTTP errors (an unknown route, a wrong method) take the same shape. Anything without a status
is a bug: logged with its traceback, answered 500. Every endpoint is wrapped by
``openai_errors``; below it, code raises the same domain errors as under gRPC.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import grpc
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from cluster.api import json_input
from cluster.api.edge import Authenticator, Unauthenticated, bearer_token, status_of
from cluster.api.validate import FieldError, LimitExceeded
from cluster.jobs.admission import RetryLater

log = logging.getLogger(__name__)


class BodyTooLarge(LimitExceeded):
    """A request body (or an uploaded file) over its cap, refused before or while reading it:
    413, and the connection is closed (the rest of the body is never read)."""


class SlowClient(TimeoutError):
    """A client that sends its request slower than ``[http]`` allows: 408, connection closed."""


@dataclass(frozen=True, slots=True)
class HttpStatus:
    status: int
    type: str


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HttpStatus(400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: HttpStatus(401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: HttpStatus(403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: HttpStatus(404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: HttpStatus(409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HttpStatus(429, "rate_limit_error"),
    grpc.StatusCode.INTERNAL: HttpStatus(500, "server_error"),
    grpc.StatusCode.UNAVAILABLE: HttpStatus(503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: HttpStatus(504, "server_error"),
}
CODES = {grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
         grpc.StatusCode.INVALID_ARGUMENT: "invalid_value"}
OWN_STATUS = ((BodyTooLarge, HttpStatus(413, "invalid_request_error"), "request_too_large"),
              (SlowClient, HttpStatus(408, "invalid_request_error"), "request_timeout"))
_BY_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
            403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
            413: grpc.StatusCode.RESOURCE_EXHAUSTED}


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": HTTP_STATUS[code].type, "param": param,
                      "code": CODES.get(code, code.name.lower())}}


def describe(exc: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """The status, message and offending field (``param``) of ``exc``; INTERNAL for a bug."""
    code = status_of(exc)
    if code is None:
        log.error("HTTP request failed", exc_info=exc)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", None
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    param = None
    if isinstance(exc, FieldError):  # "body.sampling.max_tokens" is the body's "max_tokens"
        param = exc.field.removeprefix("body.").removeprefix("sampling.")
    return code, text or type(exc).__name__, param


def error_parts(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body that answer ``exc``."""
    code, message, param = describe(exc)
    for kind, status, name in OWN_STATUS:
        if isinstance(exc, kind):
            return status.status, {"error": {"message": message, "type": status.type,
                                             "param": param, "code": name}}
    return HTTP_STATUS[code].status, error_body(code, message, param)


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_parts(exc)
    headers = ({"retry-after": str(exc.retry_after_s)} if isinstance(exc, RetryLater)
               else None)
    return JSONResponse(body, status_code=status, headers=headers)


def openai_errors(endpoint):
    """Answer any exception an endpoint raises in OpenAI's shape (the HTTP ``grpc_errors``)."""
    @functools.wraps(endpoint)
    async def wrapped(request: Request):
        try:
            return await endpoint(request)
        except HTTPException:
            raise
        except Exception as exc:
            return error_response(exc)
    return wrapped


async def on_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    code = _BY_HTTP.get(exc.status_code, grpc.StatusCode.INVALID_ARGUMENT)
    body = error_body(code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


EXCEPTION_HANDLERS = {HTTPException: on_http_exception}


def tenant_of(auth: Authenticator, request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise Unauthenticated("authorization: missing; send 'Authorization: Bearer <api key>'")
    return auth.tenant_of(bearer_token(header))


async def json_body(request: Request) -> dict:
    """The request's JSON object, held to protobuf's limits (``cluster.api.json_input``)."""
    try:
        body = json_input.loads(await request.body())
    except json_input.JsonInputError as exc:
        raise FieldError(exc.path or "body", exc.reason) from None
    if not isinstance(body, dict):
        raise FieldError("body", "must be a JSON object")
    return body
