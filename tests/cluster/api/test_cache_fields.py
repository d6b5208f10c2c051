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
