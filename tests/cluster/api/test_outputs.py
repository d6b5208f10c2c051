"""Structured outputs and log-probabilities over the HTTP API, through the real ``openai`` SDK:
each ``response_format`` kind (the SDK's ``parse`` with a Pydantic model included), a schema
that cannot compile refused at submission naming its path, log-probabilities of chat and
completions (shape, count, order; streamed chunk by chunk), and a Batch API job of JSON
schema lines whose outputs validate. A real frontend over a LocalBackend (real engines).

The output halves as plain values, no server: a response format through protobuf and back, a
streamed chunk's log-probabilities on the worker stream, and the field table's neutral values
(log-probabilities' two shapes: tests/cluster/api/test_openai_logprobs.py; stored results:
tests/cluster/jobs/test_records.py).
"""
from __future__ import annotations

import io
import json
import time
from typing import Literal
import jsonschema
import openai
import pydantic
import pytest
from cluster.api.client import OrchardError, chat_request
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
from cluster.api import openai_fields, validate
from cluster.api.convert import request_from_pb, request_to_pb
from cluster.api.incoming import Messages, MessageIn, RequestIn, SamplingIn
from cluster.backend import wire
from cluster.backend.protocol import TokenChunk
from workers.messages import ResponseFormat, TokenLogprob


MODEL = "llama-tools"

USER = [{"role": "user", "content": "Describe a pet as JSON."}]

PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["kind", "legs"], "additionalProperties": False}

PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET,
                                                     "strict": True}}

# llguidance knows no type "frobnicate": refused at submission, naming where it is
BROKEN = {"type": "object", "properties": {"a": {"type": "object", "properties": {
    "b": {"type": "frobnicate"}}}}}

BROKEN_PATH = "response_format.json_schema.schema.properties.a.properties.b"

BROKEN_FORMAT = {"type": "json_schema", "json_schema": {"name": "broken", "schema": BROKEN}}

class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=9)

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(template="tools"), workers=1) as harness:
        yield harness

@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    address = json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]
    return openai.OpenAI(base_url=f"{address}/v1", api_key="key-acme", max_retries=0)

def chat(client, **params):
    return client.chat.completions.create(model=MODEL, messages=USER,
                                          **{"max_tokens": 40, "temperature": 0, **params})

class TestResponseFormats:
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

class TestLogprobs:
    def test_chat_content_entries_one_per_token_with_alternatives_most_likely_first(self, client):
        answer = chat(client, max_tokens=6, logprobs=True, top_logprobs=5)
        entries = answer.choices[0].logprobs.content
        assert len(entries) == answer.usage.completion_tokens == 6
        for entry in entries:
            assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
            tops = entry.top_logprobs
            assert len(tops) == 5
            values = [t.logprob for t in tops]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            # greedy: the token drawn is the likeliest
            assert (tops[0].token, tops[0].logprob) == (entry.token, entry.logprob)
        text = b"".join(bytes(e.bytes) for e in entries).decode(errors="replace")
        assert text.strip() == answer.choices[0].message.content.strip()

    def test_no_alternatives_and_none_unless_asked(self, client):
        answer = chat(client, max_tokens=3, logprobs=True, top_logprobs=0)
        assert [e.top_logprobs for e in answer.choices[0].logprobs.content] == [[], [], []]
        assert chat(client, max_tokens=3).choices[0].logprobs is None
        assert chat(client, max_tokens=3, logprobs=False).choices[0].logprobs is None

    def test_a_constrained_answer_has_the_models_values_before_the_mask(self, client):
        answer = chat(client, response_format=PET_FORMAT, logprobs=True, top_logprobs=20)
        entries = answer.choices[0].logprobs.content
        assert len(entries) == answer.usage.completion_tokens
        # the first token opens the object because of the grammar, not because the model likes
        # it best: greedy drew it, and the model's own likeliest token is another
        assert entries[0].token.startswith("{")
        assert entries[0].logprob < entries[0].top_logprobs[0].logprob

    def test_streamed_chunks_carry_their_tokens_logprobs(self, client):
        whole = chat(client, max_tokens=6, logprobs=True, top_logprobs=2)
        chunks = list(chat(client, max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert streamed == whole.choices[0].logprobs.content

    def test_completions_legacy_shape(self, client):
        answer = client.completions.create(model=MODEL, prompt="Once upon a time",
                                           max_tokens=6, temperature=0, logprobs=3)
        choice = answer.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
            lp.text_offset) == answer.usage.completion_tokens == 6
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert 1 <= len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
            assert max(top.values()) == value and top[token] == value  # greedy
        offsets = lp.text_offset
        assert offsets == sorted(offsets) and offsets[0] == 0
        for i in range(1, len(offsets) - 1):
            assert choice.text[offsets[i]:offsets[i + 1]] == lp.tokens[i]
        streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                                  max_tokens=6, temperature=0, logprobs=3,
                                                  stream=True))
        pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
        assert [t for p in pieces for t in p.tokens] == lp.tokens
        assert [o for p in pieces for o in p.text_offset] == offsets

    @pytest.mark.parametrize("params, param", [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ])
    def test_chat_counts_outside_the_range_are_refused(self, client, params, param):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, **params)
        assert caught.value.body["param"] == param

    def test_completions_refuse_more_than_twenty(self, client):
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                         logprobs=20).choices[0].logprobs.top_logprobs
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=21)
        assert caught.value.body["param"] == "logprobs"

    def test_over_grpc_results_and_deltas_carry_them(self, api, client):
        http = chat(client, max_tokens=4, logprobs=True, top_logprobs=2)
        request = chat_request("", USER, 4, temperature=0)
        request.logprobs, request.top_logprobs = True, 2
        with api.client("acme") as grpc_client:
            events = list(grpc_client.generate(request))
        result = events[-1].result
        deltas = [lp for e in events[:-1] for lp in e.delta.logprobs]
        assert list(result.logprobs) == deltas and len(deltas) == 4
        for entry, want in zip(result.logprobs, http.choices[0].logprobs.content):
            assert list(entry.bytes) == want.bytes and entry.logprob == pytest.approx(
                want.logprob, abs=0)
            assert [list(t.bytes) for t in entry.top_logprobs] == [
                t.bytes for t in want.top_logprobs]

def _batch_file(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())

def _line(i: int, **body) -> dict:
    return {"custom_id": f"pet-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Pet {i}?"}],
                     "max_tokens": 40, "temperature": 1.0, "seed": i, **body}}

class TestBatches:
    def test_a_batch_of_json_schema_lines_whose_outputs_validate(self, client):
        lines = [_line(i, response_format=PET_FORMAT, logprobs=True, top_logprobs=1)
                 for i in range(4)]
        uploaded = client.files.create(file=("pets.jsonl", _batch_file(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
        deadline = time.monotonic() + 120
        while batch.status != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
            batch = client.batches.retrieve(batch.id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 4)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [line["custom_id"] for line in out] == [f"pet-{i}" for i in range(4)]
        for line in out:
            body = line["response"]["body"]
            choice = body["choices"][0]
            jsonschema.validate(json.loads(choice["message"]["content"]), PET)
            entries = choice["logprobs"]["content"]
            assert len(entries) == body["usage"]["completion_tokens"]
            assert all(len(e["top_logprobs"]) == 1 for e in entries)

    def test_a_line_whose_schema_cannot_compile_is_refused_and_nothing_stored(self, api, client):
        lines = [_line(0, response_format=PET_FORMAT), _line(1, response_format=BROKEN_FORMAT)]
        uploaded = client.files.create(file=("bad.jsonl", _batch_file(lines)), purpose="batch")
        with api.client("acme") as grpc_client:
            before = len(grpc_client.jobs())
            with pytest.raises(openai.BadRequestError) as caught:
                client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                      endpoint="/v1/chat/completions")
            assert len(grpc_client.jobs()) == before
        assert caught.value.body["message"].startswith(f"line 2.{BROKEN_PATH}: ")

    @pytest.mark.parametrize("body, param", [
        ({"stream": True}, "line 1.body.stream"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "line 1.body.tools"),
        ({"presence_penalty": 0.5}, "line 1.body.presence_penalty"),
    ])
    def test_a_line_asking_what_a_batch_cannot_do_is_refused(self, client, body, param):
        uploaded = client.files.create(file=("x.jsonl", _batch_file([_line(0, **body)])),
                                       purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                  endpoint="/v1/chat/completions")
        assert caught.value.body["param"] == param


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "score": {"type": "number", "minimum": 0.5}},
          "required": ["name"]}


class TestOutputShapes:
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

    def test_a_streamed_chunks_logprobs_travel_on_the_worker_stream(self):
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
        ("service_tier", "auto", True),  # read: the priority (cluster.api.priority)
        ("user", "u", True), ("user", 5, False),
        ("audio", None, True), ("audio", {}, False),
    ])
    def test_neutral_and_harmless_values(self, field, value, accepted):
        body = {"model": "m", field: value}
        if accepted:
            openai_fields.check_fields(body, openai_fields.CHAT)
        else:
            with pytest.raises(validate.FieldError) as caught:
                openai_fields.check_fields(body, openai_fields.CHAT)
            assert caught.value.field == field
