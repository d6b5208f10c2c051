"""``workers.lab.bench_sched``: the scheduler's figures (decode stall, batched prefill) refuse a
long prompt the model cannot hold, named with the model's context."""
from __future__ import annotations

from cluster.cli import main
from tests.support.forged_models import tiny_model


def test_bench_engine_refuses_a_long_prompt_past_the_context(capsys):
    assert main(["bench", "engine", "--model", str(tiny_model("llama")), "--skip-turns",
                 "--long-prompt", "4000"]) != 0
    assert "does not fit the model's context of 2048" in capsys.readouterr().err
