"""The output halves as plain values, no server: log-probabilities in OpenAI's two shapes, a
response format through protobuf and back, stored results with log-probabilities, a streamed
chunk's log-probabilities on the worker stream, and the field table's neutral values."""
from __future__ import annotations

import json

import pytest

from cluster.api import openai_fields, validate
from cluster.api.convert import request_from_pb, request_to_pb
from cluster.api.incoming import Messages, MessageIn, RequestIn, SamplingIn
from cluster.api.openai_logprobs import TokenScore, chat_logprobs, completion_logprobs, scores_of
from cluster.backend import wire
from cluster.backend.protocol import TokenChunk
from cluster.jobs.store import StoredResult
from workers.messages import ResponseFormat, TokenLogprob

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "score": {"type": "number", "minimum": 0.5}},
          "required": ["name"]}


def test_scores_read_every_token_and_alternative_in_one_call():
    calls = []

    def token_bytes(ids):
        calls.append(list(ids))
        return [f"<{i}>".encode() for i in ids]

    scores = scores_of([TokenLogprob(1, -0.5, ((1, -0.5), (7, -2.0))), TokenLogprob(3, -1.0)],
                       token_bytes)
    assert calls == [[1, 1, 7, 3]]
    assert scores == [TokenScore(b"<1>", -0.5, ((b"<1>", -0.5), (b"<7>", -2.0))),
                      TokenScore(b"<3>", -1.0)]


def test_the_chat_shape_with_exact_bytes_for_a_split_character():
    euro = "€".encode()  # three bytes, split over two tokens
    scores = [TokenScore(b" a", -0.1, ((b" a", -0.1), (b" b", -3.0))),
              TokenScore(euro[:2], -0.2), TokenScore(euro[2:], -0.3)]
    content = chat_logprobs(scores)["content"]
    assert content[0] == {"token": " a", "logprob": -0.1, "bytes": [32, 97], "top_logprobs": [
        {"token": " a", "logprob": -0.1, "bytes": [32, 97]},
        {"token": " b", "logprob": -3.0, "bytes": [32, 98]}]}
    assert [c["token"] for c in content[1:]] == ["\ufffd", "\ufffd"]
    assert bytes(content[1]["bytes"] + content[2]["bytes"]).decode() == "€"


def test_the_completion_shape_counts_offsets_in_the_answers_text():
    scores = [TokenScore(b" Hello", -1.0, ((b" Hello", -1.0), (b"Hi", -2.0), (b"Hi", -2.5))),
              TokenScore(b" w", -2.0), TokenScore("ör".encode(), -3.0), TokenScore(b"ld", -4.0)]
    shaped = completion_logprobs(scores, text="Hello wörld")  # the leading space dropped
    assert shaped["tokens"] == [" Hello", " w", "ör", "ld"]
    assert shaped["token_logprobs"] == [-1.0, -2.0, -3.0, -4.0]
    assert shaped["top_logprobs"][0] == {" Hello": -1.0, "Hi": -2.0}  # the likelier kept
    assert shaped["text_offset"] == [0, 5, 7, 9]
    assert completion_logprobs(scores[1:], offset=5)["text_offset"] == [5, 7, 9]


def test_a_response_format_and_logprobs_round_trip_through_protobuf():
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


def test_tools_never_reach_a_stored_request():
    request = RequestIn("a", Messages((MessageIn("assistant", None, tool_calls=[]),)),
                        SamplingIn(max_tokens=4))
    with pytest.raises(RuntimeError, match="tool messages do not travel"):
        request_to_pb(request)


def test_stored_results_keep_their_logprobs_and_others_read_as_before():
    scored = StoredResult(0, "a", "r", True, output_tokens=(5, 6), logprobs=(
        TokenLogprob(5, -0.25, ((5, -0.25), (2, -1.5))), TokenLogprob(6, -3.0)))
    assert StoredResult.from_json(4, scored.to_json()) == StoredResult(
        **{**{f: getattr(scored, f) for f in scored.__dataclass_fields__}, "seq": 4})
    plain = StoredResult(1, "b", "r2", True)
    assert "logprobs" not in json.loads(plain.to_json())
    assert StoredResult.from_json(0, plain.to_json()).logprobs == ()


def test_a_streamed_chunks_logprobs_travel_on_the_worker_stream():
    chunk = TokenChunk("r", (4,), "ab", (TokenLogprob(4, -0.5, ((4, -0.5), (1, -0.75))),))
    decoded = wire._unpack(wire.frame(wire.Kind.ITEM, 3, chunk)[4:])
    assert decoded[2] == chunk


@pytest.mark.parametrize("field, value, accepted", [
    ("n", 1, True), ("n", True, False), ("n", 2, False),
    ("presence_penalty", 0.0, True), ("presence_penalty", 0.1, False),
    ("echo", False, True), ("echo", 0, False),
    ("logit_bias", {}, True), ("logit_bias", {"1": 2}, False),
    ("modalities", ["text"], True), ("modalities", ["audio"], False),
    ("store", False, True), ("store", True, False),
    ("service_tier", "auto", True), ("service_tier", "priority", False),
    ("user", "u", True), ("user", 5, False),
    ("audio", None, True), ("audio", {}, False),
])
def test_neutral_and_harmless_values(field, value, accepted):
    body = {"model": "m", field: value}
    if accepted:
        openai_fields.check_fields(body, openai_fields.CHAT)
    else:
        with pytest.raises(validate.FieldError) as caught:
            openai_fields.check_fields(body, openai_fields.CHAT)
        assert caught.value.field == field
