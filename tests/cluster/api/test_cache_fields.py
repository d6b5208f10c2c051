"""A request's cache controls checked (``cluster.api.cache_fields``, through
``validate.new_request`` as every edge calls it), with the forged model's real chat template:
where a breakpoint stops writing, the TTL, bypass, the session key, the salt, and each bad
value refused naming its field.
"""
from __future__ import annotations

import pytest

from cluster.api.chat import ChatTokenizer
from cluster.api.incoming import (CacheIn, MessageIn, Messages, RequestIn, SamplingIn,
                                  TokenBreakpoint, Tokens)
from cluster.api.validate import FieldError, new_request
from cluster.backend.protocol import ModelInfo
from tests.support.forged_models import tiny_model
from workers.messages import CacheControls

MODEL = ModelInfo("m", "r", vocab_size=32000, max_context=4096, model_dir="", block_size=16,
                  kv_bytes_per_token=64)
SYSTEM = "You are a careful assistant who answers briefly. " * 3
EPHEMERAL_1H = {"type": "ephemeral", "ttl": "1h"}


@pytest.fixture(scope="module")
def tokenizer():
    chat = ChatTokenizer(tiny_model())
    yield chat
    chat.close()


def chat(*messages: MessageIn, cache: CacheIn = CacheIn()) -> RequestIn:
    return RequestIn("c", Messages(messages), SamplingIn(max_tokens=4), cache=cache)


def system(**marks) -> MessageIn:
    return MessageIn("system", SYSTEM, **marks)


USER = MessageIn("user", "What is the capital of France?")


def checked(tokenizer, request: RequestIn):
    return new_request(request, "body", MODEL, tokenizer.render)


class TestWhereWritingStops:
    def test_a_message_breakpoint_stops_where_the_prompt_rendered_to_it_stops_agreeing(
            self, tokenizer):
        new = checked(tokenizer, chat(system(cache_control={"type": "ephemeral"}), USER))
        head = tokenizer.render([{"role": "system", "content": SYSTEM}])
        agree = next(i for i, (a, b) in enumerate(zip(head, new.prompt)) if a != b)
        assert 0 < agree < len(new.prompt)
        assert new.cache == CacheControls(write_limit=agree, ttl_s=300.0)

    def test_a_content_part_breakpoint_stops_after_that_part(self, tokenizer):
        parts = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL_1H},
                 {"type": "text", "text": " Today is Tuesday, 1 December 2026."}]
        new = checked(tokenizer, chat(MessageIn("system", parts), USER))
        whole_system = checked(tokenizer, chat(system(cache_control=EPHEMERAL_1H), USER))
        head = tokenizer.render([{"role": "system", "content": SYSTEM}])
        agree = next(i for i, (a, b) in enumerate(zip(head, new.prompt)) if a != b)
        assert new.cache == CacheControls(write_limit=agree, ttl_s=3600.0)
        assert new.cache.write_limit < whole_system.cache.write_limit

    def test_the_top_level_breakpoint_follows_the_conversation(self, tokenizer):
        new = checked(tokenizer, chat(system(cache_control=EPHEMERAL_1H), USER,
                                      cache=CacheIn(control=EPHEMERAL_1H)))
        assert new.cache == CacheControls(write_limit=None, ttl_s=3600.0)

    def test_no_cache_control_writes_every_block_at_the_store_ttl(self, tokenizer):
        assert checked(tokenizer, chat(system(), USER)).cache == CacheControls()

    def test_token_breakpoints_the_last_one_stops_writing(self, tokenizer):
        request = RequestIn("c", Tokens(tuple(range(100))), SamplingIn(max_tokens=4),
                            cache=CacheIn(breakpoints=(TokenBreakpoint(40), TokenBreakpoint(
                                64))))
        assert checked(tokenizer, request).cache == CacheControls(write_limit=64, ttl_s=300.0)


class TestBypassSaltKey:
    def test_bypass_salt_and_key_reach_the_request(self, tokenizer):
        new = checked(tokenizer, chat(system(), USER, cache=CacheIn(
            salt="team-7", key="session-1", read=False, write=False)))
        assert new.cache == CacheControls(read=False, write=False, session="session-1")
        assert new.cache_salt == "team-7"


class TestRefused:
    def refusal(self, tokenizer, request: RequestIn) -> str:
        with pytest.raises(FieldError) as caught:
            checked(tokenizer, request)
        return str(caught.value)

    def test_a_ttl_that_is_not_offered(self, tokenizer):
        message = self.refusal(tokenizer, chat(system(), USER, cache=CacheIn(
            control={"type": "ephemeral", "ttl": "2h"})))
        assert message == "body.cache_control.ttl: '2h' is not offered; use one of 5m, 1h"

    def test_a_cache_control_of_another_type(self, tokenizer):
        message = self.refusal(tokenizer, chat(system(cache_control={"type": "persistent"}),
                                               USER))
        assert message == ('body.messages[0].cache_control: must be {"type": "ephemeral"} '
                           'with an optional "ttl" of 5m or 1h')

    def test_a_breakpoint_past_the_prompt(self, tokenizer):
        request = RequestIn("c", Tokens(tuple(range(100))), SamplingIn(max_tokens=4),
                            cache=CacheIn(breakpoints=(TokenBreakpoint(101),)))
        assert self.refusal(tokenizer, request) == (
            "body.cache_breakpoints[0].tokens: token offset 101 is past the 100-token prompt; "
            "use 1 to 100")

    def test_more_than_four_breakpoints_names_the_fifth(self, tokenizer):
        marked = [MessageIn("user", f"question {i}", cache_control={"type": "ephemeral"})
                  for i in range(5)]
        assert self.refusal(tokenizer, chat(*marked)) == (
            "body.messages[4].cache_control: 5 cache breakpoints; a request has at most 4")

    def test_a_salt_over_256_bytes(self, tokenizer):
        message = self.refusal(tokenizer, chat(system(), USER, cache=CacheIn(salt="s" * 257)))
        assert message == "body.cache_salt: 257 bytes; a salt has at most 256"

    def test_breakpoints_asking_different_ttls(self, tokenizer):
        message = self.refusal(tokenizer, chat(system(cache_control=EPHEMERAL_1H), USER,
                                               cache=CacheIn(control={"type": "ephemeral"})))
        assert message == ("body.messages[0].cache_control: asks ttl ['1h', '5m']; orchard "
                           "keeps one TTL per request: give every cache_control the same ttl")

    def test_a_key_over_256_bytes(self, tokenizer):
        message = self.refusal(tokenizer, chat(system(), USER, cache=CacheIn(key="k" * 300)))
        assert message == "body.prompt_cache_key: 300 bytes; a key has at most 256"


# ---- over the wire: a real frontend over one real engine, the openai SDK and gRPC -----------

import io  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import openai  # noqa: E402

from cluster.api.client import OrchardError, token_request  # noqa: E402
from tests.support.frontend_harness import ACME_CONFIG, running_frontend  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    # one worker, no kept caches: every cached token counted is the store's
    engine = EngineConfig(block_size=16, max_batch=4, kept_bytes=0)
    with running_frontend(run_dir, tiny_model(), workers=1, engine=engine) as harness:
        yield harness


@pytest.fixture(scope="module")
def acme(api) -> openai.OpenAI:
    address = json.loads((api.config.run_dir / "frontend.json").read_text())["http_address"]
    return openai.OpenAI(base_url=f"{address}/v1", api_key="key-acme", max_retries=0)


def ask(acme, user: str, system: str = SYSTEM, **extra) -> int:
    """The cached tokens of one chat request with ``extra`` body fields."""
    reply = acme.chat.completions.create(
        model="llama", max_tokens=2, temperature=0, extra_body=extra or None,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
    return reply.usage.prompt_tokens_details.cached_tokens


class TestOverHttp:
    def test_requests_with_different_salts_share_no_block(self, acme):
        assert ask(acme, "salted one", cache_salt="alice") == 0
        held = ask(acme, "salted one", cache_salt="alice")
        assert held > 0
        assert ask(acme, "salted one", cache_salt="bob") == 0
        assert ask(acme, "salted one") == 0  # no salt is a salt of its own
        assert ask(acme, "salted one", cache_salt="alice") == held

    def test_write_false_stores_nothing_and_read_false_reuses_nothing(self, acme):
        system = "Bypass. " + SYSTEM  # a prompt no other test stores
        assert ask(acme, "bypassed", system, cache={"write": False}) == 0
        assert ask(acme, "bypassed", system) == 0
        assert ask(acme, "bypassed", system, cache={"read": False}) == 0
        assert ask(acme, "bypassed", system) > 0

    def test_a_breakpoint_after_the_system_message_writes_the_blocks_before_it(self, acme,
                                                                               tokenizer):
        system = {"role": "system", "content": "Breakpoint. " + SYSTEM,
                  "cache_control": {"type": "ephemeral"}}
        first = acme.chat.completions.create(
            model="llama", max_tokens=2, messages=[system, {"role": "user", "content": "a"}])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        limit = checked(tokenizer, chat(MessageIn("system", system["content"],
                                                  cache_control=system["cache_control"]),
                                        MessageIn("user", "b"))).cache.write_limit
        second = acme.chat.completions.create(
            model="llama", max_tokens=2, messages=[
                {"role": "system", "content": system["content"]},
                {"role": "user", "content": "b"}])
        assert second.usage.prompt_tokens_details.cached_tokens == limit // 16 * 16

    @pytest.mark.parametrize("control, ttl", [({"type": "ephemeral", "ttl": "1h"}, "1h"),
                                              ({"type": "ephemeral"}, "5m"), (None, "5m")])
    def test_usage_reports_the_prompt_tokens_written_by_ttl(self, acme, control, ttl):
        reply = acme.chat.completions.create(
            model="llama", max_tokens=2, extra_body={"cache_control": control} if control else None,
            messages=[{"role": "user", "content": f"A fresh prompt for the {ttl} usage, "
                       f"{control is None}. " + SYSTEM}])
        prompt = reply.usage.prompt_tokens
        written = min((prompt + 1) // 16 * 16, prompt)  # the full blocks of prompt + 1 output
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert reply.usage.cache_creation_input_tokens == written > 0
        assert reply.usage.cache_creation == {
            "ephemeral_5m_input_tokens": written if ttl == "5m" else 0,
            "ephemeral_1h_input_tokens": written if ttl == "1h" else 0}

    @pytest.mark.parametrize("extra, param, message", [
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl",
         "body.cache_control.ttl: '2h' is not offered; use one of 5m, 1h"),
        ({"cache_salt": "s" * 257}, "cache_salt",
         "body.cache_salt: 257 bytes; a salt has at most 256"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention",
         "prompt_cache_retention: '24h' is not offered: orchard keeps a cache entry at most 1 "
         'hour; use in_memory (the store\'s TTL) or cache_control {"type": "ephemeral", '
         '"ttl": "1h"}'),
        ({"cache": {"reed": False}}, "cache.reed", "cache.reed: not a cache option; use read, "
         "write or verify"),
    ])
    def test_bad_values_are_refused_400_naming_the_field(self, acme, extra, param, message):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(acme, "refused", **extra)
        assert (caught.value.body["param"], caught.value.body["message"]) == (param, message)


class TestDiagnosis:
    PAD = " Then say it again, slowly, in other words, for a listener far away." * 4

    def diverging(self, tokenizer, first: str, second: str) -> tuple[list[int], int]:
        a = tokenizer.render([{"role": "user", "content": first}])
        b = tokenizer.render([{"role": "user", "content": second}])
        return b, next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)

    def test_a_near_miss_names_the_exact_divergence_token_and_message(self, acme, tokenizer):
        first, second = "Alpha question." + self.PAD, "Beta question." + self.PAD
        acme.chat.completions.create(model="llama", max_tokens=2,
                                     messages=[{"role": "user", "content": first}])
        reply = acme.chat.completions.create(
            model="llama", max_tokens=2, extra_body={"cache_diagnostics": True},
            messages=[{"role": "user", "content": second}])
        prompt, at = self.diverging(tokenizer, first, second)
        text = lambda ids: b"".join(tokenizer.token_bytes(ids)).decode()  # noqa: E731
        assert reply.model_extra["cache_diagnostics"] == {
            "cached_tokens": at // 16 * 16, "prompt_tokens": len(prompt),
            "outcome": "near_miss", "reason": "near_miss", "diverged_at": at,
            "message_index": 0, "before": text(prompt[max(0, at - 8):at]),
            "after": text(prompt[at:at + 8])}

    def test_a_first_sight_is_a_miss_at_token_zero(self, acme):
        # a salt of its own: a root no prompt has continued (a first block under the
        # tenant's root, which other prompts continue, is a near miss)
        reply = acme.completions.create(model="llama", max_tokens=2, prompt=[7] * 40 + [9],
                                        extra_body={"cache_diagnostics": True,
                                                    "cache_salt": "first-sight"})
        diagnosis = reply.model_extra["cache_diagnostics"]
        assert (diagnosis["outcome"], diagnosis["reason"], diagnosis["diverged_at"],
                diagnosis["message_index"], diagnosis["before"]) == (
                    "miss", "first_sight", 0, None, "")

    @pytest.mark.parametrize("extra, message", [
        ({"cache_diagnostics": True, "stream": True}, "cache_diagnostics: answered on "
         "unstreamed requests only; leave it out or set stream false"),
        ({"cache_diagnostics": "yes"}, "cache_diagnostics: must be true or false, got 'yes'"),
    ])
    def test_bad_asks_are_refused(self, acme, extra, message):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(acme, "diagnosis refused", **extra)
        assert caught.value.body["message"] == message


class TestVerify:
    def test_read_false_with_verify_runs_the_cached_path_and_compares(self, acme):
        system = "Verified. " + SYSTEM
        ask(acme, "verify me", system)  # stores the prompt
        reply = acme.chat.completions.create(
            model="llama", max_tokens=4, temperature=0,
            extra_body={"cache": {"read": False, "verify": True}},
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "verify me"}])
        prompt = reply.usage.prompt_tokens
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert reply.model_extra["cache_verify"] == {
            "same_tokens": True, "cached_tokens": min(prompt // 16 * 16, prompt - 1),
            "first_difference": None}

    @pytest.mark.parametrize("extra, param, message", [
        ({"cache": {"verify": True}}, "cache.verify", "body.cache.verify: compares a "
         "recompute with the cached path: it needs read false"),
        ({"cache": {"read": False, "verify": True}, "stream": True}, "cache.verify",
         "cache.verify: answered on unstreamed requests only; leave it out or set stream "
         "false"),
    ])
    def test_bad_asks_are_refused(self, acme, extra, param, message):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(acme, "verify refused", **extra)
        assert (caught.value.body["param"], caught.value.body["message"]) == (param, message)


class TestBatchLines:
    def test_a_batch_line_carries_its_cache_controls_to_its_result(self, acme):
        def line(i: int, **extra) -> str:
            body = {"model": "llama", "max_tokens": 2, "temperature": 0, **extra,
                    "messages": [{"role": "system", "content": f"Batch line {i}. " + SYSTEM},
                                 {"role": "user", "content": "Hi"}]}
            return json.dumps({"custom_id": f"line-{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": body}) + "\n"
        text = (line(0, cache_control={"type": "ephemeral", "ttl": "1h"}, cache_salt="x")
                + line(1, cache={"write": False}) + line(2))
        uploaded = acme.files.create(file=("in.jsonl", io.BytesIO(text.encode())),
                                     purpose="batch")
        batch = acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
        deadline = time.monotonic() + 120
        while batch.status != "completed" and time.monotonic() < deadline:
            time.sleep(0.1)
            batch = acme.batches.retrieve(batch.id)
        assert batch.request_counts.completed == 3
        usage = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"]["usage"]
                 for x in acme.files.content(batch.output_file_id).text.splitlines()}
        hour, bypass, plain = usage["line-0"], usage["line-1"], usage["line-2"]
        assert hour["cache_creation_input_tokens"] == min(
            (hour["prompt_tokens"] + 1) // 16 * 16, hour["prompt_tokens"]) > 0
        assert hour["cache_creation"] == {"ephemeral_5m_input_tokens": 0,
                                          "ephemeral_1h_input_tokens":
                                          hour["cache_creation_input_tokens"]}
        assert bypass["cache_creation_input_tokens"] == 0
        assert plain["cache_creation"]["ephemeral_5m_input_tokens"] == plain[
            "cache_creation_input_tokens"] > 0

    def test_a_bad_cache_control_in_a_line_is_refused_naming_its_line(self, acme):
        body = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}],
                "cache_control": {"type": "ephemeral", "ttl": "1d"}}
        text = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                           "body": body}) + "\n"
        uploaded = acme.files.create(file=("in.jsonl", io.BytesIO(text.encode())),
                                     purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            acme.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
        assert caught.value.body["message"] == ("line 1.cache_control.ttl: '1d' is not "
                                                "offered; use one of 5m, 1h")


class TestOverGrpc:
    def test_a_breakpoint_past_the_prompt_is_invalid_argument(self, api):
        request = token_request("g", list(range(30)), 2)
        request.cache_breakpoints.add(tokens=31)
        with api.client("acme") as client, pytest.raises(OrchardError) as caught:
            list(client.generate(request))
        assert caught.value.code == "INVALID_ARGUMENT"
        assert caught.value.message == ("request.cache_breakpoints[0].tokens: token offset 31 "
                                        "is past the 30-token prompt; use 1 to 30")

    def test_a_token_breakpoint_writes_the_blocks_before_it(self, api):
        tokens = list(range(1000, 1070))
        request = token_request("g", tokens, 2)
        request.cache_breakpoints.add(tokens=40, ttl="1h")
        with api.client("acme") as client:
            (done,) = [e.result for e in client.generate(request) if e.HasField("result")]
            assert done.usage.written_tokens == 32
            (again,) = [e.result for e in client.generate(token_request("h", tokens, 2))
                        if e.HasField("result")]
        assert again.usage.cached_tokens == 32

