"""The edges' typed request (``cluster.api.incoming``): an HTTP body and the gRPC message that
asks the same thing become the same ``RequestIn``; protobuf round-trips through it; its floats
are what the gRPC fields hold. Plain values, no server."""
from __future__ import annotations

import math

import pytest

from cluster.api import openai_shapes as shapes
from cluster.api import validate
from cluster.api.client import chat_request, token_request
from cluster.api.convert import request_from_pb, request_to_pb
from cluster.api.incoming import (ABSENT, MessageIn, Messages, RequestIn, SamplingIn, Tokens,
                                  single)
from proto.orchard.v1 import orchard_pb2 as pb

USER = [{"role": "user", "content": "Hi"}]


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_chat_body_and_its_grpc_message_are_the_same_request():
    body = {"model": "m", "messages": USER + [{"role": "assistant", "content": [
        {"type": "text", "text": "a"}]}], "max_tokens": 7, "temperature": 0.7, "top_p": 0.9,
        "seed": 3, "stop": "END"}
    grpc = chat_request("", body["messages"], 7, temperature=0.7, top_p=0.9, seed=3,
                        stop=["END"])
    assert shapes.request_of(body, shapes.CHAT, _encode) == request_from_pb(grpc)
    assert request_from_pb(grpc).sampling == SamplingIn(7, single(0.7), single(0.9), 3, ("END",))
    assert single(0.7) == 0.699999988079071  # single precision, as the gRPC field holds it


def test_a_completion_body_and_its_grpc_message_are_the_same_request():
    body = {"model": "m", "prompt": "Hi", "max_tokens": 2}
    grpc = token_request("", _encode("Hi"), 2, temperature=1.0)
    assert shapes.request_of(body, shapes.COMPLETIONS, _encode) == request_from_pb(grpc) == (
        RequestIn("", Tokens((72, 105)), SamplingIn(max_tokens=2, temperature=1.0)))


@pytest.mark.parametrize("request_pb", [
    chat_request("a", USER, 3, stop=["x", "y"], top_p=0.5),
    chat_request("b", [{"role": "user", "content": [{"type": "text", "text": "t"}, 5, None]}], 1),
    pb.Request(custom_id="c", messages=pb.Messages(messages=[pb.ChatMessage(role="user")])),
    pb.Request(custom_id="d", messages=pb.Messages()),
    token_request("e", [], 1),
    pb.Request(custom_id="f"),
])
def test_protobuf_round_trips_through_the_typed_request(request_pb):
    assert request_to_pb(request_from_pb(request_pb)) == request_pb


def test_what_protobuf_leaves_unset_reads_as_missing_and_json_null_as_null():
    unset = request_from_pb(pb.Request(messages=pb.Messages(messages=[
        pb.ChatMessage(role="user")])))
    assert unset.prompt == Messages((MessageIn("user", ABSENT),))
    assert request_from_pb(pb.Request()).prompt is None
    for content, kind in ((ABSENT, "missing"), (None, "null"), (True, "a boolean"),
                          (5, "a number"), ({"type": "text"}, "an object")):
        with pytest.raises(validate.FieldError) as err:
            validate.messages_to_dicts([MessageIn("user", content)], "m")
        assert str(err.value) == f"m[0].content: must be a string (or a list of text parts), got {kind}"


@pytest.mark.parametrize("value", [0.1, -0.0, 1e-46, 3.4028235e38, 3.4028236e38, -1e39, 1e300,
                                   math.inf, 7])
def test_single_is_what_a_protobuf_float_field_holds(value):
    assert single(value) == pb.SamplingParams(temperature=value).temperature
    with pytest.raises(OverflowError):
        pb.SamplingParams(temperature=10**400)
    with pytest.raises(OverflowError):
        single(10**400)
