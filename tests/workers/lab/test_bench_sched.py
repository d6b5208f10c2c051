"""``workers.lab.bench_sched``: the scheduler's figures (decode stall, batched prefill) refuse a
long prompt the model cannot hold, named with the model's context; their JSON shape, the
prompts they draw, and a batch that would not share a prefill step refused."""
from __future__ import annotations

import random

import pytest

from cluster.cli import main
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine, EngineConfig
from workers.lab.bench_sched import (BatchedPrefill, StallFigures, _prompt, as_json,
                                     batched_prefill)


def test_bench_engine_refuses_a_long_prompt_past_the_context(capsys):
    assert main(["bench", "engine", "--model", str(tiny_model("llama")), "--skip-turns",
                 "--long-prompt", "4000"]) != 0
    assert "does not fit the model's context of 2048" in capsys.readouterr().err


class TestTheFigures:
    def test_as_json_nests_the_prefill_figures_beside_the_stall_ones(self):
        stall = StallFigures(0.01, 0.02, 0.03, 0.05, 2.5, 3.0, 2.0, 2.2, 4000, 512)
        prefill = BatchedPrefill(4, 128, 900.0, 300.0)
        assert as_json(stall, prefill) == {
            "tpot_idle_p50_s": 0.01, "tpot_idle_p99_s": 0.02, "tpot_admitting_p50_s": 0.03,
            "tpot_admitting_p99_s": 0.05, "decode_stall_ratio": 2.5,
            "decode_stall_ratio_p50": 3.0, "decode_stall_ratio_cpu": 2.0,
            "decode_stall_ratio_cpu_p50": 2.2, "long_prompt_tokens": 4000,
            "long_prompt_tokens_prefilled": 512,
            "prefill_tokens_per_s": {"prompts": 4, "prompt_tokens": 128,
                                     "batched_tokens_per_s": 900.0,
                                     "one_at_a_time_tokens_per_s": 300.0}}

    def test_a_prompt_draws_from_the_second_quarter_of_the_vocabulary_by_its_seed(self):
        prompt = _prompt(random.Random(3), 500, 1000)
        assert len(prompt) == 500 and min(prompt) >= 250 and max(prompt) < 500
        assert prompt == _prompt(random.Random(3), 500, 1000)


class TestBatchedPrefill:
    def test_a_batch_past_the_prefill_budget_is_refused_and_one_within_it_measured(self):
        engine = Engine.open(tiny_model("llama"), EngineConfig(block_size=16, prefill_budget=64))
        with pytest.raises(ValueError) as refused:
            batched_prefill(engine, prompts=3, prompt_tokens=32)
        assert str(refused.value) == ("3 x 32 tokens exceed the engine's prefill budget of 64: "
                                      "they would not share a step")
        figures = batched_prefill(engine, prompts=2, prompt_tokens=32, rounds=1)
        assert (figures.prompts, figures.prompt_tokens) == (2, 32)
        assert figures.batched_tokens_per_s > 0 and figures.one_at_a_time_tokens_per_s > 0
