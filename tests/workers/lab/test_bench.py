"""``orchard bench engine --json`` and ``orchard bench vs-mlx-lm --json`` print the keys the
issues list (figures, not timed asserts)."""
from __future__ import annotations

import json

import pytest

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


def test_bench_engine_refuses_a_long_prompt_past_the_context(capsys):
    assert main(["bench", "engine", "--model", str(tiny_model("llama")), "--skip-turns",
                 "--long-prompt", "4000"]) != 0
    assert "does not fit the model's context of 2048" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_vs_mlx_lm_json_keys(capsys):
    assert main(["bench", "vs-mlx-lm", "--model", str(tiny_model("llama")), "--system-words",
                 "40", "--turns", "2", "--user-words", "8", "--reply-tokens", "4", "--chats",
                 "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(t["round"], t["turn"]) for t in out["turns"]] == [(0, 1), (0, 2)]
    assert all(t["ttft_orchard_s"] > 0 and t["ttft_mlx_lm_s"] > 0 for t in out["turns"])
    # the engine's own TTFT is inside the client's (through the frontend and Ray)
    assert all(0 < t["ttft_orchard_worker_s"] < t["ttft_orchard_s"] for t in out["turns"])
    assert out["orchard_side"] == "1-worker Ray cluster (orchard up)"
    assert out["batch_wall_orchard_s"] > 0 and out["batch_wall_mlx_lm_s"] > 0
    assert out["targets"] == {"warm_ttft": 0.9, "cold_ttft": 1.05, "batch_wall": 0.8}
    assert out["cold_ttft_ratio"] == out["turns"][0]["ttft_orchard_s"] / out["turns"][0][
        "ttft_mlx_lm_s"]
    b = out["batch_breakdown"]  # orchard's batch: 4 chats x 3 turns, 4 tokens each at most
    assert b["requests"] == 12 and b["wall_s"] == out["batch_wall_orchard_s"]
    assert 12 <= b["generated_tokens"] <= 48 and 0 < b["cached_tokens"] < b["prompt_tokens"]
    assert 0 < b["in_flight_mean"] <= 12


def test_a_preset_sets_the_shape_and_given_options_override_it():
    from cluster.bench.vs_mlx_lm import Workload

    w = Workload.of("short-chat", chats=4)
    assert (w.system_words, w.turns, w.user_words, w.reply_tokens, w.chats, w.system_prompts,
            w.history, w.clients) == (60, 3, 20, 24, 4, 2, 2, 8)
    assert Workload.of(None) == Workload()
    with pytest.raises(ValueError, match="--preset must be one of short-chat, got 'long'"):
        Workload.of("long")


def test_the_batch_sends_every_turn_of_every_chat_turn_by_turn():
    from cluster.bench.vs_mlx_lm import Workload, batch_requests

    w = Workload(system_words=5, user_words=3, reply_tokens=4, chats=3, history=2)
    first, second = batch_requests(w, 0), batch_requests(w, 1)
    assert len(first) == 9
    # turn-major: three first turns, then three second turns, then three third turns
    assert [len(m) for m in first] == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    for chat in range(3):
        turns = first[chat::3]
        for k in range(2):  # turn k + 1 is turn k, a reply of 2 words and a new question
            assert turns[k + 1][:len(turns[k])] == turns[k]
            assert turns[k + 1][len(turns[k])]["role"] == "assistant"
            assert len(turns[k + 1][len(turns[k])]["content"].split()) == 2
    # chats take the 2 system prompts in turn
    assert first[0][0] != first[1][0] and first[2][0] == first[0][0]
    assert first[0][1]["content"].startswith("round 0: ")
    assert second[0][1]["content"] == "round 1: " + first[0][1]["content"][len("round 0: "):]
    assert [m[0] for m in second] == [m[0] for m in first]  # the system prompts stay shared
    assert second[3][2:] == first[3][2:]
