"""``orchard bench engine --json`` prints the keys the issue lists (figures, not timed asserts)."""
from __future__ import annotations

import json

from cluster.cli import main
from tests.forged_models import tiny_model


def test_bench_engine_json_keys(capsys):
    assert main(["bench", "engine", "--model", str(tiny_model("llama")), "--turns", "3",
                 "--reply-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"turns", "ttft_warm_over_floor", "ttft_cold_over_warm", "bytes_per_cached_token",
            "theoretical_bytes_per_token"} <= set(out)
    assert len(out["turns"]) == 3
    for turn in out["turns"]:
        assert {"ttft_warm_s", "ttft_cold_s", "ttft_floor_s", "cached_tokens",
                "computed_tokens"} <= set(turn)
        assert turn["cached_tokens"] + turn["computed_tokens"] == turn["prompt_tokens"]
    assert out["turns"][0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 900 for t in out["turns"][1:])
    # tiny model: 2 layers x 2 kv heads x head_dim 16 x 2 (K and V) x 4 bytes
    assert out["theoretical_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert out["bytes_per_cached_token"] == out["theoretical_bytes_per_token"]
