"""JSON from callers held to what protobuf holds (``cluster.api.json_input.loads``): nesting
within ``MAX_NESTING``, no lone surrogate, UTF-8 only; each refusal says where and why. Then
the same limits end to end, raw bodies to a real frontend over a LocalBackend, and protobuf's
own decoder held to the same nesting limit (the gRPC edge's)."""
from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from cluster.api.json_input import KEY_CHARS, MAX_NESTING, JsonInputError, loads
from tests.support.http_api import (ADVICE, CHAT, INPUT_CONFIG, LONE, chat, http_frontend, post,
                                    refused)


def _refusal(text) -> JsonInputError:
    with pytest.raises(JsonInputError) as refused:
        loads(text)
    return refused.value


class TestParsed:
    def test_ordinary_json_from_text_or_bytes(self):
        body = '{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9"}]}'
        expected = {"model": "m", "messages": [{"role": "user", "content": "hé"}]}
        assert loads(body) == expected
        assert loads(body.encode()) == expected

    def test_a_surrogate_pair_is_one_character(self):
        assert loads('"\\ud83d\\ude00"') == "\U0001F600"

    def test_exactly_max_nesting_levels_are_taken(self):
        assert MAX_NESTING == 100
        deepest = "[" * MAX_NESTING + "]" * MAX_NESTING
        value = loads(deepest)
        for _ in range(MAX_NESTING - 1):
            (value,) = value
        assert value == []


class TestRefused:
    def test_one_level_deeper_than_protobuf_holds(self):
        refusal = _refusal("[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1))
        assert (refusal.path, refusal.reason) == (
            "", "nested deeper than 100 levels of arrays and objects; flatten it")

    def test_nesting_past_pythons_recursion_is_the_same_refusal(self):
        refusal = _refusal('{"a": ' * 100_000 + "1" + "}" * 100_000)
        assert str(refusal) == "nested deeper than 100 levels of arrays and objects; flatten it"

    def test_a_lone_surrogate_is_named_by_its_path_never_quoted(self):
        refusal = _refusal('{"messages": [{"content": "ok"}, {"content": "ab\\ud800"}]}')
        assert refusal.path == "messages[1].content"
        assert refusal.reason == ("not Unicode text (a lone surrogate \\ud800 at character 2); "
                                  "escape a character outside the BMP as a surrogate pair")

    def test_a_lone_surrogate_in_a_key_and_a_long_key_cut_in_the_path(self):
        assert _refusal('{"\\udc00": 1}').path == "(a key)"
        long_key = "k" * (KEY_CHARS + 5)
        refusal = _refusal('{"%s": ["\\udfff"]}' % long_key)
        assert refusal.path == f"{'k' * KEY_CHARS}...[0]"

    def test_bytes_that_are_not_utf8_say_which(self):
        refusal = _refusal(b'{"a": "\xff"}')
        assert str(refusal) == "not UTF-8 text (byte 0xff at offset 7); send UTF-8"

    def test_text_that_is_not_json_says_where(self):
        assert str(_refusal('{"a": }')) == "not valid JSON (Expecting value at column 7)"


@pytest.fixture(scope="module")
def api_httpinput(tmp_path_factory):
    with http_frontend(tmp_path_factory, INPUT_CONFIG) as harness:
        yield harness


def nested(depth: int) -> str:
    """A chat body whose messages list holds lists ``depth`` levels deep, the body included."""
    return '{"model": "llama", "messages": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def _message(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field holding ``payload``."""
    size, length = len(payload), bytearray()
    while True:
        byte, size = size & 0x7F, size >> 7
        length.append(byte | (0x80 if size else 0))
        if not size:
            return bytes([field << 3 | 2]) + bytes(length) + payload


def _nested_values(levels: int) -> bytes:
    """``levels`` messages, each in the one before: Value, ListValue, Value, ... (a Value's
    list_value is field 6, a ListValue's values field 1), serialized from the innermost out."""
    data, top_is_value = b"", True
    for _ in range(levels - 1):
        data = _message(1, data) if top_is_value else _message(6, data)
        top_is_value = not top_is_value
    return data



class TestOverHttp:
    @pytest.mark.parametrize("depth", [MAX_NESTING + 1, 30_000])  # 30,000: past Python's own
    def test_json_nested_past_protobufs_limit_is_refused_400(self, api_httpinput, depth):
        assert post(api_httpinput, CHAT, nested(depth)) == (400, refused(
            400, "body", "body: nested deeper than 100 levels of arrays and objects; flatten it"))

    def test_json_nested_to_the_limit_is_parsed(self, api_httpinput):
        assert post(api_httpinput, CHAT, nested(MAX_NESTING)) == (400, refused(
            400, "messages", "messages: must be a list of {role, content} objects"))

    def test_protobufs_decoder_has_the_same_limit(self):
        """The gRPC edge's limit is protobuf's own: a message holding MAX_NESTING levels of
        messages decodes, one holding one more does not."""
        struct_pb2.Value.FromString(_nested_values(1 + MAX_NESTING))
        with pytest.raises(Exception, match="MaxDepth"):
            struct_pb2.ListValue.FromString(_nested_values(2 + MAX_NESTING))

    @pytest.mark.parametrize("body, param, at", [
        ('{"model": "llama", "messages": [{"role": "user", "content": "hi\\ud800"}]}',
         "messages[0].content", 2),
        ('{"model": "llama", "messages": [{"role": "\\ud800", "content": "hi"}]}',
         "messages[0].role", 0),
        ('{"model": "llama", "messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "\\ud800"}]}]}', "messages[0].content[0].text", 0),
        ('{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stop": '
         '["ok", "\\ud800"]}', "stop[1]", 0),
    ])
    def test_a_lone_surrogate_names_the_field(self, api_httpinput, body, param, at):
        assert post(api_httpinput, CHAT, body) == (400, refused(
            400, param, f"{param}: not Unicode text ({LONE.format(at)}); {ADVICE}"))

    def test_a_surrogate_pair_is_text(self, api_httpinput):
        status, answer = chat(api_httpinput, messages=[{"role": "user", "content": "\U0001F600"}])
        assert status == 200 and answer["usage"]["completion_tokens"] == 1
