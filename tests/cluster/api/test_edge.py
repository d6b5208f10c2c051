"""``cluster.api.edge``: who is calling (``Authenticator``: the Bearer scheme, tenant and admin
keys) and which status each domain error becomes (``grpc_errors``), bytes that are not the
method's message (``DecodeGuard``) answered ``INVALID_ARGUMENT`` only after the key is checked.

First as plain values: each domain error's status, a servicer method's error answered as its
status (cut to ``MAX_DETAILS``, ``retry-after`` for a ``RetryLater``, ``INTERNAL`` for a bug),
keys from the config and from the ``KeyStore``. Then end to end, a real frontend over a
LocalBackend; raw bytes go through a plain grpc channel so that the client library's own
checks are not in the way. Last, the API room's boundary read from its
source: no module of ``cluster/api`` reaches into another object's private names.
"""
from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from cluster.api.client import Client, OrchardError
from cluster.api.edge import (Authenticator, PermissionDenied, Unauthenticated, bearer_token,
                              grpc_errors, status_of)
from cluster.api.keys import KeyStore
from cluster.api.validate import FieldError, LimitExceeded
from cluster.jobs.admission import Overloaded, RetryLater
from cluster.jobs.store import JobNotFound, StoreFull
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from tests.support.grpc_api import chat, tokens
from tests.support.grpc_api import acme, api, api_hostile, channel  # noqa: F401  (fixtures)
from tests.support.paths import REPO

API = REPO / "cluster" / "api"
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore










def _raw(channel, method: str, data: bytes, key: str | None, streaming: bool = False):
    """Send ``data`` as the request bytes of ``method``; returns the status code raised."""
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    if streaming:
        call = channel.unary_stream(method)
        with pytest.raises(grpc.RpcError) as info:
            list(call(data, metadata=metadata, timeout=30))
    else:
        call = channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as info:
            call(data, metadata=metadata, timeout=30)
    return info.value.code(), info.value.details()


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _deep_value(depth: int) -> bytes:
    """A google.protobuf.Value nested ``depth`` lists deep (Value.list_value = 6,
    ListValue.values = 1)."""
    value = b""
    for _ in range(depth):
        value = _field(6, _field(1, value))
    return value


def _deep_generate(depth: int) -> bytes:
    message = _field(1, b"user") + _field(2, _deep_value(depth))  # ChatMessage role, content
    request = _field(2, _field(1, message))  # Request.messages.messages[0]
    return _field(1, request)                # GenerateRequest.request


GARBAGE = b"\xff\xff\xff\xff\x0f\x01"


BAD_UTF8_JOB_ID = _field(1, b"job-\xff\xfe")  # GetJobRequest.job_id


def _private_uses(path: Path) -> list[str]:
    """``_``-prefixed names that ``path`` imports from ``cluster.jobs`` or reads off an object
    other than ``self``/``cls``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cluster.jobs")
                and any(a.name.startswith("_") for a in node.names)):
            found.append(f"{path.name}:{node.lineno}: from {node.module} import "
                         + ", ".join(a.name for a in node.names))
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


class _Context:
    """What ``grpc_errors`` and ``Authenticator`` read from and do to a servicer context."""

    def __init__(self, authorization: str | None = None):
        self.metadata = () if authorization is None else (("authorization", authorization),)
        self.aborted: tuple | None = None
        self.trailers: tuple = ()

    def invocation_metadata(self):
        return self.metadata

    def set_trailing_metadata(self, trailers) -> None:
        self.trailers = trailers

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


class _Servicer:
    def authenticate(self, context) -> None:
        pass

    @grpc_errors
    async def Unary(self, request, context):
        raise request

    @grpc_errors
    async def Streaming(self, request, context):
        yield 1
        raise request


def _answered(exc: Exception, streaming: bool = False) -> _Context:
    context = _Context()

    async def call():
        if streaming:
            assert [item async for item in _Servicer().Streaming(exc, context)] == [1]
        else:
            await _Servicer().Unary(exc, context)

    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(call())
    return context


class TestStatusOfEachError:
    @pytest.mark.parametrize("exc, code", [
        (LimitExceeded("requests", "too many"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (FieldError("f", "bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (RetryLater("shed", 3), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (StoreFull("disk full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (JobNotFound("job_id: no job"), grpc.StatusCode.NOT_FOUND),
        (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
        (PermissionDenied("admin"), grpc.StatusCode.PERMISSION_DENIED),
    ])
    def test_the_most_specific_kind_decides(self, exc, code):
        assert status_of(exc) == code

    def test_a_bug_has_no_status_of_its_own(self):
        assert status_of(KeyError("x")) is None and status_of(RuntimeError("x")) is None


class TestErrorsAnswered:
    def test_a_domain_error_is_its_status_with_its_message(self):
        for streaming in (False, True):
            context = _answered(FieldError("requests[0].prompt", "missing"), streaming)
            assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "requests[0].prompt: missing")
            assert _answered(JobNotFound("job_id: no job 'j'"), streaming).aborted == (
                grpc.StatusCode.NOT_FOUND, "job_id: no job 'j'")

    def test_a_long_message_is_cut_at_1024_characters(self):
        assert _answered(ValueError("x" * 1024)).aborted[1] == "x" * 1024
        assert _answered(ValueError("y" * 1025)).aborted[1] == "y" * 1024 + "..."

    def test_an_error_without_a_message_is_named_by_its_kind(self):
        assert _answered(TimeoutError()).aborted == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                     "TimeoutError")

    def test_a_refusal_that_knows_when_says_so_in_a_trailer_and_others_do_not(self):
        assert _answered(RetryLater("overloaded", 7)).trailers == (("retry-after", "7"),)
        assert _answered(Overloaded("overloaded")).trailers == ()

    def test_a_bug_is_internal_naming_only_its_kind_and_is_logged(self, caplog):
        caplog.set_level(logging.ERROR)
        assert _answered(KeyError("secret detail")).aborted == (
            grpc.StatusCode.INTERNAL, "internal error: KeyError")
        assert [r.getMessage() for r in caplog.records] == ["_Servicer.Unary failed"]


class TestAuthenticator:
    def test_a_bearer_token_is_read_whatever_the_schemes_case_and_the_spaces(self):
        assert bearer_token("Bearer k1") == "k1"
        assert bearer_token("bearer   k1 ") == "k1"
        for value in ("k1", "Basic k1", "Bearer ", "Bearer"):
            with pytest.raises(Unauthenticated):
                bearer_token(value)

    def test_keys_name_their_tenant_and_an_admin_key_only_admin_calls(self):
        auth = Authenticator({"k1": "acme"}, frozenset({"root"}))
        assert auth.tenant(_Context("Bearer k1")) == "acme"
        auth.admin(_Context("Bearer root"))
        with pytest.raises(PermissionDenied, match="an admin key cannot submit work"):
            auth.tenant(_Context("Bearer root"))
        with pytest.raises(PermissionDenied, match="admin calls need an admin key"):
            auth.admin(_Context("Bearer k1"))
        with pytest.raises(Unauthenticated, match="authorization: unknown API key"):
            auth.admin(_Context("Bearer nope"))

    def test_a_call_without_the_header_is_told_what_to_send(self):
        auth = Authenticator({"k1": "acme"}, frozenset())
        with pytest.raises(Unauthenticated) as caught:
            auth.tenant(_Context())
        assert str(caught.value) == ("authorization: missing; send 'authorization: Bearer "
                                     "<api key>' metadata")

    def test_a_managed_key_names_its_tenant_until_revoked(self, tmp_path, clock):
        clock.now = 1_000
        keys = KeyStore(tmp_path, clock)
        record, key = keys.create("beta", "ci")
        auth = Authenticator({"k1": "acme"}, frozenset({"root"}), keys)
        assert auth.tenant_of(key) == "beta"
        with pytest.raises(PermissionDenied):
            auth.admin_of(key)
        keys.revoke(record.key_id)
        with pytest.raises(Unauthenticated):
            auth.tenant_of(key)
        with pytest.raises(Unauthenticated):
            auth.tenant_of("")


class TestKeys:
    def test_authentication_and_permissions(self, api):
        channel = grpc.insecure_channel(api.address)
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.JobsStub(channel).ListJobs(pb.ListJobsRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization" in err.value.details()
        channel.close()
        cases = [(Client(api.address, "wrong-key").jobs, "UNAUTHENTICATED"),
                 (Client(api.address, "key-acme").workers, "PERMISSION_DENIED"),
                 (Client(api.address, "key-admin").jobs, "PERMISSION_DENIED"),
                 (Client(api.address, "wrong-key").cache_stats, "UNAUTHENTICATED")]
        for call, code in cases:
            with pytest.raises(OrchardError) as err:
                call()
            assert err.value.code == code and "authorization" in err.value.message

    def test_the_key_needs_the_bearer_scheme(self, api_hostile):
        with Client(api_hostile.address, "key-acme") as acme:
            assert acme.jobs() is not None
        for header in ("key-acme", "Basic key-acme", "Bearerkey-acme"):
            with grpc.insecure_channel(api_hostile.address) as channel:
                stub = pb_grpc.JobsStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    stub.ListJobs(pb.ListJobsRequest(), metadata=(("authorization", header),))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.details() == ("authorization: use the Bearer scheme: "
                                                "'authorization: Bearer <api key>'")
        with grpc.insecure_channel(api_hostile.address) as channel:
            stub = pb_grpc.JobsStub(channel)
            stub.ListJobs(pb.ListJobsRequest(), metadata=(("authorization", "bearer  key-acme"),))

    def test_bad_bytes_still_need_a_key_first(self, channel):
        code, _ = _raw(channel, "/orchard.v1.Jobs/GetJob", GARBAGE, key=None)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _raw(channel, "/orchard.v1.Jobs/GetJob", GARBAGE, key="not-a-key")
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = _raw(channel, "/orchard.v1.Admin/Drain", GARBAGE, key="key-acme")
        assert code == grpc.StatusCode.PERMISSION_DENIED


class TestStatuses:
    def test_a_job_above_the_size_limit_is_resource_exhausted(self, acme):
        with pytest.raises(OrchardError) as err:
            acme.submit([tokens([1, 2], 1)] * 17)  # 17 > max_requests_per_job = 16
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert err.value.message.startswith("requests:") and "limit of 16" in err.value.message

    def test_backpressure_is_resource_exhausted(self, acme):
        with pytest.raises(OrchardError) as err:
            acme.submit([chat(f"p{i}", "x") for i in range(13)])  # 13 > 12 pending per tenant
        assert err.value.code == "RESOURCE_EXHAUSTED" and "requests" in err.value.message


class TestUndecodableBytes:
    @pytest.mark.parametrize("method,data,streaming", [
        ("/orchard.v1.Jobs/GetJob", GARBAGE, False),
        ("/orchard.v1.Jobs/GetJob", BAD_UTF8_JOB_ID, False),
        ("/orchard.v1.Jobs/StreamResults", BAD_UTF8_JOB_ID, True),
        ("/orchard.v1.Generate/Generate", _deep_generate(150), True),
        ("/orchard.v1.Admin/Drain", GARBAGE, False),
    ])
    def test_bytes_that_are_not_a_message_get_invalid_argument(self, channel, method, data, streaming):
        key = "key-admin" if ".Admin/" in method else "key-acme"
        code, details = _raw(channel, method, data, key, streaming)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith("request: not a valid orchard.v1.")

    def test_nesting_within_the_limit_is_still_parsed(self, channel):
        code, details = _raw(channel, "/orchard.v1.Generate/Generate", _deep_generate(20), "key-acme",
                             streaming=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT  # well-formed, but not text content
        assert details == "request.messages[0].content[0]: a content part must be {\"type\": \"text\", \"text\": \"...\"}"


def test_the_edge_touches_no_private_name_of_another_object():
    files = sorted(API.glob("*.py"))
    assert files
    assert [use for path in files for use in _private_uses(path)] == []

