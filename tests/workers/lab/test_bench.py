"""``orchard bench engine --json`` (``workers.lab.bench``) prints the keys the issues list
(figures, not timed asserts)."""
from __future__ import annotations

import json

from cluster.cli import main
from tests.support.forged_models import tiny_model


def test_bench_engine_json_keys(capsys):
    assert main(["bench", "engine", "--model", str(tiny_model("llama")), "--turns", "3",
                 "--reply-tokens", "8", "--long-prompt", "600", "--stall-rounds", "1",
                 "--prefill-prompts", "3", "--prefill-tokens", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"turns", "ttft_warm_over_floor", "ttft_cold_over_warm", "bytes_per_cached_token",
            "theoretical_bytes_per_token", "decode_stall_ratio", "decode_stall_ratio_cpu",
            "decode_stall_ratio_cpu_p50", "tpot_idle_p99_s",
            "tpot_admitting_p99_s", "prefill_tokens_per_s"} <= set(out)
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
    assert out["decode_stall_ratio"] > 0 and out["long_prompt_tokens"] == 600
    assert out["decode_stall_ratio_cpu"] > 0 and out["decode_stall_ratio_cpu_p50"] > 0
    assert 0 < out["long_prompt_tokens_prefilled"] < 600  # aborted before it completes
    prefill = out["prefill_tokens_per_s"]
    assert (prefill["prompts"], prefill["prompt_tokens"]) == (3, 40)
    assert prefill["batched_tokens_per_s"] > 0 and prefill["one_at_a_time_tokens_per_s"] > 0
