"""Exceptions as OpenAI errors (``cluster.api.http_errors``): each domain error's HTTP status,
type and code as the table in the module says, the field as ``param``, the transport's own
413 and 408, ``Retry-After`` on a refusal that knows when, 500 for a bug; then the same
errors end to end, through the real ``openai`` SDK against a real frontend over a LocalBackend."""
from __future__ import annotations

import io
import json
import logging

import openai
import pytest

from cluster.api.edge import PermissionDenied, Unauthenticated
from cluster.api.http_errors import BodyTooLarge, SlowClient, error_parts, error_response
from cluster.api.validate import FieldError, LimitExceeded
from cluster.backend.protocol import NotOwned, NoWorkerAvailable, UnknownWorker
from cluster.jobs.admission import Overloaded, RetryLater
from cluster.jobs.shedding import Shed
from cluster.jobs.store import JobFinished, JobNotFound
from tests.support.http_api import CONFIG, batch_file, http_frontend, messages, sdk
from tests.support.http_api import acme, model  # noqa: F401  (fixtures)


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


class TestServerSideErrors:
    @pytest.mark.parametrize("exc, status, kind", [
        (NoWorkerAvailable("no ready worker"), 503, "server_error"),    # UNAVAILABLE
        (TimeoutError("ran 600 s"), 504, "server_error"),                # DEADLINE_EXCEEDED
        (KeyError("a bug"), 500, "server_error"),                        # INTERNAL
    ])
    def test_server_side_statuses_map_to_http(self, exc, status, kind):
        response = error_response(exc)
        assert response.status_code == status
        assert json.loads(response.body)["error"]["type"] == kind

    def test_a_shed_request_is_a_429_with_its_retry_after_and_plain_backpressure_without(self):
        response = error_response(Shed("overloaded: ...", 3))
        assert (response.status_code, response.headers["retry-after"]) == (429, "3")
        assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
        response = error_response(Overloaded("requests: the cluster has 5 pending"))
        assert response.status_code == 429 and "retry-after" not in response.headers


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with http_frontend(tmp_path_factory, CONFIG) as harness:
        yield harness




class TestOverHttp:
    def test_errors_in_openai_shape_with_a_status_each(self, api, acme, model):
        with pytest.raises(openai.AuthenticationError) as caught:  # UNAUTHENTICATED -> 401
            sdk(api, "no-such-key").models.list()
        assert caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.PermissionDeniedError):  # PERMISSION_DENIED -> 403
            sdk(api, "key-admin").chat.completions.create(model=model, messages=messages("x"))
        with pytest.raises(openai.BadRequestError) as caught:  # INVALID_ARGUMENT -> 400
            acme.chat.completions.create(model=model, messages=messages("x"), max_tokens=0)
        assert caught.value.body == {"message": "body.sampling.max_tokens: must be >= 1, got 0",
                                     "type": "invalid_request_error", "param": "max_tokens",
                                     "code": "invalid_value"}
        with pytest.raises(openai.BadRequestError) as caught:
            acme.chat.completions.create(model="gpt-4o", messages=messages("x"))
        assert caught.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):  # NOT_FOUND -> 404
            acme.batches.retrieve("batch_nope")
        lines = batch_file(2).getvalue().decode().splitlines()
        bad = [lines[0], "", lines[1].replace('"role": "user"', '"role": "robot"')]
        uploaded = acme.files.create(file=("in.jsonl", io.BytesIO("\n".join(bad).encode())),
                                     purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:  # the file's line, not requests[1]
            acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
        assert caught.value.body["message"].startswith("line 3.messages[1].role: unknown role 'robot'")
        uploaded = acme.files.create(file=("in.jsonl", io.BytesIO(b"{not json\n")),
                                     purpose="batch")
        with pytest.raises(openai.BadRequestError, match="line 1: not valid JSON"):
            acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
        uploaded = acme.files.create(file=("in.jsonl", batch_file(9)), purpose="batch")
        with pytest.raises(openai.RateLimitError) as caught:  # RESOURCE_EXHAUSTED -> 429
            acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
        assert "9 requests exceed the limit of 8" in caught.value.message
