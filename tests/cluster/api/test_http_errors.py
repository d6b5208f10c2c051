"""Exceptions as OpenAI errors (``cluster.api.http_errors``): each domain error's HTTP status,
type and code as the table in the module says, the field as ``param``, the transport's own
413 and 408, ``Retry-After`` on a refusal that knows when, 500 for a bug."""
from __future__ import annotations

import json
import logging

import pytest

from cluster.api.edge import PermissionDenied, Unauthenticated
from cluster.api.http_errors import BodyTooLarge, SlowClient, error_parts, error_response
from cluster.api.validate import FieldError, LimitExceeded
from cluster.backend.protocol import NotOwned, NoWorkerAvailable, UnknownWorker
from cluster.jobs.admission import Overloaded, RetryLater
from cluster.jobs.store import JobFinished, JobNotFound


def _error(status: int, message: str, type_: str, code: str, param: str | None = None):
    return status, {"error": {"message": message, "type": type_, "param": param,
                              "code": code}}


class TestStatuses:
    @pytest.mark.parametrize("exc, expected", [
        (ValueError("messages: required"),
         _error(400, "messages: required", "invalid_request_error", "invalid_value")),
        (Unauthenticated("key: unknown"),
         _error(401, "key: unknown", "authentication_error", "invalid_api_key")),
        (PermissionDenied("admin only"),
         _error(403, "admin only", "permission_error", "permission_denied")),
        (JobNotFound("job-1: no such job"),
         _error(404, "job-1: no such job", "not_found_error", "not_found")),
        (UnknownWorker("worker_id: no worker 'w9'"),
         _error(404, "worker_id: no worker 'w9'", "not_found_error", "not_found")),
        (JobFinished("job-1 finished"),
         _error(409, "job-1 finished", "invalid_request_error", "failed_precondition")),
        (NotOwned("workers: scale them through that frontend"),
         _error(409, "workers: scale them through that frontend", "invalid_request_error",
                "failed_precondition")),
        (Overloaded("too many pending"),
         _error(429, "too many pending", "rate_limit_error", "resource_exhausted")),
        (LimitExceeded("job", "over 50000 requests"),
         _error(429, "job: over 50000 requests", "rate_limit_error", "resource_exhausted",
                "job")),
        (NoWorkerAvailable("no ready worker"),
         _error(503, "no ready worker", "server_error", "unavailable")),
        (TimeoutError("deadline"),
         _error(504, "deadline", "server_error", "deadline_exceeded")),
    ])
    def test_each_domain_error(self, exc, expected):
        assert error_parts(exc) == expected

    def test_a_field_error_names_the_bodys_field_as_param(self):
        status, body = error_parts(FieldError("body.sampling.max_tokens", "must be >= 1"))
        assert (status, body["error"]["param"], body["error"]["message"]) == (
            400, "max_tokens", "body.sampling.max_tokens: must be >= 1")

    def test_the_transports_own_refusals(self):
        assert error_parts(BodyTooLarge("body", "over 1 MiB")) == _error(
            413, "body: over 1 MiB", "invalid_request_error", "request_too_large", "body")
        assert error_parts(SlowClient("body: too slow")) == _error(
            408, "body: too slow", "invalid_request_error", "request_timeout")

    def test_a_bug_is_500_without_its_message(self, caplog):
        with caplog.at_level(logging.ERROR):
            assert error_parts(KeyError("secret detail")) == _error(
                500, "internal error: KeyError", "server_error", "internal")
        assert "HTTP request failed" in caplog.text


class TestResponse:
    def test_a_refusal_that_knows_when_carries_retry_after(self):
        response = error_response(RetryLater("tenant acme over its quota", 7))
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert json.loads(response.body)["error"]["message"] == "tenant acme over its quota"

    def test_others_carry_none(self):
        response = error_response(Overloaded("too many pending"))
        assert response.status_code == 429 and "retry-after" not in response.headers
