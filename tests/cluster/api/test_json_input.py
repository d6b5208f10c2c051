"""JSON from callers held to what protobuf holds (``cluster.api.json_input.loads``): nesting
within ``MAX_NESTING``, no lone surrogate, UTF-8 only; each refusal says where and why."""
from __future__ import annotations

import pytest

from cluster.api.json_input import KEY_CHARS, MAX_NESTING, JsonInputError, loads


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
