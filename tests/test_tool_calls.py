"""Tool calls (``cluster.api.tool_calls``): requests checked field by field, calls cut out of the
model's text by its own parser, and ``required`` / a named function enforced by a grammar
whose every output is a call of an offered function with valid arguments."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.api.tool_calls import ToolCall, ToolFormat, ToolRequest, parse_request
from cluster.api.validate import FieldError
from tests.forged_models import tiny_model
from workers.engine.constraints import Grammars
from workers.model.model_dir import open_model_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_model():
    path = tiny_model(template="tools")
    loaded = open_model_dir(path)
    tok = loaded.tokenizer
    return ToolFormat.of(path, "tiny-tools"), Grammars(tok._tokenizer, 32000, tok.eos_token_ids), tok


class TestRequests:
    def test_no_tools_is_none_and_a_choice_without_tools_is_refused(self):
        assert parse_request({}) is None
        assert parse_request({"tool_choice": "none"}) is None
        with pytest.raises(FieldError, match="tool_choice: needs tools"):
            parse_request({"tool_choice": "required"})

    def test_choices(self):
        assert parse_request({"tools": [WEATHER]}) == ToolRequest((WEATHER,), "auto", "", True)
        named = parse_request({"tools": [WEATHER, ADD], "parallel_tool_calls": False,
                               "tool_choice": {"type": "function", "function": {"name": "add"}}})
        assert (named.choice, named.name, named.parallel) == ("function", "add", False)

    @pytest.mark.parametrize("body, field", [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]},
         "tools[0].function.colour"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ])
    def test_each_malformed_field_is_named(self, body, field):
        with pytest.raises(FieldError) as info:
            parse_request(body)
        assert str(info.value).startswith(f"{field}: ")


class TestFormats:
    def test_a_template_without_tools_has_no_format(self):
        assert ToolFormat.of(tiny_model(), "tiny") is None

    def test_calls_are_cut_out_of_the_text(self, tools_model):
        fmt, _, _ = tools_model
        request = parse_request({"tools": [WEATHER, ADD]})
        text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
                '"Paris"}}\n</tool_call><tool_call>\n{"name": "add", "arguments": {"a": 1, '
                '"b": 2}}\n</tool_call>')
        content, calls = fmt.parse(text, request, "call_r1")
        assert content == "Let me check."
        assert calls == [ToolCall("call_r1_0", "get_weather", '{"city": "Paris"}'),
                         ToolCall("call_r1_1", "add", '{"a": 1, "b": 2}')]

    def test_malformed_or_unknown_calls_stay_text_and_none_parses_nothing(self, tools_model):
        fmt, _, _ = tools_model
        request = parse_request({"tools": [WEATHER]})
        bad = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call> and <tool_call>{oops</tool_call>'
        assert fmt.parse(bad, request, "c") == (bad, [])
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        assert fmt.parse(call, parse_request({"tools": [WEATHER], "tool_choice": "none"}),
                         "c") == (call, [])

    @pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True),
                                                  ("add", False)])
    def test_enforced_calls_always_parse_and_validate(self, tools_model, choice, parallel):
        fmt, grammars, tok = tools_model
        tool_choice = choice if choice == "required" else {
            "type": "function", "function": {"name": choice}}
        request = parse_request({"tools": [WEATHER, ADD], "tool_choice": tool_choice,
                                 "parallel_tool_calls": parallel})
        constraint_format = fmt.grammar(request)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
        for seed in range(4):
            c, rng, out = grammars.constraint(constraint_format), random.Random(seed), []
            for _ in range(400):
                allowed = np.nonzero(c.allowed())[0].tolist()
                ends = [t for t in allowed if t in grammars.eos_ids]
                token = ends[0] if ends and rng.random() < 0.7 else rng.choice(allowed)
                c.accept(token)
                if token in grammars.eos_ids:
                    break
                out.append(token)
            else:
                pytest.fail("the walk did not end")
            content, calls = fmt.parse(tok.decode(out), request, "c")
            assert content == "" and calls and (parallel or len(calls) == 1)
            for call in calls:
                assert choice == "required" or call.name == choice
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])

    def test_auto_and_none_impose_no_grammar(self, tools_model):
        fmt, _, _ = tools_model
        assert fmt.grammar(parse_request({"tools": [WEATHER]})) is None
        assert fmt.grammar(parse_request({"tools": [WEATHER], "tool_choice": "none"})) is None
