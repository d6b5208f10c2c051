"""A request's priority at each edge: gRPC's enum, the x-orchard-priority header and OpenAI's
service_tier; a job's: gRPC's enum (unset: batch) and a batch's header; every other value
refused naming the field."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import grpc
import pytest

from cluster.api.client import OrchardError, token_request
from cluster.api.priority import (batch_priority, http_priority, job_priority_from_pb,
                                   priority_from_pb)
from cluster.api.validate import FieldError
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
from workers.messages import Priority

I, B = Priority.INTERACTIVE, Priority.BATCH


@pytest.mark.parametrize("value, priority", [
    (pb.PRIORITY_UNSPECIFIED, I), (pb.PRIORITY_INTERACTIVE, I), (pb.PRIORITY_BATCH, B)])
def test_grpc_values(value, priority):
    assert priority_from_pb(value) is priority


def test_an_unknown_grpc_number_is_refused_naming_the_field():
    with pytest.raises(FieldError) as caught:
        priority_from_pb(7)
    assert caught.value.field == "priority" and "unknown value 7" in str(caught.value)


@pytest.mark.parametrize("body, headers, priority", [
    ({}, {}, I),
    ({"service_tier": "auto"}, {}, I), ({"service_tier": "default"}, {}, I),
    ({"service_tier": "flex"}, {}, B), ({"service_tier": None}, {}, I),
    ({}, {"x-orchard-priority": "batch"}, B), ({}, {"x-orchard-priority": " Interactive "}, I),
    ({"service_tier": "flex"}, {"x-orchard-priority": "batch"}, B),
])
def test_http_values(body, headers, priority):
    assert http_priority(body, headers) is priority


@pytest.mark.parametrize("body, headers, field, words", [
    ({"service_tier": "priority"}, {}, "service_tier", "got 'priority'"),
    ({"service_tier": "scale"}, {}, "service_tier", "'flex' (batch"),
    ({"service_tier": 3}, {}, "service_tier", "got '3'"),
    ({}, {"x-orchard-priority": "urgent"}, "x-orchard-priority", "got 'urgent'"),
    ({"service_tier": "default"}, {"x-orchard-priority": "batch"}, "service_tier",
     "'default' is interactive work but the x-orchard-priority header says batch"),
])
def test_http_refusals_name_the_field(body, headers, field, words):
    with pytest.raises(FieldError) as caught:
        http_priority(body, headers)
    assert caught.value.field == field and words in str(caught.value)


@pytest.mark.parametrize("value, priority", [
    (pb.PRIORITY_UNSPECIFIED, B), (pb.PRIORITY_BATCH, B), (pb.PRIORITY_INTERACTIVE, I)])
def test_a_jobs_grpc_values_default_to_batch(value, priority):
    assert job_priority_from_pb(value) is priority


def test_an_unknown_job_priority_is_refused_naming_the_field():
    with pytest.raises(FieldError) as caught:
        job_priority_from_pb(9, "priority")
    assert caught.value.field == "priority"
    assert str(caught.value) == ("priority: unknown value 9; use PRIORITY_BATCH or "
                                 "PRIORITY_INTERACTIVE (or leave it unset: batch)")


@pytest.mark.parametrize("headers, priority", [
    ({}, B), ({"x-orchard-priority": "Batch"}, B), ({"x-orchard-priority": " interactive"}, I)])
def test_a_batchs_header_names_its_priority(headers, priority):
    assert batch_priority(headers) is priority


def test_a_batchs_unknown_header_is_refused_naming_it():
    with pytest.raises(FieldError) as caught:
        batch_priority({"x-orchard-priority": "urgent"})
    assert caught.value.field == "x-orchard-priority"
    assert "must be 'batch' (the default) or 'interactive'" in str(caught.value)
    assert "got 'urgent'" in str(caught.value)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness


class TestAJobsPriorityAtTheEdges:
    """A real frontend: the priority each way in gives the job, as GetJob and ListJobs read it
    back, and every value no version defines refused naming the field."""

    def test_submit_job_keeps_the_priority_asked_for_and_defaults_to_batch(self, harness):
        with harness.client("acme") as client:
            batch = client.submit([token_request("a", [1, 2, 3], 1)])
            interactive = client.submit([token_request("b", [1, 2, 3], 1)],
                                        priority=pb.PRIORITY_INTERACTIVE)
            assert (batch.priority, interactive.priority) == ("batch", "interactive")
            assert client.job(interactive.job_id).priority == "interactive"
            assert client.wait(interactive.job_id).completed == 1
            with pytest.raises(OrchardError) as caught:
                client.submit([token_request("c", [1, 2, 3], 1)], priority=7)
            assert caught.value.code == "INVALID_ARGUMENT"
            assert caught.value.message == ("priority: unknown value 7; use PRIORITY_BATCH or "
                                            "PRIORITY_INTERACTIVE (or leave it unset: batch)")

    def test_a_batch_file_takes_its_first_chunks_priority_and_no_later_ones(self, harness,
                                                                           tmp_path):
        path = tmp_path / "in.jsonl"
        path.write_text(json.dumps({"custom_id": "x", "method": "POST",
                                    "url": "/v1/chat/completions",
                                    "body": {"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 1}}) + "\n")
        with harness.client("acme") as client:
            job = client.submit_file(path, priority=pb.PRIORITY_INTERACTIVE)
            assert client.job(job.job_id).priority == "interactive"
        data = path.read_bytes()
        chunks = [pb.BatchFileChunk(data=data[:10], file_name="in.jsonl"),
                  pb.BatchFileChunk(data=data[10:], priority=pb.PRIORITY_INTERACTIVE)]
        with grpc.insecure_channel(harness.address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.JobsStub(channel).SubmitBatchFile(
                    iter(chunks), metadata=(("authorization", "Bearer key-acme"),), timeout=60)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == ("priority: set on chunk 1: only the first chunk "
                                          "carries the job's priority")

    def test_a_batch_over_http_takes_its_header(self, harness):
        address = json.loads((harness.config.run_dir / "frontend.json").read_text())
        url = urlsplit(address["http_address"])
        line = {"custom_id": "h", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": harness.backend.model_info().model_id, "max_tokens": 1,
                         "messages": [{"role": "user", "content": "hi"}]}}
        file_id = _upload(url, json.dumps(line) + "\n")
        body = json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                           "completion_window": "24h"})
        for header, status in (("interactive", 200), ("urgent", 400)):
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            connection.request("POST", "/v1/batches", body, {
                "authorization": "Bearer key-acme", "content-type": "application/json",
                "x-orchard-priority": header})
            answer = connection.getresponse()
            reply = json.loads(answer.read())
            connection.close()
            assert answer.status == status, reply
        assert reply["error"]["param"] == "x-orchard-priority"
        with harness.client("acme") as client:
            newest = client.jobs(limit=1)[0]
        assert (newest.total, newest.priority) == (1, "interactive")


def _upload(url, text: str) -> str:
    """An uploaded batch input file's id (``POST /v1/files``, multipart)."""
    boundary = "orchard-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n{text}\r\n"
            f"--{boundary}--\r\n").encode()
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/files", body, {
        "authorization": "Bearer key-acme",
        "content-type": f"multipart/form-data; boundary={boundary}"})
    answer = connection.getresponse()
    reply = json.loads(answer.read())
    connection.close()
    assert answer.status == 200, reply
    return reply["id"]
