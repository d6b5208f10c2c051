"""``cluster.api.validate``: a request's shape checked, its prompt tokenized and its sampling
bounded, each problem a ``FieldError`` naming the field, with the value quoted short.

First the checks as plain functions, with a small model (exact messages, each bound on both
sides); then the same refusals end to end through the gRPC API, a real frontend over a
LocalBackend and the real client: the field named, the status ``INVALID_ARGUMENT``, huge
values quoted short, the size caps named, and the server serving on after bad input; and
the prompt-size cap ([limits] max_prompt_bytes) on a job's requests at intake, over HTTP (a
Batch line) and over gRPC (a job, a batch file), with nothing stored.
"""
from __future__ import annotations

import json

import pytest

from cluster.api import validate
from cluster.api.client import OrchardError, chat_request, token_request
from cluster.api.incoming import MessageIn, Messages, RequestIn, SamplingIn, Tokens
from cluster.api.validate import FieldError, LimitExceeded
from cluster.backend.protocol import ModelInfo
from proto.orchard.v1 import orchard_pb2 as pb
from tests.support.grpc_api import FILLER, MIB, chat, messages, run_job, tokens
from tests.support.grpc_api import acme, api, api_hostile  # noqa: F401  (fixtures)
from tests.support.http_api import (INPUT_CONFIG, PROMPT_CAP, USER, batch_line, create_batch,
                                    http_frontend, refused, upload)
from workers.messages import ResponseFormat, SamplingParams

MODEL = ModelInfo("m", "r", vocab_size=100, max_context=32, model_dir="", block_size=16,
                  kv_bytes_per_token=1)


def _render(messages, tools=None) -> list[int]:
    """A stand-in chat template: one token per character of the contents."""
    return [ord(c) % 100 for m in messages for c in m["content"] or ""]


def _tokens_request(ids, max_tokens=4, **fields) -> RequestIn:
    return RequestIn("r", Tokens(tuple(ids)), SamplingIn(max_tokens=max_tokens), **fields)


def _refusal(call) -> tuple[str, str]:
    with pytest.raises(FieldError) as caught:
        call()
    return caught.value.field, str(caught.value)


class TestQuoting:
    def test_a_value_of_up_to_64_characters_is_quoted_whole(self):
        assert validate.quoted("x" * 64) == repr("x" * 64)

    def test_a_longer_value_is_cut_at_64_characters_and_says_how_long_it_was(self):
        assert validate.quoted("y" * 65) == f"{'y' * 64!r}... (65 characters)"


class TestPromptChecks:
    def test_token_ids_are_bounded_by_the_vocabulary_on_both_sides(self):
        assert validate.check_token_ids([0, 99], "t", 100) == (0, 99)
        assert _refusal(lambda: validate.check_token_ids([0, 100], "t", 100)) == (
            "t[1]", "t[1]: token id 100 is outside the vocabulary [0, 100)")
        assert _refusal(lambda: validate.check_token_ids([-1], "t", 100))[0] == "t[0]"
        assert _refusal(lambda: validate.check_token_ids([], "t", 100)) == (
            "t", "t: empty token list; give at least one token id")

    def test_a_prompt_must_leave_one_token_of_the_context(self):
        assert validate.check_context(list(range(31)), "r", 32) == list(range(31))
        assert _refusal(lambda: validate.check_context(list(range(32)), "r", 32)) == (
            "r.prompt", "r.prompt: 32 tokens reach the model's context of 32; shorten the prompt")

    def test_the_text_cap_counts_utf8_bytes_and_allows_exactly_the_limit(self):
        validate.check_prompt_bytes([{"content": "é" * 2}, {"content": None}], "m", 4)
        assert _refusal(lambda: validate.check_prompt_bytes([{"content": "é" * 2 + "a"}], "m",
                                                            4)) == (
            "m", "m: 5 bytes of text exceed the limit of 4 ([limits] max_prompt_bytes); "
            "shorten the prompt")

    def test_a_chat_prompt_is_rendered_then_checked_and_a_missing_one_is_named(self):
        chat_prompt = RequestIn("r", Messages((MessageIn("user", "abc"),)), SamplingIn(4))
        assert validate.prompt_tokens(chat_prompt, "q", MODEL, _render) == (97, 98, 99)
        assert validate.prompt_tokens(_tokens_request([5, 6]), "q", MODEL, _render) == (5, 6)
        assert _refusal(lambda: validate.prompt_tokens(
            RequestIn("r", None, SamplingIn(4)), "q", MODEL, _render)) == (
            "q.prompt", "q.prompt: missing: set messages or tokens")


class TestSampling:
    def test_the_checked_values_are_the_engines_parameters(self):
        request = RequestIn("r", Tokens((1,)), SamplingIn(max_tokens=3, temperature=0.5,
                                                          top_p=0.25, seed=7, stop=("END",)),
                            logprobs=True, top_logprobs=2)
        assert validate.sampling_params(request, "q", 1, MODEL) == SamplingParams(
            max_tokens=3, temperature=0.5, top_p=0.25, seed=7, stop=("END",), logprobs=2)
        assert validate.sampling_params(_tokens_request([1]), "q", 1, MODEL).top_p == 1.0

    def test_max_tokens_fills_the_context_and_no_more(self):
        assert validate.sampling_params(_tokens_request([1], 31), "q", 1, MODEL).max_tokens == 31
        assert _refusal(lambda: validate.sampling_params(_tokens_request([1], 32), "q", 1,
                                                         MODEL)) == (
            "q.sampling.max_tokens", "q.sampling.max_tokens: 32 plus the 1-token prompt exceeds "
            "the model's context of 32; use at most 31")
        assert _refusal(lambda: validate.sampling_params(_tokens_request([1], 0), "q", 1,
                                                         MODEL))[1] == (
            "q.sampling.max_tokens: must be >= 1, got 0")

    @pytest.mark.parametrize("sampling, field", [
        (SamplingIn(1, temperature=-0.1), "q.sampling.temperature"),
        (SamplingIn(1, temperature=float("inf")), "q.sampling.temperature"),
        (SamplingIn(1, top_p=0.0), "q.sampling.top_p"),
        (SamplingIn(1, top_p=1.01), "q.sampling.top_p"),
        (SamplingIn(1, stop=("",)), "q.sampling.stop[0]"),
    ])
    def test_values_outside_their_range_name_their_field(self, sampling, field):
        request = RequestIn("r", Tokens((1,)), sampling)
        assert _refusal(lambda: validate.sampling_params(request, "q", 1, MODEL))[0] == field

    def test_log_probabilities_take_0_to_20_alternatives_and_need_logprobs(self):
        assert validate.logprobs_count(_tokens_request([1], logprobs=True, top_logprobs=20),
                                       "q") == 20
        assert validate.logprobs_count(_tokens_request([1]), "q") is None
        assert _refusal(lambda: validate.logprobs_count(
            _tokens_request([1], logprobs=True, top_logprobs=21), "q"))[1] == (
            "q.top_logprobs: must be from 0 to 20, got 21")
        assert _refusal(lambda: validate.logprobs_count(
            _tokens_request([1], top_logprobs=1), "q"))[1] == "q.top_logprobs: needs logprobs"


class TestFormats:
    def test_each_kind_becomes_the_engines_format(self):
        schema = {"type": "object"}
        assert validate.format_of(None, "f") is None
        assert validate.format_of({"type": "text"}, "f") is None
        assert validate.format_of({"type": "json_object"}, "f") == ResponseFormat("json_object")
        assert validate.format_of({"type": "json_schema", "json_schema": {
            "name": "s", "schema": schema}}, "f") == ResponseFormat(
            "json_schema", '{"type": "object"}', name="s", strict=False)

    def test_a_field_set_to_null_is_as_if_absent_and_any_other_is_named(self):
        assert validate.format_of({"type": "json_object", "json_schema": None}, "f") == (
            ResponseFormat("json_object"))
        assert _refusal(lambda: validate.format_of({"type": "json_object", "schema": {}},
                                                   "f")) == (
            "f.schema", "f.schema: not supported by orchard; a json_object response_format has "
            "type")

    @pytest.mark.parametrize("name, accepted", [("a" * 64, True), ("a" * 65, False),
                                                ("a-b_9", True), ("a b", False)])
    def test_a_schemas_name_is_1_to_64_letters_digits_or_dashes(self, name, accepted):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": {}}}
        if accepted:
            assert validate.format_of(fmt, "f").name == name
        else:
            assert _refusal(lambda: validate.format_of(fmt, "f"))[0] == "f.json_schema.name"


class TestJobs:
    def test_a_job_holds_1_to_max_requests(self):
        validate.check_job_size(3, 3)
        with pytest.raises(LimitExceeded) as caught:
            validate.check_job_size(4, 3)
        assert str(caught.value) == ("requests: 4 requests exceed the limit of 3 per job; split "
                                     "the job")
        assert _refusal(lambda: validate.check_job_size(0, 3))[0] == "requests"

    def test_every_request_needs_a_custom_id_unique_in_its_job(self):
        unnamed = [_tokens_request([1]), RequestIn("", Tokens((1,)), SamplingIn(1))]
        assert _refusal(lambda: validate.job_requests(unnamed, 4, MODEL, _render)) == (
            "requests[1].custom_id", "requests[1].custom_id: required: give every request a "
            "unique id")
        checked = validate.job_requests([_tokens_request([1, 2])], 4, MODEL, _render)
        assert [(r.custom_id, r.prompt, r.sampling.max_tokens) for r in checked] == [
            ("r", (1, 2), 4)]

    def test_an_idempotency_key_has_at_most_256_characters(self):
        assert validate.idempotency_key("k" * 256) == "k" * 256
        assert _refusal(lambda: validate.idempotency_key("k" * 257))[1] == (
            "idempotency_key: 257 characters; use at most 256")








BAD_JOBS = {
    "empty job": ([], "requests"),
    "empty message list": ([messages()], "requests[0].messages"),
    "unknown role": ([messages({"role": "wizard", "content": "hi"})], "messages[0].role"),
    "non-string content": ([messages({"role": "user", "content": 5})], "messages[0].content"),
    "object content": ([messages({"role": "user", "content": {"a": 1}})],
                       "messages[0].content"),
    "token id above the vocabulary": ([tokens([1, 10**9])], "tokens.ids[1]"),
    "negative token id": ([tokens([-1, 3])], "tokens.ids[0]"),
    "max tokens zero": ([tokens([1, 2], 0)], "sampling.max_tokens"),
    "max tokens negative": ([tokens([1, 2], -3)], "sampling.max_tokens"),
    "max tokens above the context": (lambda ctx: [tokens([1, 2], ctx)], "sampling.max_tokens"),
    "prompt over the context": (lambda ctx: [tokens([7] * ctx, 1)], "requests[0].prompt"),
    "missing prompt": ([pb.Request(custom_id="x", sampling=pb.SamplingParams(max_tokens=1))],
                       "requests[0].prompt"),
}


HUGE = "x" * 100_000


def _error(call) -> tuple[str, str]:
    with pytest.raises(OrchardError) as info:
        call()
    return info.value.code, info.value.message


def _generate(client, request):
    return lambda: list(client.generate(request, timeout_s=30))




class TestOverGrpc:
    @pytest.mark.parametrize("case", sorted(BAD_JOBS))
    def test_bad_job_is_invalid_argument_naming_the_field(self, api, acme, case):
        requests, field = BAD_JOBS[case]
        if callable(requests):  # sized from the served model's context
            requests = requests(api.backend.model_info().max_context)
        with pytest.raises(OrchardError) as err:
            acme.submit(requests)
        assert err.value.code == "INVALID_ARGUMENT"
        assert field in err.value.message

    def test_duplicate_custom_ids(self, acme):
        with pytest.raises(OrchardError) as err:
            acme.submit([tokens([1, 2]), tokens([3, 4])])
        assert err.value.code == "INVALID_ARGUMENT"
        assert "requests[1].custom_id" in err.value.message and "duplicate" in err.value.message

    def test_huge_values_are_quoted_short_and_keep_their_status(self, api_hostile):
        with api_hostile.client("acme") as acme, api_hostile.client(admin=True) as admin:
            assert _error(lambda: acme.job(HUGE)) == (
                "NOT_FOUND", f"job_id: no job {'x' * 64!r}... (100000 characters)")
            assert _error(lambda: acme.cancel(HUGE))[0] == "NOT_FOUND"
            code, message = _error(_generate(acme, chat_request(
                "r", [{"role": HUGE, "content": "hi"}], 4)))
            assert code == "INVALID_ARGUMENT"
            assert message.startswith(f"request.messages[0].role: unknown role {'x' * 64!r}... "
                                      "(100000 characters); use one of")
            assert _error(lambda: admin.invalidate(HUGE)) == (
                "INVALID_ARGUMENT", f"tenant: unknown tenant {'x' * 64!r}... (100000 characters); "
                "known: acme, beta")
            assert _error(lambda: admin.drain(HUGE)) == (
                "NOT_FOUND", f"worker_id: no worker {'x' * 64!r}... (100000 characters)")

    def test_custom_id_and_stop_strings_are_capped(self, api_hostile):
        with api_hostile.client("acme") as acme:
            assert _error(lambda: acme.submit([token_request("c" * 257, [1, 2], 2)])) == (
                "INVALID_ARGUMENT", "requests[0].custom_id: 257 bytes; use at most 256")
            assert _error(lambda: acme.submit([token_request("é" * 129, [1, 2], 2)]))[1] == (
                "requests[0].custom_id: 258 bytes; use at most 256")
            dup = "d" * 256
            assert _error(lambda: acme.submit([token_request(dup, [1], 2),
                                               token_request(dup, [2], 2)]))[1] == (
                f"requests[1].custom_id: duplicate {'d' * 64!r}... (256 characters) (first at "
                "requests[0]); custom ids must be unique")
            assert _error(_generate(acme, token_request("", [1, 2], 2, stop=["s"] * 17))) == (
                "INVALID_ARGUMENT", "request.sampling.stop: 17 stop strings; use at most 16")
            assert _error(_generate(acme, token_request("", [1, 2], 2, stop=["ok", "s" * 257]))) == (
                "INVALID_ARGUMENT", "request.sampling.stop[1]: 257 bytes; a stop string may have at "
                "most 256")
            events = list(acme.generate(token_request("c" * 256, [1, 2], 2, stop=["s" * 256] * 16)))
            assert events[-1].result.ok and events[-1].result.custom_id == "c" * 256

    def test_prompts_over_the_size_caps_are_refused_naming_the_limit(self, api_hostile):
        with api_hostile.client("acme") as acme:
            text = (FILLER * (MIB // len(FILLER) + 1))[:MIB + 1]
            api_hostile.tokenizer.entered.clear()
            assert _error(_generate(acme, chat_request("", [{"role": "user", "content": text}],
                                                       4))) == (
                "INVALID_ARGUMENT", f"request.messages: {MIB + 1} bytes of text exceed the limit of "
                f"{MIB} ([limits] max_prompt_bytes); shorten the prompt")
            assert not api_hostile.tokenizer.entered.is_set()  # refused before tokenizing
            assert _error(lambda: acme.submit([token_request("t", [5] * 2048, 1)])) == (
                "INVALID_ARGUMENT", "requests[0].prompt: 2048 tokens reach the model's context of 2048; "
                "shorten the prompt")

    def test_the_server_keeps_serving_after_bad_input(self, api, acme):
        job, results = run_job(acme, [chat("after", "still there?")])
        assert job.state == "succeeded" and results[0].ok
        assert acme.health() == "SERVING"


@pytest.fixture(scope="module")
def api_httpinput(tmp_path_factory):
    with http_frontend(tmp_path_factory, INPUT_CONFIG) as harness:
        yield harness


class TestThePromptCapAtIntake:
    def test_a_batch_line_over_the_prompt_size_is_refused_at_intake(self, api_httpinput):
        before = len(api_httpinput.frontend.store.list_jobs("acme", 1000))
        file_id = upload(api_httpinput, [batch_line(0), batch_line(1, messages=[
            {"role": "system", "content": "s" * 4000}, {"role": "user", "content": "u" * 97}])])
        assert create_batch(api_httpinput, file_id) == (400, refused(
            400, "line 2.messages", f"line 2.messages: 4097 bytes of text exceed the limit of "
            f"{PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt"))
        assert len(api_httpinput.frontend.store.list_jobs("acme", 1000)) == before

    def test_a_job_over_the_prompt_size_is_refused_at_intake_over_grpc(self, api_httpinput, tmp_path):
        big = [{"role": "user", "content": "é" * 2049}]  # 4098 bytes of UTF-8
        with api_httpinput.client("acme") as client:
            before = client.jobs()
            with pytest.raises(OrchardError) as err:
                client.submit([chat_request("a", USER, 1), chat_request("b", big, 1)])
            assert (err.value.code, err.value.message) == (
                "INVALID_ARGUMENT", "requests[1].messages: 4098 bytes of text exceed the limit of "
                f"{PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt")
            path = tmp_path / "batch.jsonl"
            path.write_text(json.dumps(batch_line(0)) + "\n" + json.dumps(batch_line(1, messages=big)) + "\n")
            with pytest.raises(OrchardError) as err:
                client.submit_file(path)
            assert (err.value.code, err.value.message) == (
                "INVALID_ARGUMENT", "batch.jsonl:2: body.messages: 4098 bytes of text exceed the "
                f"limit of {PROMPT_CAP} ([limits] max_prompt_bytes); shorten the prompt")
            assert client.jobs() == before
