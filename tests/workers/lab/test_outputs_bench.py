"""``orchard bench outputs`` runs end to end on a small model and prints the figures the
checks read (the figures themselves are measured on an idle machine, not asserted here)."""
from __future__ import annotations

import json

from cluster.cli import main
from tests.support.forged_models import tiny_model

KEYS = {"json_schema_wall_ratio", "json_schema_valid_share", "logprobs_wall_ratio",
        "mask_share_of_step", "tpot_ratio", "compile_ms", "load_average"}


def test_the_bench_prints_its_figures(capsys):
    assert main(["bench", "outputs", "--model", str(tiny_model()), "--requests", "3",
                 "--rounds", "1", "--max-tokens", "40", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert KEYS <= set(figures)
    assert figures["requests"] == 3 and figures["max_tokens"] == 40
    assert 0.0 <= figures["json_schema_valid_share"] <= 1.0
    assert figures["json_wall_s"] > 0 and figures["free_output_tokens"] > 0


def test_the_same_job_runs_through_mlx_lm_server_beside(capsys):
    assert main(["bench", "outputs", "--model", str(tiny_model()), "--requests", "2",
                 "--rounds", "1", "--max-tokens", "8", "--json", "--vs-mlx-lm"]) == 0
    mlx = json.loads(capsys.readouterr().out)["mlx_lm"]
    assert set(mlx) == {"free_wall_s", "logprobs_wall_s", "json_wall_s", "free_output_tokens",
                        "json_output_tokens", "logprobs_wall_ratio", "json_schema_wall_ratio",
                        "json_schema_valid_share"}
    # Greedy, 8 tokens each, a tiny model that never stops early: all 16 tokens counted.
    assert mlx["free_output_tokens"] == 16
    assert mlx["free_wall_s"] > 0 and 0.0 <= mlx["json_schema_valid_share"] <= 1.0
