"""The gRPC edge: who is calling, and which status each domain error becomes.

Every servicer method is wrapped by ``grpc_errors``, the one place where Python exceptions
turn into gRPC statuses; below the edge, code raises plain domain errors:

    Unauthenticated        UNAUTHENTICATED      missing or unknown API key
    PermissionDenied       PERMISSION_DENIED    a tenant key on an admin call
    ValueError             INVALID_ARGUMENT     bad input (messages name the field)
    JobNotFound            NOT_FOUND
    UnknownWorker          NOT_FOUND
    JobFinished            FAILED_PRECONDITION  e.g. cancelling a finished job
    NotOwned               FAILED_PRECONDITION  scaling workers another frontend started
    Overloaded             RESOURCE_EXHAUSTED   backpressure: retry later (a ``RetryLater``,
                                                shed or over a quota, adds the trailer
                                                ``retry-after``: whole seconds)
    LimitExceeded          RESOURCE_EXHAUSTED   a job over the size limit: split it
    StoreFull              RESOURCE_EXHAUSTED   the job store's disk is full: job not created
    NoWorkerAvailable     UNAVAILABLE
    TimeoutError           DEADLINE_EXCEEDED

Anything else is a bug: logged with its traceback, answered ``INTERNAL``, and the server keeps
serving.

Bytes that do not parse as the method's request message (garbage, invalid UTF-8 in a string
field, nesting deeper than protobuf's limit of ``json_input.MAX_NESTING``, 100, which JSON input
over HTTP and in batch files is held to as well) would fail inside grpc, before any handler,
as ``UNKNOWN``. ``DecodeGuard`` lets them through as an ``Undecodable``; the method's wrapper
checks the caller's key first (``authenticate``, the servicer's own check) and then answers
``INVALID_ARGUMENT``.
"""
from __future__ import annotations

import functools
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from cluster.backend.protocol import NotOwned, NoWorkerAvailable, UnknownWorker
from cluster.jobs.store import JobFinished, JobNotFound, StoreFull
from cluster.jobs.admission import Overloaded, RetryLater
from cluster.api.keys import KeyStore
from cluster.api.validate import LimitExceeded

log = logging.getLogger(__name__)


class Unauthenticated(Exception):
    pass


class PermissionDenied(Exception):
    pass


STATUS = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (JobNotFound, grpc.StatusCode.NOT_FOUND),
    (UnknownWorker, grpc.StatusCode.NOT_FOUND),
    (JobFinished, grpc.StatusCode.FAILED_PRECONDITION),
    (NotOwned, grpc.StatusCode.FAILED_PRECONDITION),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerAvailable, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    for kind, code in STATUS:
        if isinstance(exc, kind):
            return code
    return None


MAX_DETAILS = 1024  # a status message longer than this is cut (metadata is capped at 8 KiB)


def _message(exc: BaseException) -> str:
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    text = text or type(exc).__name__
    # Values are quoted short where they are named (``validate.quoted``); this is the backstop
    # that keeps any message from turning its status into RESOURCE_EXHAUSTED.
    return text if len(text) <= MAX_DETAILS else text[:MAX_DETAILS] + "..."


RETRY_AFTER = "retry-after"  # trailing metadata of a RetryLater refusal: whole seconds


async def _abort(context, exc: Exception, method: str):
    code = status_of(exc)
    if code is None:
        log.exception("%s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
    if isinstance(exc, RetryLater):
        context.set_trailing_metadata(((RETRY_AFTER, str(exc.retry_after_s)),))
    await context.abort(code, _message(exc))


class Undecodable:
    """A request whose bytes are not a valid message of the method's type."""

    def __init__(self, type_name: str, error: DecodeError):
        self.type_name = type_name
        self.error = error

    def problem(self) -> ValueError:
        return ValueError(f"request: not a valid {self.type_name} message ({self.error}); "
                          "send the message the method takes, serialized by a protobuf library")


def _guarded(deserializer):
    type_name = getattr(deserializer, "__self__", None)
    type_name = type_name.DESCRIPTOR.full_name if type_name is not None else "request"

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(type_name, exc)
    return deserialize


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Hands orchard.v1 methods an ``Undecodable`` instead of failing the call as ``UNKNOWN``."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_deserializer is None
                or not handler_call_details.method.startswith("/orchard.v1.")):
            return handler
        return handler._replace(request_deserializer=_guarded(handler.request_deserializer))


def _check_decoded(servicer, request, context) -> None:
    if isinstance(request, Undecodable):
        servicer.authenticate(context)  # the key first, as for a well-formed request
        raise request.problem()


def grpc_errors(method):
    """Map domain exceptions raised by a servicer method (unary or streaming) to statuses."""
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                _check_decoded(self, request, context)
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc, name)
        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            _check_decoded(self, request, context)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, name)
    return unary


class Authenticator:
    """API keys: ``authorization: Bearer <key>`` on every call (gRPC metadata or HTTP header).

    Tenant keys come from the config and, when given, from the operator's ``KeyStore``
    (``orchard keys``), read again as it changes.
    """

    def __init__(self, tenant_keys: dict[str, str], admin_keys: frozenset[str],
                 managed: KeyStore | None = None):
        self._tenant_keys = dict(tenant_keys)
        self._admin_keys = admin_keys
        self._managed = managed

    @staticmethod
    def _key(context) -> str:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                return bearer_token(value)
        raise Unauthenticated("authorization: missing; send 'authorization: Bearer <api key>' "
                              "metadata")

    def tenant(self, context) -> str:
        return self.tenant_of(self._key(context))

    def admin(self, context) -> None:
        self.admin_of(self._key(context))

    def tenant_of(self, key: str) -> str:
        if key in self._tenant_keys:
            return self._tenant_keys[key]
        if key in self._admin_keys:
            raise PermissionDenied("authorization: an admin key cannot submit work; use a "
                                   "tenant's API key")
        tenant = self._managed.tenant_of(key) if self._managed is not None and key else None
        if tenant is None:
            raise Unauthenticated("authorization: unknown API key")
        return tenant

    def admin_of(self, key: str) -> None:
        if key in self._admin_keys:
            return
        if key in self._tenant_keys or (self._managed is not None and key
                                        and self._managed.tenant_of(key) is not None):
            raise PermissionDenied("authorization: admin calls need an admin key, not a "
                                   "tenant's API key")
        raise Unauthenticated("authorization: unknown API key")


def bearer_token(value: str) -> str:
    """The key in an ``authorization`` value: ``Bearer <key>``; any other scheme, or a bare
    key, is ``Unauthenticated``."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization: use the Bearer scheme: "
                              "'authorization: Bearer <api key>'")
    return token.strip()
