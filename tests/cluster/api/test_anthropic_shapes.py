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


def test_the_stop_reason_names_the_stop_sequence_found_after_the_text():
    def result(finish: str, text: str) -> StoredResult:
        return StoredResult(0, "", "r", True, text=text, output_tokens=(1, 2, 3),
                            finish_reason=finish)
    decode = lambda ids: " Hello END more"  # noqa: E731  the detokenizer's leading space
    assert stop_of(result("stop", "Hello "), ["STOP", "END"], decode) == ("stop_sequence",
                                                                            "END")
    assert stop_of(result("stop", "Hello END more"), ["END"], decode) == ("end_turn", None)
    assert stop_of(result("length", "Hello"), ["END"], decode) == ("max_tokens", None)
