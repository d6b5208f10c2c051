"""``orchard bench cache-controls`` runs at a small size and reports every figure."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from tests.support.forged_models import tiny_model


@pytest.mark.slow
def test_the_bench_runs_small_and_prints_its_figures(capsys):
    assert main(["bench", "cache-controls", "--model", str(tiny_model()), "--system-words",
                 "20", "--messages", "3", "--rounds", "1", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == {
        "model", "prompt_tokens", "rounds", "warm_ttft_s", "read_false_ttft_s",
        "read_false_ttft_ratio", "cold_ttft_s", "write_false_ttft_s", "validate_ms",
        "diagnosis_validate_ms", "diagnosis_validate_ratio", "load_average"}
    assert figures["rounds"] == 1 and figures["prompt_tokens"] > 16
    assert all(figures[k] > 0 for k in ("warm_ttft_s", "read_false_ttft_s", "cold_ttft_s",
                                        "write_false_ttft_s", "validate_ms"))
