"""Tool calls (``cluster.api.tool_calls``): requests checked field by field, calls cut out of the
model's text by its own parser, and ``required`` / a named function enforced by a grammar
whose every output is a call of an offered function with valid arguments.

Tool calls on the chat endpoint, through the real ``openai`` SDK: calls parsed into
``message.tool_calls``, ``required`` and a named function enforced, a three-turn tool loop whose
prefix is read from the cache, streamed calls, and refusals (a model whose template renders no
tools, tools beside a response format, malformed history). A real frontend over a LocalBackend
serving the forged model with a tool-rendering template.
"""
from __future__ import annotations

import json
import random
import jsonschema
import numpy as np
import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.api.tool_calls import ToolCall, ToolFormat, ToolRequest, parse_request
from cluster.api.validate import FieldError
from tests.support.forged_models import tiny_model
from workers.engine.constraints import Grammars
from workers.model.model_dir import open_model_dir
import openai
from tests.support.frontend_harness import ACME_CONFIG, running_frontend


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


MODEL = "llama-tools"

WEATHER_HTTPTOOLS = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}

ADD_HTTPTOOLS = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_HTTPTOOLS, ADD_HTTPTOOLS)}

SYSTEM = "You are a helpful assistant. Call a tool when a tool can answer. " * 3

USER = [{"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]

def _client(harness) -> openai.OpenAI:
    address = json.loads((harness.config.run_dir / "frontend.json").read_text())["http_address"]
    return openai.OpenAI(base_url=f"{address}/v1", api_key="key-acme", max_retries=0)

@pytest.fixture(scope="module")
def client(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(template="tools"), workers=1) as harness:
        yield _client(harness)

def ask(client, messages=USER, **params):
    return client.chat.completions.create(
        model=MODEL, messages=messages,
        **{"tools": [WEATHER_HTTPTOOLS, ADD_HTTPTOOLS], "max_tokens": 60, "temperature": 0,
           "parallel_tool_calls": False, **params})

def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


class TestHttpTools:
    def test_required_makes_one_call_parsed_into_tool_calls(self, client):
        answer = ask(client, tool_choice="required")
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        _valid(call)

    def test_a_named_function_is_the_one_called(self, client):
        for name in ("add", "get_weather"):
            answer = ask(client, tool_choice={"type": "function", "function": {"name": name}})
            (call,) = answer.choices[0].message.tool_calls
            assert call.function.name == name
            _valid(call)

    def test_auto_and_none_answer_text_when_no_call_is_written(self, client):
        for choice in ("auto", "none"):
            answer = ask(client, tool_choice=choice, max_tokens=8)
            assert answer.choices[0].message.tool_calls is None
            assert answer.choices[0].finish_reason == "length"
            assert isinstance(answer.choices[0].message.content, str)
        # the tools are rendered into the prompt either way
        with_tools = ask(client, tool_choice="none", max_tokens=1).usage.prompt_tokens
        without = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
        assert with_tools > without.usage.prompt_tokens

    def test_a_streamed_call_comes_whole_before_the_finish(self, client):
        whole = ask(client, tool_choice="required")
        chunks = list(ask(client, tool_choice="required", stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        calls = [c for chunk in chunks if chunk.choices
                 for c in chunk.choices[0].delta.tool_calls or ()]
        (call,) = calls
        assert call.index == 0
        want = whole.choices[0].message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        assert (call.function.name, call.function.arguments) == (want.function.name,
                                                                 want.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

    def test_a_three_turn_tool_loop_reads_its_prefix_from_the_cache(self, client):
        messages = list(USER)
        cached, prompts = [], []
        for turn, choice in enumerate(("required", "required", "none")):
            answer = ask(client, messages=messages, tool_choice=choice, max_tokens=60 if turn < 2
                         else 4)
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            prompts.append(answer.usage.prompt_tokens)
            if turn == 2:
                assert answer.choices[0].message.tool_calls is None
                break
            (call,) = answer.choices[0].message.tool_calls
            _valid(call)
            messages += [{"role": "assistant", "content": None,
                          "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"result": f"answer {turn}"})}]
        assert prompts[0] < prompts[1] < prompts[2]
        assert 0 < cached[1] < cached[2]  # each turn reads the previous turns' prompt back
        assert cached[1] >= prompts[0] - 16 and cached[2] >= prompts[1] - 16  # all but a block

    def test_tools_beside_a_response_format_are_refused(self, client):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, response_format={"type": "json_object"})
        assert caught.value.body["param"] == "response_format"
        verdict = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                   "additionalProperties": False}
        answer = ask(client, tool_choice="none", response_format={  # no call asked: no conflict
            "type": "json_schema", "json_schema": {"name": "verdict", "schema": verdict}})
        jsonschema.validate(json.loads(answer.choices[0].message.content), verdict)

    @pytest.mark.parametrize("history, param", [
        ([{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}],
         "messages[0].tool_calls"),
        ([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}],
         "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "assistant", "content": None, "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x", "name": "bob"}], "messages[0].name"),
        ([{"role": "tool", "content": None, "tool_call_id": "c"}], "messages[0].content"),
    ])
    def test_malformed_tool_history_is_refused_naming_the_field(self, client, history, param):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, messages=USER + history)
        assert caught.value.body["param"] == param.replace("[0]", f"[{len(USER)}]", 1)

    def test_tools_are_refused_for_a_model_whose_template_renders_none(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(ACME_CONFIG)
        with running_frontend(tmp_path, tiny_model(), workers=1) as harness:
            plain = _client(harness)
            with pytest.raises(openai.BadRequestError) as caught:
                plain.chat.completions.create(model="llama", messages=USER, tools=[WEATHER_HTTPTOOLS])
            assert caught.value.body["param"] == "tools"
            assert "model 'llama' has no tool calling" in caught.value.body["message"]
            assert plain.chat.completions.create(model="llama", messages=USER, max_tokens=1,
                                                 tool_choice="none").choices[0].message.content \
                is not None
