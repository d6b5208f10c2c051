"""``cluster.api.client``: the blocking Python client's plain parts, no server: a job's status
read from protobuf, requests built as the server reads them, and the frontend's address found
in a run directory (or a message that says what to do). The client against a real server is
what every gRPC test does (tests/cluster/api/test_servicer.py and its neighbours); last, the
server never loads this module.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from google.protobuf import struct_pb2

from cluster.api.client import (JobStatus, OrchardError, chat_request, frontend_address,
                                sampling, token_request)
from proto.orchard.v1 import orchard_pb2 as pb
from tests.support.paths import REPO

API = REPO / "cluster" / "api"


def _job(**fields) -> pb.Job:
    return pb.Job(**{"job_id": "job-1", "tenant": "acme", "total": 5, "completed": 2,
                     "failed": 1, "cancelled": 0, "model": "m", "created_unix_ms": 10,
                     "finished_unix_ms": 0, **fields})


class TestJobStatus:
    def test_a_job_reads_field_for_field_with_its_state_named(self):
        assert JobStatus.from_pb(_job(state=pb.JOB_STATE_RUNNING)) == JobStatus(
            "job-1", "acme", "running", 5, 2, 1, 0, "m", 10, 0, "batch")

    @pytest.mark.parametrize("state, name, finished", [
        (pb.JOB_STATE_QUEUED, "queued", False), (pb.JOB_STATE_RUNNING, "running", False),
        (pb.JOB_STATE_SUCCEEDED, "succeeded", True), (pb.JOB_STATE_CANCELLED, "cancelled", True),
    ])
    def test_only_a_succeeded_or_cancelled_job_is_finished(self, state, name, finished):
        status = JobStatus.from_pb(_job(state=state))
        assert (status.state, status.finished) == (name, finished)

    def test_done_counts_completed_and_failed_not_cancelled(self):
        assert JobStatus.from_pb(_job(cancelled=7)).done == 3

    def test_the_priority_is_interactive_only_when_the_server_says_so(self):
        assert JobStatus.from_pb(_job(priority=pb.PRIORITY_INTERACTIVE)).priority == "interactive"
        assert JobStatus.from_pb(_job(priority=pb.PRIORITY_BATCH)).priority == "batch"
        assert JobStatus.from_pb(_job()).priority == "batch"


class TestRequests:
    def test_top_p_is_sent_only_when_given(self):
        assert not sampling(4).HasField("top_p")
        params = sampling(4, temperature=0.5, top_p=0.25, seed=3, stop=("a", "b"))
        assert (params.max_tokens, params.temperature, params.top_p, params.seed,
                list(params.stop)) == (4, 0.5, 0.25, 3, ["a", "b"])

    def test_a_chat_request_carries_each_message_and_its_sampling(self):
        request = chat_request("q1", [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "hi"}]}], 8, seed=2)
        assert request.custom_id == "q1" and request.WhichOneof("prompt") == "messages"
        system, user = request.messages.messages
        assert (system.role, system.content.string_value) == ("system", "be brief")
        assert user.content.list_value.values[0].struct_value["text"] == "hi"
        assert (request.sampling.max_tokens, request.sampling.seed) == (8, 2)

    def test_a_message_without_content_sends_a_null(self):
        (message,) = chat_request("q", [{"role": "user"}], 1).messages.messages
        assert message.content.WhichOneof("kind") == "null_value"
        assert message.content.null_value == struct_pb2.NULL_VALUE

    def test_a_token_request_sends_its_ids_as_they_are(self):
        request = token_request("t", [5, 0, 7], 2, stop=["x"])
        assert request.WhichOneof("prompt") == "tokens"
        assert (list(request.tokens.ids), list(request.sampling.stop)) == ([5, 0, 7], ["x"])


class TestErrors:
    def test_an_error_reads_as_its_status_and_message(self):
        error = OrchardError("NOT_FOUND", "job_id: no job 'x'", retry_after_s=3)
        assert (str(error), error.code, error.message, error.retry_after_s) == (
            "NOT_FOUND: job_id: no job 'x'", "NOT_FOUND", "job_id: no job 'x'", 3)
        assert OrchardError("INTERNAL", "").retry_after_s is None


class TestFrontendAddress:
    def test_the_address_is_read_from_the_run_dirs_frontend_json(self, tmp_path):
        (tmp_path / "frontend.json").write_text('{"address": "127.0.0.1:5050", "pid": 1}')
        assert frontend_address(tmp_path) == "127.0.0.1:5050"

    def test_a_missing_file_says_how_to_start_the_cluster(self, tmp_path):
        with pytest.raises(FileNotFoundError) as caught:
            frontend_address(tmp_path)
        assert str(caught.value) == (
            f"{tmp_path / 'frontend.json'} does not exist: is the cluster up? Start it with "
            f"`orchard up --run-dir {tmp_path}` or pass --address")

    @pytest.mark.parametrize("text", ["{not json", '{"http_address": "x"}'])
    def test_a_file_without_an_address_says_to_pass_one(self, tmp_path, text):
        (tmp_path / "frontend.json").write_text(text)
        with pytest.raises(ValueError) as caught:
            frontend_address(tmp_path)
        assert str(caught.value) == (f"{tmp_path / 'frontend.json'} is not a frontend address "
                                     "file; pass --address")


class TestTheServerDoesNotLoadIt:
    def test_the_server_never_imports_the_client_sdk(self):
        root = API.parent.parent
        probe = ("import sys, cluster.api.frontend; "
                 "print(sorted(m for m in sys.modules if m == 'cluster.api.client'))")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, cwd=root, check=True,
                             env={**os.environ, "PYTHONPATH": str(root)})
        assert out.stdout.strip() == "[]"

