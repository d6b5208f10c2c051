"""Nothing accepted and dropped: every request parameter the ``openai`` SDK knows for chat and
completions (``CompletionCreateParamsBase.__annotations__``, plus ``stream``) is either
implemented, shown by a behaviour check of its own, or refused with a 400 naming it. A field a
newer SDK adds fails here until it is implemented or refused on purpose (orchard refuses every
name it does not read, so the walk passes by refusal, and the list below says so).

Raw JSON bodies (``http.client``), so that no client library's own checks are in the way."""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import jsonschema
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from cluster.api import openai_fields, validate
from cluster.api.openai_fields import NEUTRAL
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend

MODEL = "llama-tools"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Tell me about rivers and mountains."}]
BASE = {CHAT: {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0},
        COMPLETIONS: {"model": MODEL, "prompt": "Rivers and mountains", "max_tokens": 6,
                      "temperature": 0}}
SDK_FIELDS = {CHAT: set(chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"},
              COMPLETIONS: set(completion_params.CompletionCreateParamsBase.__annotations__)
              | {"stream"}}
# a value that asks for something, for fields where the generic one would not say much
SAMPLES = {"n": 2, "best_of": 2, "echo": True, "suffix": " the end", "presence_penalty": 0.5,
           "frequency_penalty": -0.5, "logit_bias": {"5": 10}, "modalities": ["text", "audio"],
           "audio": {"voice": "alloy", "format": "mp3"}, "functions": [{"name": "f"}],
           "function_call": "auto", "reasoning_effort": "low", "verbosity": "low",
           "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
           "safety_identifier": "u1", "store": True,
           "service_tier": "flex"}
GENERIC = {"orchard-test": 1}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"], "additionalProperties": False}}}


@dataclass(frozen=True)
class Response:
    status_code: int
    content_type: str
    text: str

    def json(self):
        return json.loads(self.text)


@pytest.fixture(scope="module")
def post(tmp_path_factory):
    """``post(endpoint, **fields)``: the endpoint's base body with ``fields`` over it (None
    sends null)."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(template="tools"), workers=1) as harness:
        url = urlsplit(json.loads((run_dir / "frontend.json").read_text())["http_address"])

        def send(endpoint: str, **fields) -> Response:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            try:
                conn.request("POST", endpoint, body=json.dumps({**BASE[endpoint], **fields}),
                             headers={"authorization": "Bearer key-acme",
                                      "content-type": "application/json"})
                answer = conn.getresponse()
                return Response(answer.status, answer.getheader("content-type", ""),
                                answer.read().decode())
            finally:
                conn.close()
        yield send


def ok(response: Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def refused(response: Response, field: str) -> str:
    """The refusal's message; it names ``field`` (or a part of it: ``metadata.team``)."""
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    param = error["param"]
    assert param == field or param.startswith(f"{field}."), error
    assert error["message"].startswith(f"{param}: "), error
    return error["message"]


def events(response: Response) -> list[dict]:
    assert response.content_type.startswith("text/event-stream")
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ------------------------------------------------------------------ behaviour checks

def _model(post, e):
    ok(post(e))
    refused(post(e, model="gpt-4o"), "model")


def _prompt(post, e):
    key = "messages" if e == CHAT else "prompt"
    other = [{"role": "user", "content": "Hi"}] if e == CHAT else "Hi"
    assert ok(post(e, **{key: other}))["usage"]["prompt_tokens"] < ok(post(e))["usage"][
        "prompt_tokens"]


def _max_tokens(field):
    def check(post, e):
        for n in (1, 4):
            body = {"max_tokens": None, field: n} if field != "max_tokens" else {field: n}
        assert ok(post(e, **body))["usage"]["completion_tokens"] == n
    return check


def _temperature(post, e):
    assert text(ok(post(e))) == text(ok(post(e)))  # greedy
    sampled = {text(ok(post(e, temperature=1.5, seed=s))) for s in range(3)}
    assert len(sampled) > 1


def _seed(post, e):
    assert text(ok(post(e, temperature=1.0, seed=7))) == text(ok(post(e, temperature=1.0,
                                                                      seed=7)))
    assert text(ok(post(e, temperature=1.0, seed=7))) != text(ok(post(e, temperature=1.0,
                                                                      seed=8)))


def _top_p(post, e):  # the smallest nucleus is the likeliest token: greedy again
    assert text(ok(post(e, temperature=1.0, seed=3, top_p=1e-6))) == text(ok(post(e)))


def _stop(post, e):
    whole = text(ok(post(e, max_tokens=12)))
    cut = whole[len(whole) // 2:len(whole) // 2 + 3]
    answer = ok(post(e, max_tokens=12, stop=[cut]))
    assert text(answer) == whole[:whole.index(cut)]
    assert answer["choices"][0]["finish_reason"] == "stop"


def _stream(post, e):
    chunks = events(post(e, stream=True))
    if e == CHAT:
        joined = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        joined = "".join(c["choices"][0]["text"] for c in chunks)
    assert joined == text(ok(post(e)))


def _stream_options(post, e):
    chunks = events(post(e, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    refused(post(e, stream=True, stream_options={"include_obfuscation": True}),
            "stream_options.include_obfuscation")


def _logprobs(post, e):
    if e == CHAT:
        answer = ok(post(e, logprobs=True))
        assert len(answer["choices"][0]["logprobs"]["content"]) == 6
    else:
        answer = ok(post(e, logprobs=2))
        assert [len(t) for t in answer["choices"][0]["logprobs"]["top_logprobs"]] == [2] * 6


def _top_logprobs(post, e):
    content = ok(post(e, logprobs=True, top_logprobs=4))["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 4 for c in content)


def _response_format(post, e):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    jsonschema.validate(json.loads(text(ok(post(e, max_tokens=20, response_format=fmt)))),
                        schema)


def _tools(post, e):
    answer = ok(post(e, max_tokens=60, tools=[WEATHER], tool_choice="required",
                     parallel_tool_calls=False))
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def _harmless(field, value, refused_value):
    def check(post, e):
        assert text(ok(post(e, **{field: value}))) == text(ok(post(e)))
        if refused_value is not None:
            refused(post(e, **{field: refused_value}), field)
    return check


def _service_tier(post, e):
    """The priority: the same answer as interactive ("default") or batch work ("flex")."""
    assert text(ok(post(e, service_tier="flex"))) == text(ok(post(e, service_tier="default")))
    assert text(ok(post(e, service_tier="default"))) == text(ok(post(e)))
    refused(post(e, service_tier="priority"), "service_tier")


COMMON = {"model": _model, "max_tokens": _max_tokens("max_tokens"), "temperature": _temperature,
          "seed": _seed, "top_p": _top_p, "stop": _stop, "stream": _stream,
          "stream_options": _stream_options, "logprobs": _logprobs,
          "user": _harmless("user", "u-42", None)}
IMPLEMENTED = {
    CHAT: {**COMMON, "messages": _prompt, "top_logprobs": _top_logprobs,
           "max_completion_tokens": _max_tokens("max_completion_tokens"),
           "response_format": _response_format, "tools": _tools, "tool_choice": _tools,
           "parallel_tool_calls": _tools,
           "metadata": _harmless("metadata", {"team": "a"}, {"team": 5}),
           "store": _harmless("store", False, True),
           "service_tier": _service_tier,
           # read by the router as a tie-break (tests/router/test_policy.py) and by the store
           # (tests/cluster/api/test_cache_fields.py): the answer is the same
           "prompt_cache_key": _harmless("prompt_cache_key", "k", 5),
           "prompt_cache_retention": _harmless("prompt_cache_retention", "in_memory", "24h")},
    COMPLETIONS: {**COMMON, "prompt": _prompt},
}


@pytest.mark.parametrize("endpoint, field", sorted(
    (e, f) for e in (CHAT, COMPLETIONS) for f in SDK_FIELDS[e]))
def test_every_sdk_field_is_implemented_or_refused_naming_it(post, endpoint, field):
    check = IMPLEMENTED[endpoint].get(field)
    if check is not None:
        check(post, endpoint)
        return
    message = refused(post(endpoint, **{field: SAMPLES.get(field, GENERIC)}), field)
    assert "leave it out" in message
    if field in NEUTRAL:  # the value that asks for nothing is what OpenAI's default is
        ok(post(endpoint, **{field: NEUTRAL[field]}))
    ok(post(endpoint, **{field: None}))  # null: not given


def test_the_implemented_lists_name_only_fields_the_sdk_has():
    for endpoint in (CHAT, COMPLETIONS):
        assert set(IMPLEMENTED[endpoint]) <= SDK_FIELDS[endpoint]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_name_no_api_has_is_refused_not_ignored(post, endpoint):
    refused(post(endpoint, max_token=5), "max_token")


def test_a_completion_accepts_no_tools_and_a_chat_no_prompt(post):
    refused(post(COMPLETIONS, tools=[WEATHER]), "tools")
    refused(post(CHAT, prompt="Hi"), "prompt")


@pytest.mark.parametrize("tier, accepted", [
    (None, True), ("auto", True), ("flex", True), ("default", False), ("priority", False)])
def test_a_batch_lines_service_tier_may_only_ask_for_batch_work(tier, accepted):
    from cluster.api import openai_fields
    from cluster.api.validate import FieldError

    body = {"model": MODEL, "messages": USER, "service_tier": tier}
    if accepted:
        openai_fields.check_batch_body(body)
        return
    with pytest.raises(FieldError) as caught:
        openai_fields.check_batch_body(body)
    assert caught.value.field == "service_tier" and "runs as batch work" in str(caught.value)


class TestNeutralValues:
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
