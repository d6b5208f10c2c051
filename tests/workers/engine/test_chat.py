"""A chat on one engine (``workers.engine.chat``): each turn renders the whole conversation
through the model's chat template, and the next turn reuses the previous one's prompt."""
from __future__ import annotations

import pytest

from tests.support.engine_requests import req, run_one
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig

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
