"""``cluster.api.http_app``: the OpenAI-compatible HTTP API end to end, with the real ``openai``
SDK as the client: a real frontend over a LocalBackend (real engines and router), gRPC beside
it on the same loop. The served model listed, chat and completions (streamed or not, usage
and cached tokens as gRPC reports them), each request one trace; and structured outputs,
each ``response_format`` kind (the SDK's ``parse`` with a Pydantic model included), a schema
that cannot compile refused naming its path, over HTTP and over gRPC.
"""
import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from cluster.api.client import OrchardError, chat_request
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import running_frontend
from tests.support.http_api import CONFIG, http_frontend, messages, sdk
from tests.support.http_api import acme, model  # noqa: F401  (fixtures)
from tests.support.structured_outputs import tools_api  # noqa: F401  (a fixture)
from tests.support.structured_outputs import (BROKEN, BROKEN_FORMAT, BROKEN_PATH, MODEL, PET,
                                              PET_FORMAT, USER, chat, sdk_client)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with http_frontend(tmp_path_factory, CONFIG, workers=2) as harness:
        yield harness




class TestHttpApi:
    def test_models_lists_the_served_model(self, api, acme):
        listed = acme.models.list().data
        assert [m.id for m in listed] == ["llama"]
        assert acme.models.retrieve("llama").owned_by == "orchard"

    def test_same_prompt_through_http_and_grpc_gives_the_same_tokens_and_cached_counts(self, 
            api, acme, model):
        prompt = messages("Name three rivers of Europe.")
        with api.client("acme") as grpc_client:
            def through_grpc():
                events = list(grpc_client.generate(chat_request("", prompt, 6)))
                return events[-1].result

            first = through_grpc()  # cold: nothing cached
            http = acme.chat.completions.create(model=model, messages=prompt, max_tokens=6,
                                                temperature=0)
            again = through_grpc()  # warm, as the HTTP request was
        assert first.usage.cached_tokens == 0
        assert http.choices[0].message.content == first.text == again.text
        assert http.usage.completion_tokens == len(first.output_tokens) == 6
        assert http.usage.prompt_tokens == first.usage.prompt_tokens
        cached = http.usage.prompt_tokens_details.cached_tokens
        assert cached == again.usage.cached_tokens
        assert cached == first.usage.prompt_tokens - 1  # all but the last token: kept, then taken
        assert http.choices[0].finish_reason == "length" and http.object == "chat.completion"

    def test_streamed_chat_with_usage_matches_the_unstreamed_answer(self, acme, model):
        prompt = messages("Say something about the sea.")
        whole = acme.chat.completions.create(model=model, messages=prompt, max_tokens=5,
                                             temperature=0)
        chunks = list(acme.chat.completions.create(
            model=model, messages=prompt, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        prompt_tokens = whole.usage.prompt_tokens  # the same prompt, again: all but its last token
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1
        assert all(c.usage is None for c in chunks[:-1])

    def test_streamed_chat_without_usage_has_no_usage_chunk(self, acme, model):
        chunks = list(acme.chat.completions.create(model=model, messages=messages("Hi"),
                                                   max_tokens=3, temperature=0, stream=True))
        assert all(c.choices and c.usage is None for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"

    def test_completion_from_text_and_from_token_ids(self, acme, model):
        text = acme.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                       temperature=0)
        assert text.object == "text_completion" and text.usage.completion_tokens == 4
        streamed = list(acme.completions.create(model=model, prompt="Once upon a time",
                                                max_tokens=4, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
        ids = acme.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=2,
                                      temperature=0)
        assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 2

    def test_each_http_request_is_one_trace_rooted_at_its_request(self, tmp_path):
        from cluster.telemetry.attrs import REQUEST_ID
        from cluster.telemetry.otlp_json import read_spans
        from tests.support.frontend_harness import ACME_CONFIG

        run_dir = tmp_path / "run"
        run_dir.mkdir(mode=0o700)
        (run_dir / "orchard.toml").write_text(ACME_CONFIG)
        with running_frontend(run_dir, tiny_model(), workers=1) as harness:
            client = sdk(harness)
            plain = client.chat.completions.create(model="llama", messages=messages("a"),
                                                   max_tokens=2)
            caller = f"00-{'ab' * 16}-{'cd' * 8}-01"
            child = client.chat.completions.create(model="llama", messages=messages("b"),
                                                   max_tokens=2, extra_headers={"traceparent": caller})
        spans = read_spans(run_dir / "traces").spans

        def request_span(reply):
            request_id = reply.id.removeprefix("chatcmpl-")
            (span,) = [s for s in spans if s.attributes.get("orchard.span") == "request"
                       and s.attributes.get(REQUEST_ID) == request_id]
            return span

        root = request_span(plain)
        assert not root.parent_span_id  # the HTTP request is the root of its own trace
        inside = [s for s in spans if s.trace_id == root.trace_id]
        assert len(inside) > 1 and all(s.trace_id != request_span(child).trace_id for s in inside)
        assert request_span(child).trace_id == "ab" * 16
        assert request_span(child).parent_span_id == "cd" * 8


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=9)




class TestResponseFormats:
    """Against a model whose chat template renders tools (one real engine)."""

    @pytest.fixture
    def api(self, tools_api):
        return tools_api

    @pytest.fixture
    def client(self, tools_api) -> openai.OpenAI:
        return sdk_client(tools_api)

    def test_text_is_free_text_as_without_a_format(self, client):
        free = chat(client, max_tokens=8)
        text = chat(client, max_tokens=8, response_format={"type": "text"})
        assert text.choices[0].message.content == free.choices[0].message.content

    def test_json_object_answers_are_objects_streamed_or_not(self, client):
        answer = chat(client, response_format={"type": "json_object"})
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
        streamed = chat(client, response_format={"type": "json_object"}, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == answer.choices[0].message.content

    def test_json_schema_answers_validate_streamed_or_not(self, client):
        for seed in range(3):  # sampled as well as greedy
            answer = chat(client, response_format=PET_FORMAT, temperature=1.0, seed=seed)
            assert answer.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(answer.choices[0].message.content), PET)
        streamed = chat(client, response_format=PET_FORMAT, stream=True)
        jsonschema.validate(json.loads("".join(
            c.choices[0].delta.content or "" for c in streamed if c.choices)), PET)

    def test_the_sdk_parses_into_a_pydantic_model(self, client):
        completions = client.chat.completions
        parse = completions.parse if hasattr(completions, "parse") else (
            client.beta.chat.completions.parse)
        answer = parse(model=MODEL, messages=USER, max_tokens=40, temperature=0,
                       response_format=Pet)
        pet = answer.choices[0].message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.legs <= 9

    def test_a_completion_takes_a_format_too(self, client):
        answer = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=40,
                                           temperature=0, extra_body={"response_format": PET_FORMAT})
        jsonschema.validate(json.loads(answer.choices[0].text), PET)

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_schema_that_cannot_compile_is_refused_naming_its_path(self, client, stream):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, response_format=BROKEN_FORMAT, stream=stream)
        assert caught.value.body["param"] == BROKEN_PATH
        assert caught.value.body["message"].startswith(f"body.{BROKEN_PATH}: ")
        assert "frobnicate" in caught.value.body["message"]

    @pytest.mark.parametrize("fmt, param", [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": PET}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": PET, "description": "d"}},
         "response_format.json_schema.description"),
        ({"type": "json_object", "schema": PET}, "response_format.schema"),
        ("json", "response_format"),
    ])
    def test_a_malformed_format_names_its_field(self, client, fmt, param):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, response_format=fmt)
        assert caught.value.body["param"] == param

    def test_over_grpc_generate_the_same_format_and_refusal(self, api):
        request = chat_request("", USER, 40)
        request.response_format.type = "json_schema"
        request.response_format.json_schema.name = "pet"
        request.response_format.json_schema.schema.update(PET)  # numbers become doubles
        with api.client("acme") as grpc_client:
            result = list(grpc_client.generate(request))[-1].result
            jsonschema.validate(json.loads(result.text), PET)
            request.response_format.json_schema.schema.Clear()
            request.response_format.json_schema.schema.update(BROKEN)
            with pytest.raises(OrchardError) as caught:
                list(grpc_client.generate(request))
        assert caught.value.code == "INVALID_ARGUMENT"
        assert caught.value.message.startswith(f"request.{BROKEN_PATH}: ")
