"""Anthropic's ``diagnostics`` (``cluster.api.anthropic_diagnostics``): each rule of the
comparison, in its order, on fingerprints made from Messages bodies."""
from __future__ import annotations

import pytest

from cluster.api.anthropic_diagnostics import (Asked, PromptPrints, asked, diagnose,
                                               fingerprint)
from cluster.api.validate import FieldError

SYSTEM = [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
TURN = [{"role": "user", "content": "List the files."}]
REPLY = {"role": "assistant", "content": "a.txt b.txt"}


def held(prompt_tokens: int = 120, model: str = "m", system=SYSTEM, messages=TURN):
    prints = PromptPrints()
    prints.record("acme", "msg_1", fingerprint(model, system, messages), prompt_tokens)
    return prints


def reason(current, prints=None, tenant="acme", message="msg_1"):
    prints = prints or held()
    return diagnose(prints.get(tenant, message), current)


def test_messages_only_appended_is_no_divergence():
    more = [*TURN, REPLY, {"role": "user", "content": "Open a.txt."}]
    assert reason(fingerprint("m", SYSTEM, more)) is None
    # the same text as a string or as a block, with or without cache_control: the same prompt
    as_blocks = [{"role": "user", "content": [{"type": "text", "text": "List the files."}]}]
    assert reason(fingerprint("m", "You are an agent.", as_blocks)) is None


def test_each_change_is_named_in_anthropics_order():
    missed = {"cache_missed_input_tokens": 120}
    assert reason(fingerprint("other", "Changed.", TURN)) == {
        "cache_miss_reason": {"type": "model_changed", **missed}}
    volatile = [{"type": "text", "text": "You are an agent. Time: 12:00:01"}]
    assert reason(fingerprint("m", volatile, [*TURN, REPLY])) == {
        "cache_miss_reason": {"type": "system_changed", **missed}}
    edited = [{"role": "user", "content": "List the folders."}, REPLY]
    assert reason(fingerprint("m", SYSTEM, edited)) == {
        "cache_miss_reason": {"type": "messages_changed", **missed}}
    assert reason(fingerprint("m", SYSTEM, [])) == {
        "cache_miss_reason": {"type": "messages_changed", **missed}}  # the turn was dropped


def test_a_message_not_held_is_not_found_and_tenants_do_not_see_each_other():
    current = fingerprint("m", SYSTEM, TURN)
    not_found = {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert reason(current, message="msg_2") == not_found
    assert reason(current, tenant="beta") == not_found


def test_the_least_recently_recorded_is_forgotten_first():
    prints = PromptPrints(limit=2)
    prompt = fingerprint("m", SYSTEM, TURN)
    for n in range(3):
        prints.record("acme", f"msg_{n}", prompt, n)
    assert len(prints) == 2 and prints.get("acme", "msg_0") is None
    assert prints.get("acme", "msg_2").prompt_tokens == 2


def test_what_a_request_may_ask():
    assert asked(None) is None
    assert asked({"previous_message_id": None}) == Asked("")
    assert asked({"previous_message_id": "msg_a"}) == Asked("msg_a")
    with pytest.raises(FieldError, match="diagnostics: must be"):
        asked({"previous": "msg_a"})
    with pytest.raises(FieldError, match="diagnostics.previous_message_id: must be"):
        asked({"previous_message_id": 3})
