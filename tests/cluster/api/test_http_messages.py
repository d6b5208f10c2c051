"""``POST /v1/messages`` end to end with the real ``anthropic`` SDK: plain, streamed, with
cache_control breakpoints and their usage fields, stop sequences, and refusals in
Anthropic's error shape. A real frontend over one real engine (no kept caches, so every
cached token counted is the store's); the OpenAI endpoint over the same prompt is the
reference for the text and the prompt's size. (Message Batches:
tests/cluster/api/test_http_message_batches.py.)
"""
from __future__ import annotations

import anthropic
import openai
import pytest

from tests.support.anthropic_api import GREEDY, MODEL, SYSTEM, address
from tests.support.anthropic_api import api, claude  # noqa: F401  (fixtures)



@pytest.fixture(scope="module")
def gpt(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{address(api)}/v1", api_key="key-acme", max_retries=0)


def reference(gpt, system: str, user: str, max_tokens: int):
    return gpt.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])


class TestMessages:
    def test_a_plain_message_answers_as_the_chat_endpoint_does(self, claude, gpt):
        system, user = "Plain. " + SYSTEM, "Name a river."
        ref = reference(gpt, system, user, 5)
        message = claude.messages.create(model=MODEL, max_tokens=5, extra_body=GREEDY,
                                         system=system,
                                         messages=[{"role": "user", "content": user}])
        assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == ref.choices[0].message.content
        assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
        u = message.usage
        assert u.output_tokens == 5
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == \
            ref.usage.prompt_tokens
        assert u.cache_read_input_tokens == ref.usage.prompt_tokens // 16 * 16  # ref stored it

    def test_a_streamed_message_is_the_plain_message(self, claude):
        system, user = "Streamed. " + SYSTEM, "Name a mountain."
        plain = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, system=system,
                                       messages=[{"role": "user", "content": user}])
        with claude.messages.stream(model=MODEL, max_tokens=6, extra_body=GREEDY, system=system,
                                    messages=[{"role": "user", "content": user}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == final.content[0].text == plain.content[0].text
        assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 6)
        assert final.usage.cache_read_input_tokens == plain.usage.cache_read_input_tokens + \
            plain.usage.cache_creation_input_tokens  # the plain one stored what it computed
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
            plain.usage.input_tokens + plain.usage.cache_read_input_tokens + \
            plain.usage.cache_creation_input_tokens

    def test_a_cache_control_breakpoint_writes_the_system_prompt_for_an_hour(self, claude):
        system = [{"type": "text", "text": "Breakpoint. " + SYSTEM,
                   "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
        first = claude.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, system=system,
                                       messages=[{"role": "user", "content": "First question?"}])
        written = first.usage.cache_creation_input_tokens
        assert written > 0 and written % 16 == 0
        assert first.usage.cache_read_input_tokens == 0
        assert first.usage.cache_creation.ephemeral_1h_input_tokens == written
        assert first.usage.cache_creation.ephemeral_5m_input_tokens == 0
        second = claude.messages.create(
            model=MODEL, max_tokens=3, extra_body=GREEDY, system=system,
            messages=[{"role": "user", "content": "A second, different question?"}])
        # exactly the blocks before the breakpoint were written, and the next turn reads them
        assert second.usage.cache_read_input_tokens == written
        assert first.usage.input_tokens > 0  # the user's turn: computed, not stored

    def test_a_stop_sequence_is_named(self, claude):
        system, user = "Stops. " + SYSTEM, "Tell me about rivers and mountains."
        whole = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system=system,
                                       messages=[{"role": "user", "content": user}])
        text = whole.content[0].text
        cut = text[len(text) // 2:len(text) // 2 + 3]
        stopped = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                         system=system, stop_sequences=[cut],
                                         messages=[{"role": "user", "content": user}])
        assert stopped.content[0].text == text[:text.index(cut)]
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", cut)


class TestRefusals:
    def test_a_ttl_not_offered_is_refused_400_naming_the_field(self, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=MODEL, max_tokens=3, messages=[{
                "role": "user", "content": [{"type": "text", "text": "Hi",
                                             "cache_control": {"type": "ephemeral",
                                                               "ttl": "2h"}}]}])
        assert caught.value.body == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "body.messages[0].content[0].cache_control.ttl: '2h' is not offered; "
                       "use one of 5m, 1h"}}

    def test_a_field_orchard_does_not_implement_is_refused(self, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=MODEL, max_tokens=3, extra_body={"top_k": 5},
                                   messages=[{"role": "user", "content": "Hi"}])
        assert caught.value.body["error"]["message"] == (
            "top_k: not supported by orchard's Messages API; leave it out")

    def test_an_image_block_is_refused(self, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=MODEL, max_tokens=3, messages=[{
                "role": "user", "content": [{"type": "image", "source": {
                    "type": "url", "url": "http://127.0.0.1/x.png"}}]}])
        assert caught.value.body["error"]["message"].startswith(
            "body.messages[0].content[0]: a content part must be")

    def test_an_unknown_key_is_refused_401(self, api):
        stranger = anthropic.Anthropic(base_url=address(api), api_key="no-such-key",
                                       max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            stranger.messages.create(model=MODEL, max_tokens=3,
                                     messages=[{"role": "user", "content": "Hi"}])
        assert caught.value.body["error"]["type"] == "authentication_error"


class TestDiagnosis:
    def test_a_message_may_carry_its_cache_diagnosis(self, claude):
        system = "Diagnosed. " + SYSTEM
        claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, system=system,
                               messages=[{"role": "user", "content": "First turn here."}])
        message = claude.messages.create(
            model=MODEL, max_tokens=2, system=system,
            extra_body={**GREEDY, "cache_diagnostics": True},
            messages=[{"role": "user", "content": "Second turn there."}])
        diagnosis = message.model_extra["cache_diagnostics"]
        assert diagnosis["cached_tokens"] == message.usage.cache_read_input_tokens > 0
        assert (diagnosis["outcome"], diagnosis["reason"], diagnosis["message_index"]) == (
            "near_miss", "near_miss", 1)  # the system prompt agrees; the user turn does not
        assert diagnosis["cached_tokens"] <= diagnosis["diverged_at"] < diagnosis[
            "cached_tokens"] + 16


    def test_anthropics_diagnostics_compare_with_a_previous_message(self, claude):
        system = "Agent. " + SYSTEM
        turn = [{"role": "user", "content": "Plan the first step."}]
        raw = claude.messages.with_raw_response.create(
            model=MODEL, max_tokens=2, extra_body=GREEDY, system=system, messages=turn,
            diagnostics={"previous_message_id": None})
        assert raw.http_response.json()["diagnostics"] is None  # asked: null, not left out
        first = raw.parse()
        prompt = (first.usage.input_tokens + first.usage.cache_read_input_tokens
                  + first.usage.cache_creation_input_tokens)
        more = [*turn, {"role": "assistant", "content": first.content[0].text or "ok"},
                {"role": "user", "content": "And the second."}]
        appended = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                                          system=system, messages=more,
                                          diagnostics={"previous_message_id": first.id})
        assert appended.diagnostics is None  # only appended: nothing diverged
        # a volatile line in the system prompt, as agent clients send
        volatile = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                                          system="Now: 12:00:01. " + system, messages=more,
                                          diagnostics={"previous_message_id": first.id})
        missed = volatile.diagnostics.cache_miss_reason
        assert (missed.type, missed.cache_missed_input_tokens) == ("system_changed", prompt)
        edited = claude.messages.create(
            model=MODEL, max_tokens=2, extra_body=GREEDY, system=system,
            messages=[{"role": "user", "content": "Plan another step."}],
            diagnostics={"previous_message_id": first.id})
        assert edited.diagnostics.cache_miss_reason.type == "messages_changed"
        unknown = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                                         system=system, messages=turn,
                                         diagnostics={"previous_message_id": "msg_nope"})
        assert unknown.diagnostics.cache_miss_reason.type == "previous_message_not_found"
        # streamed: the diagnosis comes in message_start, and the message is recorded
        with claude.messages.stream(model=MODEL, max_tokens=2, system="Then. " + system,
                                    messages=more, extra_body=GREEDY,
                                    diagnostics={"previous_message_id": appended.id}) as s:
            streamed = s.get_final_message()
        assert streamed.diagnostics.cache_miss_reason.type == "system_changed"
        after = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                                       system="Then. " + system, messages=more,
                                       diagnostics={"previous_message_id": streamed.id})
        assert after.diagnostics is None

    def test_a_bad_diagnostics_is_refused_and_a_plain_message_has_none(self, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=MODEL, max_tokens=2, diagnostics={"previous": "x"},
                                   messages=[{"role": "user", "content": "Hi"}])
        assert caught.value.body["error"]["message"].startswith("diagnostics: must be")
        plain = claude.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY,
                                       messages=[{"role": "user", "content": "Hi"}])
        assert plain.diagnostics is None and "diagnostics" not in plain.to_dict()
