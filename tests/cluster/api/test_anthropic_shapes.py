"""A Messages body as the edges' typed request (``cluster.api.anthropic_shapes``): the system
prompt first, blocks kept as sent (their cache_control for validation to read), Anthropic's
default temperature, the session header, and refusals naming the field."""
from __future__ import annotations

import pytest

from cluster.api.anthropic_shapes import request_of, stop_of
from cluster.api.incoming import CacheIn, MessageIn, Messages
from cluster.api.validate import FieldError
from cluster.jobs.store import StoredResult

BLOCKS = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]


def test_the_system_prompt_comes_first_and_blocks_stay_as_sent():
    request = request_of({"model": "m", "max_tokens": 8, "system": BLOCKS,
                          "messages": [{"role": "user", "content": "Hi"}],
                          "cache_control": {"type": "ephemeral", "ttl": "1h"}})
    assert request.prompt == Messages((MessageIn("system", BLOCKS), MessageIn("user", "Hi")))
    assert request.cache == CacheIn(control={"type": "ephemeral", "ttl": "1h"})
    assert (request.sampling.max_tokens, request.sampling.temperature) == (8, 1.0)


def test_a_session_header_names_the_session():
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    assert request_of(body, {"x-claude-code-session-id": "s-9"}).cache.key == "s-9"
    assert request_of(body, {"x-session-id": "a", "session_id": "b"}).cache.key == "a"
    assert request_of(body).cache.key == ""


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "max_tokens: required: an integer >= 1"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
     "messages[0].role: must be one of user, assistant"),
    ({"max_tokens": 4, "messages": [], "tools": [{"name": "f"}]},
     "tools: not supported by orchard's Messages API; leave it out"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x", "name": "n"}]},
     "messages[0].name: not supported by orchard; a message has role and content"),
    ({"max_tokens": 4, "messages": [], "stop_sequences": "END"},
     "stop_sequences: must be a list of strings"),
])
def test_bad_bodies_are_refused_naming_the_field(body, message):
    with pytest.raises(FieldError) as caught:
        request_of(body)
    assert str(caught.value) == message


def test_the_stop_reason_names_the_stop_sequence_the_engine_cut_at():
    def result(finish: str, stop: str = "") -> StoredResult:
        return StoredResult(0, "", "r", True, text="Hello ", finish_reason=finish,
                            stop_sequence=stop)
    assert stop_of(result("stop", "END")) == ("stop_sequence", "END")
    assert stop_of(result("stop")) == ("end_turn", None)  # the model's end of turn
    assert stop_of(result("length")) == ("max_tokens", None)
