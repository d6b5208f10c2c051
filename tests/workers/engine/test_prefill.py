"""Prompts in prefill (``workers.engine.prefill``) through a real engine: a prompt prefilled in
chunks gives the tokens and log-probabilities of one prefilled whole, with its first token at
the step whose chunk reaches its end; and the last token run inside its chunk (through the
vocabulary projection of the body) or on its own (the whole model) gives the same tokens."""
from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import Clock
from tests.support.engine_requests import prompt_of, req
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.model.model_dir import open_model_dir

BS = 16


class TestChunkedPrefill:
    def test_chunked_prefill_gives_the_same_tokens_and_logprobs(self):
        whole = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, use_store=False))
        chunked = Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, use_store=False,
                                                                prefill_budget=16))
        prompt = prompt_of(100, seed=60)
        runs = []
        for eng in (whole, chunked):
            eng.submit(req(eng, prompt, max_tokens=8))
            steps, deltas = [], []
            while eng.busy:
                out = eng.step()
                steps.append(len(out.deltas))
                deltas += out.deltas
            assert len(deltas) == 8
            runs.append(deltas)
        assert [d.token for d in runs[0]] == [d.token for d in runs[1]]
        assert float(abs(runs[0][0].logprobs - runs[1][0].logprobs).max()) <= 1e-5
        # 100 tokens in chunks of 16: the 7th step runs the last 4 and gives the first token
        assert steps[:7] == [0, 0, 0, 0, 0, 0, 1]


    @pytest.mark.parametrize("budget", [512, 16])
    def test_a_last_token_in_the_chunk_and_one_on_its_own_give_the_same_tokens(self, budget):
        loaded = open_model_dir(tiny_model("llama"))
        apart = dataclasses.replace(loaded, config={**loaded.config, "model_type": "gemma3"})
        config = EngineConfig(block_size=BS, prefill_budget=budget)
        runs = []
        for model in (loaded, apart):
            eng = Engine(model, config, Clock(), lambda: 0)
            eng.submit(req(eng, prompt_of(100, seed=71), max_tokens=6))
            deltas = []
            while eng.busy:
                deltas += eng.step().deltas
            runs.append(deltas)
        assert [d.token for d in runs[0]] == [d.token for d in runs[1]]
        assert len(runs[0]) == 6
        assert float(abs(runs[0][0].logprobs - runs[1][0].logprobs).max()) <= 1e-5
