"""A chat on one engine (``workers.engine.chat``): each turn renders the whole conversation
through the model's chat template, and the next turn reuses the previous one's prompt;
``render_chat``'s exact token ids and its refusals; ``ChatSession``'s conversation."""
from __future__ import annotations

import re

import pytest

from tests.support import model_files as mf
from tests.support.engine_requests import req, run_one
from tests.support.forged_models import tiny_model
from workers.engine.chat import ChatSession, render_chat
from workers.engine.engine import Engine, EngineConfig
from workers.messages import SamplingParams

BS = 16


@pytest.fixture
def engine() -> Engine:
    """A fresh engine per test: every test writes to its store."""
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=BS))


class TestTurns:
    def test_chat_turns_reuse_the_previous_turn(self, engine):
        messages = [{"role": "system", "content": "orchard apple cache " * 30},
                    {"role": "user", "content": "first question"}]
        first = run_one(engine, req(engine, engine.render_chat(messages)))
        messages += [{"role": "assistant", "content": "a reply"}, {"role": "user", "content": "next"}]
        second = run_one(engine, req(engine, engine.render_chat(messages)))
        assert second.cached_tokens >= first.input_tokens - BS
        # the store holds the first turn's full blocks, its kept cache the rest of its prompt
        # (a cache holds the tokens whose K/V was computed: never the last output token)
        assert second.lookup.matched_tokens + second.lookup.kept_tokens >= first.input_tokens


@pytest.fixture(scope="module")
def tokenizer():
    return mf.byte_level_tokenizer()


@pytest.fixture(scope="module")
def chat_engine() -> Engine:
    """One engine for the sessions: each test talks as a tenant of its own."""
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=BS))


class TestRenderChat:
    """``render_chat`` through a real byte-level tokenizer and its chat template
    (``tests.support.model_files``): the exact token ids of the rendered text."""

    def ids(self, pieces: list[str]) -> list[int]:
        vocab = mf.vocabulary()
        return [vocab.index(p) for p in pieces]

    def test_a_message_renders_with_the_generation_prompt(self, tokenizer):
        got = render_chat(tokenizer, [{"role": "user", "content": "hi"}])
        # Ċ: the byte-level symbol of a newline
        assert got == self.ids(["<|im_start|>", *"user", "Ċ", *"hi", "<|im_end|>", "Ċ",
                                "<|im_start|>", *"ass", "is", *"tant", "Ċ"])
        assert all(type(t) is int for t in got)

    def test_without_the_generation_prompt_it_ends_at_the_last_message(self, tokenizer):
        got = render_chat(tokenizer, [{"role": "user", "content": "hi"}],
                          add_generation_prompt=False)
        assert got == self.ids(["<|im_start|>", *"user", "Ċ", *"hi", "<|im_end|>", "Ċ"])

    def test_no_messages_is_refused_saying_what_to_pass(self, tokenizer):
        with pytest.raises(ValueError, match=r"^messages is empty: pass at least one "
                                             r"\{'role', 'content'\} message$"):
            render_chat(tokenizer, [])

    @pytest.mark.parametrize("message", [{"role": "user"}, {"content": "hi"}, "hi"])
    def test_a_message_without_role_and_content_is_refused_showing_it(self, tokenizer, message):
        with pytest.raises(ValueError, match=r"^each message needs 'role' and 'content' keys, "
                                             rf"got {re.escape(repr(message))}$"):
            render_chat(tokenizer, [{"role": "user", "content": "ok"}, message])


class TestChatSession:
    def test_the_system_message_leads_and_each_turn_joins_the_conversation(self, chat_engine):
        chat = ChatSession(chat_engine, "ann", system="be brief",
                           sampling=SamplingParams(max_tokens=4))
        assert chat.messages == [{"role": "system", "content": "be brief"}]
        first = chat.say("hello")
        second = chat.say("and again")
        assert (first.request_id, second.request_id) == ("ann-turn-0", "ann-turn-1")
        assert chat.messages == [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and again"},
            {"role": "assistant", "content": second.text}]
        # the whole conversation is sent each turn, the first turn's prompt inside it
        assert second.input_tokens == len(chat_engine.render_chat(chat.messages[:4]))
        assert second.cached_tokens >= first.input_tokens // BS * BS
        assert len(first.output_tokens) == len(second.output_tokens) == 4

    def test_no_system_message_unless_given(self, chat_engine):
        assert ChatSession(chat_engine, "ann").messages == []

    def test_an_empty_message_is_refused_and_the_conversation_is_unchanged(self, chat_engine):
        chat = ChatSession(chat_engine, "bob")
        with pytest.raises(ValueError, match=r"^the user message is empty: type something to "
                                             r"say$"):
            chat.say("  \n")
        assert chat.messages == []

    def test_a_failed_turn_raises_its_error_and_leaves_the_conversation(self, chat_engine):
        chat = ChatSession(chat_engine, "cy", sampling=SamplingParams(max_tokens=5000))
        with pytest.raises(ValueError, match=r"exceeds the model's context"):
            chat.say("hello")
        assert chat.messages == []
