"""``cluster.api.openai_shapes``: OpenAI's request and response shapes to and from orchard's.

As plain values first: a body's sampling (OpenAI's defaults, the numbers a protobuf field
holds), streaming options, a completion's prompt, usage, a Batch output line, Batch input
lines numbered and retold as ``line N``. Then end to end, raw bodies to a real frontend over a
LocalBackend: numbers out of range and Batch lines naming their line and field.
"""
from __future__ import annotations

import json

import pytest

from cluster.api import openai_shapes as shapes
from cluster.api.incoming import SamplingIn, Tokens
from cluster.api.openai_fields import CHAT, COMPLETIONS
from cluster.api.validate import FieldError
from cluster.jobs.store import StoredResult
from tests.support.http_api import (ADVICE, INPUT_CONFIG, LONE, chat, create_batch, http_frontend,
                                    batch_line, post, refused, upload)


def _refusal(call) -> tuple[str, str]:
    with pytest.raises(FieldError) as caught:
        call()
    return caught.value.field, str(caught.value)


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class TestSampling:
    def test_an_empty_body_takes_openais_defaults(self):
        assert shapes.sampling_params({}, CHAT) == SamplingIn(max_tokens=128, temperature=1.0)
        assert shapes.sampling_params({}, COMPLETIONS).max_tokens == 16

    def test_max_completion_tokens_counts_when_max_tokens_is_absent_or_null(self):
        assert shapes.sampling_params({"max_completion_tokens": 9}, CHAT).max_tokens == 9
        assert shapes.sampling_params({"max_tokens": None, "max_completion_tokens": 9},
                                      CHAT).max_tokens == 9
        assert shapes.sampling_params({"max_tokens": 5, "max_completion_tokens": 9},
                                      CHAT).max_tokens == 5

    def test_a_stop_string_is_a_list_of_one_and_the_values_are_carried(self):
        assert shapes.sampling_params({"stop": "END", "seed": 3, "temperature": 0,
                                       "top_p": 0.5}, CHAT) == SamplingIn(
            max_tokens=128, temperature=0.0, top_p=0.5, seed=3, stop=("END",))

    @pytest.mark.parametrize("body, field, message", [
        ({"seed": -1}, "seed", "seed: must be >= 0, got -1"),
        ({"seed": 2**64}, "seed", "seed: must be at most 18446744073709551615, got "
                                  "18446744073709551616"),
        ({"max_tokens": 2**31}, "max_tokens", "max_tokens: must be at most 2147483647, got "
                                              "2147483648"),
        ({"max_tokens": True}, "max_tokens", "max_tokens: must be an integer, got True"),
        ({"temperature": "hot"}, "temperature", "temperature: must be a number, got 'hot'"),
        ({"stop": ["a", 1]}, "stop", "stop: must be a string or a list of strings"),
    ])
    def test_values_a_field_cannot_hold_name_it(self, body, field, message):
        assert _refusal(lambda: shapes.sampling_params(body, CHAT)) == (field, message)

    def test_the_largest_values_the_fields_hold_are_taken(self):
        params = shapes.sampling_params({"max_tokens": 2**31 - 1, "seed": 2**64 - 1}, CHAT)
        assert (params.max_tokens, params.seed) == (2**31 - 1, 2**64 - 1)


class TestStreaming:
    def test_off_unless_asked_and_usage_only_when_asked(self):
        assert shapes.streaming({}) == shapes.Streaming(False, False)
        assert shapes.streaming({"stream": True}) == shapes.Streaming(True, False)
        assert shapes.streaming({"stream": True, "stream_options": {"include_usage": True}}) == (
            shapes.Streaming(True, True))

    @pytest.mark.parametrize("body, field", [
        ({"stream": "yes"}, "stream"), ({"stream_options": ["include_usage"]}, "stream_options"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ])
    def test_anything_but_booleans_is_named(self, body, field):
        assert _refusal(lambda: shapes.streaming(body))[0] == field


class TestRequests:
    def test_a_completions_prompt_is_text_ids_or_either_alone_in_a_list(self):
        for prompt, ids in (("ab", (97, 98)), (["ab"], (97, 98)), ([5, 6], (5, 6)),
                            ([[5, 6]], (5, 6))):
            request = shapes.request_of({"prompt": prompt}, COMPLETIONS, _encode, "c")
            assert (request.custom_id, request.prompt) == ("c", Tokens(ids))

    @pytest.mark.parametrize("prompt, message", [
        ("", "prompt: empty; give some text"),
        ([1, True], "prompt: must be a string or a list of token ids (one prompt per request; "
                    "send several prompts as several requests or as a batch)"),
        ([1, 2**63], "prompt[1]: token id 9223372036854775808 is outside the vocabulary"),
    ])
    def test_a_prompt_that_is_neither_is_named(self, prompt, message):
        assert _refusal(lambda: shapes.request_of({"prompt": prompt}, COMPLETIONS,
                                                  _encode))[1] == message

    def test_a_body_that_is_not_an_object_or_messages_that_are_not_objects_are_named(self):
        assert _refusal(lambda: shapes.request_of([], CHAT, _encode)) == (
            "body", "body: must be a JSON object")
        assert _refusal(lambda: shapes.request_of({"messages": ["hi"]}, CHAT, _encode))[0] == (
            "messages")

    def test_the_model_must_be_the_served_one(self):
        shapes.check_model({"model": "llama"}, "llama")
        assert _refusal(lambda: shapes.check_model({"model": "gpt"}, "llama"))[1] == (
            "model: unknown model 'gpt'; this cluster serves 'llama' (GET /v1/models)")


RESULT = StoredResult(0, "q1", "req-7", True, text="hi", output_tokens=(4, 5, 6),
                      finish_reason="length", prompt_tokens=10, cached_tokens=8)


class TestResults:
    def test_usage_counts_the_output_and_the_cached_prompt(self):
        usage = shapes.usage(RESULT)
        assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens",
                                      "prompt_tokens_details")} == {
            "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 8}}

    def test_ids_say_which_endpoint_answered(self):
        assert shapes.completion_id(CHAT, "r1") == "chatcmpl-r1"
        assert shapes.completion_id(COMPLETIONS, "r1") == "cmpl-r1"

    def test_a_failed_request_is_an_error_line_without_a_response(self):
        failed = StoredResult(2, "q3", "req-9", False, error_code="INVALID_ARGUMENT",
                              error_message="prompt too long")
        assert shapes.batch_output_line(CHAT, failed, "llama", 0, shapes.Outputs(list)) == {
            "id": "batch_req_req-9", "custom_id": "q3", "response": None,
            "error": {"code": "INVALID_ARGUMENT", "message": "prompt too long"}}

    def test_an_answered_request_is_a_200_line_holding_the_completion(self):
        out = shapes.batch_output_line(CHAT, RESULT, "llama", 50, shapes.Outputs(list))
        assert (out["error"], out["response"]["status_code"],
                out["response"]["request_id"]) == (None, 200, "req-7")
        body = out["response"]["body"]
        assert (body["id"], body["object"], body["created"], body["model"]) == (
            "chatcmpl-req-7", "chat.completion", 50, "llama")
        assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                    "message": {"role": "assistant", "content": "hi"}}]


def _chat_line(custom_id: str, **line) -> str:
    return json.dumps({"custom_id": custom_id, "body": {
        "model": "llama", "messages": [{"role": "user", "content": "hi"}]}, **line})


class TestBatchInput:
    def test_blank_lines_are_skipped_and_each_request_keeps_its_line(self):
        batch = shapes.batch_requests([_chat_line("a"), "  ", _chat_line("b")], CHAT, _encode,
                                      "llama")
        assert [r.custom_id for r in batch.requests] == ["a", "b"]
        assert batch.lines == [1, 3]

    def test_a_validation_error_about_a_request_is_retold_on_its_line(self):
        batch = shapes.BatchInput([], [1, 3])
        retold = batch.on_line(FieldError("requests[1].messages[0].role", "unknown role"))
        assert (retold.field, str(retold)) == ("line 3.messages[0].role",
                                               "line 3.messages[0].role: unknown role")
        beyond = FieldError("requests[2].x", "y")
        assert batch.on_line(beyond) is beyond

    @pytest.mark.parametrize("lines, field", [
        (["", " "], "input_file_id"),
        (["[1]"], "line 1"),
        ([_chat_line("")], "line 1.custom_id"),
        ([_chat_line("a", url="/v1/completions")], "line 1.url"),
        ([_chat_line("a", method="GET")], "line 1.url"),
        ([_chat_line("a"), '{"custom_id": "b", "body": {"model": "gpt"}}'], "line 2.body.model"),
    ])
    def test_a_bad_line_is_named_by_its_number(self, lines, field):
        assert _refusal(lambda: shapes.batch_requests(lines, CHAT, _encode, "llama"))[0] == field


@pytest.fixture(scope="module")
def api_httpinput(tmp_path_factory):
    with http_frontend(tmp_path_factory, INPUT_CONFIG) as harness:
        yield harness


class TestOverHttp:
    @pytest.mark.parametrize("fields, param, message", [
        ({"max_tokens": 10**12}, "max_tokens",
         "max_tokens: must be at most 2147483647, got 1000000000000"),
        ({"max_tokens": None, "max_completion_tokens": 2**31}, "max_completion_tokens",
         "max_completion_tokens: must be at most 2147483647, got 2147483648"),
        ({"max_tokens": -10**12}, "max_tokens", "max_tokens: must be >= 1, got -1000000000000"),
        ({"seed": 2**70}, "seed", "seed: must be at most 18446744073709551615, got "
                                  "1180591620717411303424"),
        ({"temperature": 10**400}, "temperature",
         f"temperature: must be a finite number, got {str(10**400)[:64]}... (401 characters)"),
        ({"top_p": -10**400}, "top_p",
         f"top_p: must be a finite number, got {str(-10**400)[:64]}... (402 characters)"),
    ])
    def test_numbers_out_of_range_name_the_field(self, api_httpinput, fields, param, message):
        assert chat(api_httpinput, **fields) == (400, refused(400, param, message))

    def test_token_ids_out_of_range_name_the_field(self, api_httpinput):
        body = json.dumps({"model": "llama", "prompt": [1, 2**70], "max_tokens": 1})
        assert post(api_httpinput, "/v1/completions", body) == (400, refused(
            400, "prompt[1]", "prompt[1]: token id 1180591620717411303424 is outside the vocabulary"))

    @pytest.mark.parametrize("model, shown", [("gpt-4o", "'gpt-4o'"), (None, "None")])
    def test_a_batch_line_for_another_model_is_refused_as_chat_is(self, api_httpinput, model, shown):
        line = batch_line(1, model=model)
        if model is None:
            del line["body"]["model"]
        file_id = upload(api_httpinput, [batch_line(0), line])
        assert create_batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.body.model", f"line 2.body.model: unknown model {shown}; this cluster "
            "serves 'llama' (GET /v1/models)"))
        status, answer = chat(api_httpinput, model=model)
        assert (status, answer["error"]["message"]) == (
            400, f"model: unknown model {shown}; this cluster serves 'llama' (GET /v1/models)")

    def test_a_batch_line_protobuf_cannot_hold_names_the_line_and_field(self, api_httpinput):
        file_id = upload(api_httpinput, [batch_line(0), batch_line(1, stop=["\ud800"]),
                                         batch_line(2)])
        assert create_batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.body.stop[0]", f"line 2.body.stop[0]: not Unicode text ({LONE.format(0)}); "
            f"{ADVICE}"))
        file_id = upload(api_httpinput, [batch_line(0), batch_line(1, max_tokens=2**40)])
        assert create_batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.body.max_tokens", "line 2.body.max_tokens: must be at most 2147483647, got "
            "1099511627776"))
