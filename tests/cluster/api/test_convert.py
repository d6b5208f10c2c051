"""``cluster.api.convert``: orchard's dataclasses to and from the orchard.v1 messages, as plain
values: a job and a result as the API shows them, a ListJobs page checked, a JSON value read
from ``google.protobuf.Value``, a request through protobuf and back (a response format's
whole numbers integers again, tools never stored), and a job's requests converted as read.
"""
from __future__ import annotations

import json

import pytest
from google.protobuf import struct_pb2

from cluster.api import validate
from cluster.api.convert import (RequestsFromPb, job_to_pb, json_of, page_request, page_token,
                                 request_from_pb, request_to_pb, result_to_pb)
from cluster.api.incoming import ABSENT, Messages, MessageIn, RequestIn, SamplingIn, Tokens
from cluster.api.validate import FieldError
from cluster.jobs.store import JobRecord, JobState, StoredResult
from proto.orchard.v1 import orchard_pb2 as pb
from workers.messages import Priority, ResponseFormat, TokenLogprob

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "score": {"type": "number", "minimum": 0.5}},
          "required": ["name"]}



class TestRequests:
    def test_a_response_format_and_logprobs_round_trip_through_protobuf(self):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA,
                                                      "strict": True}}
        request = RequestIn("a", Messages((MessageIn("user", "hi"),)), SamplingIn(max_tokens=4),
                            response_format=fmt, logprobs=True, top_logprobs=3)
        back = request_from_pb(request_to_pb(request))
        assert back == request
        schema = back.response_format["json_schema"]["schema"]
        assert type(schema["properties"]["name"]["maxLength"]) is int  # a double in the Struct
        assert schema["properties"]["score"]["minimum"] == 0.5
        assert validate.format_of(back.response_format, "f") == ResponseFormat(
            "json_schema", json.dumps(SCHEMA, sort_keys=True), name="s", strict=True)

    def test_tools_never_reach_a_stored_request(self):
        request = RequestIn("a", Messages((MessageIn("assistant", None, tool_calls=[]),)),
                            SamplingIn(max_tokens=4))
        with pytest.raises(RuntimeError, match="tool messages do not travel"):
            request_to_pb(request)


    def test_a_token_request_with_default_sampling_sends_no_sampling(self):
        request = RequestIn("t", Tokens((3, 4)), SamplingIn())
        message = request_to_pb(request)
        assert not message.HasField("sampling") and list(message.tokens.ids) == [3, 4]
        assert request_from_pb(message) == request

    def test_top_p_travels_only_when_given(self):
        given = RequestIn("t", Tokens((3,)), SamplingIn(max_tokens=2, top_p=0.5))
        assert request_to_pb(given).sampling.top_p == 0.5
        assert request_from_pb(request_to_pb(given)) == given
        assert not request_to_pb(RequestIn("t", Tokens((3,)), SamplingIn(2))).sampling.HasField(
            "top_p")

    def test_an_empty_message_list_is_still_a_chat_prompt(self):
        back = request_from_pb(request_to_pb(RequestIn("m", Messages(()), SamplingIn(1))))
        assert back.prompt == Messages(())

    def test_a_response_format_that_is_not_an_object_is_never_stored(self):
        with pytest.raises(RuntimeError, match="response_format: not an object"):
            request_to_pb(RequestIn("t", Tokens((1,)), SamplingIn(1), response_format="json"))

    def test_a_jobs_requests_are_converted_one_by_one_as_read(self):
        requests = RequestsFromPb([pb.Request(custom_id=f"r{i}", tokens=pb.TokenIds(ids=[i]))
                                   for i in range(3)])
        assert len(requests) == 3
        assert requests[1].prompt == Tokens((1,))
        assert [r.custom_id for r in requests[1:]] == ["r1", "r2"]


class TestJsonValues:
    @pytest.mark.parametrize("value, json_value", [
        (struct_pb2.Value(string_value="hi"), "hi"),
        (struct_pb2.Value(number_value=2.5), 2.5),
        (struct_pb2.Value(bool_value=True), True),
        (struct_pb2.Value(bool_value=False), False),
        (struct_pb2.Value(null_value=struct_pb2.NULL_VALUE), None),
        (struct_pb2.Value(list_value=struct_pb2.ListValue(values=[
            struct_pb2.Value(string_value="a"), struct_pb2.Value(number_value=1)])), ["a", 1.0]),
    ])
    def test_each_kind_reads_as_its_json_value(self, value, json_value):
        assert json_of(value) == json_value

    def test_an_object_reads_as_a_dict_and_an_unset_value_as_absent(self):
        value = struct_pb2.Value()
        value.struct_value.update({"type": "text", "n": 3})
        assert json_of(value) == {"type": "text", "n": 3.0}
        assert json_of(struct_pb2.Value()) is ABSENT


class TestJobs:
    def test_a_job_shows_its_counts_state_priority_and_times(self):
        job = JobRecord("job-1", "acme", JobState.CANCELLED, 5, 2, 1, "m", 10, 20,
                        priority=Priority.INTERACTIVE)
        assert job_to_pb(job) == pb.Job(
            job_id="job-1", tenant="acme", state=pb.JOB_STATE_CANCELLED, total=5, completed=2,
            failed=1, cancelled=2, created_unix_ms=10, finished_unix_ms=20, model="m",
            priority=pb.PRIORITY_INTERACTIVE)

    def test_a_result_carries_its_usage_and_its_logprobs_bytes(self):
        result = StoredResult(1, "q", "req-1", True, text="ab", output_tokens=(4, 5),
                              finish_reason="stop", prompt_tokens=9, cached_tokens=6,
                              computed_tokens=3, seq=7,
                              logprobs=(TokenLogprob(4, -0.5, ((4, -0.5), (2, -1.5))),))
        message = result_to_pb(result, "llama", lambda ids: [bytes([65 + i]) for i in ids])
        assert (message.seq, message.index, message.custom_id, message.model) == (
            7, 1, "q", "llama")
        assert (message.usage.prompt_tokens, message.usage.completion_tokens,
                message.usage.cached_tokens, message.usage.computed_tokens) == (9, 2, 6, 3)
        (entry,) = message.logprobs
        assert (entry.token_id, entry.logprob, entry.bytes) == (4, -0.5, b"E")
        assert [(t.token_id, t.logprob, t.bytes) for t in entry.top_logprobs] == [
            (4, -0.5, b"E"), (2, -1.5, b"C")]
        assert not result_to_pb(result, "llama").logprobs  # no token bytes: none sent


class TestPages:
    def test_a_page_token_is_the_last_job_id_read_back(self):
        page = page_request(pb.ListJobsRequest(page_token=page_token("job-9"), page_size=5,
                                               states=[pb.JOB_STATE_RUNNING],
                                               created_after_unix_ms=100))
        assert (page.size, page.states, page.since_ms, page.after) == (
            5, (JobState.RUNNING,), 100, "job-9")

    def test_the_size_is_page_size_else_limit_else_50(self):
        assert page_request(pb.ListJobsRequest()).size == 50
        assert page_request(pb.ListJobsRequest(limit=7)).size == 7
        assert page_request(pb.ListJobsRequest(limit=7, page_size=1000)).size == 1000

    @pytest.mark.parametrize("request_, field", [
        (pb.ListJobsRequest(page_size=1001), "page_size"),
        (pb.ListJobsRequest(limit=1001), "limit"),
        (pb.ListJobsRequest(page_token="bm9wZQ=="), "page_token"),   # "nope"
        (pb.ListJobsRequest(page_token="%%%"), "page_token"),
        (pb.ListJobsRequest(states=[pb.JOB_STATE_UNSPECIFIED]), "states"),
        (pb.ListJobsRequest(created_after_unix_ms=-1), "created_after_unix_ms"),
    ])
    def test_a_bad_request_names_its_field(self, request_, field):
        with pytest.raises(FieldError) as caught:
            page_request(request_)
        assert caught.value.field == field
