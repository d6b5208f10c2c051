"""``orchard bench vs-mlx-lm`` (``cluster.bench.vs_mlx_lm``): the workload's presets and the
batch it sends, and (slow) the JSON keys the issues list (figures, not timed asserts)."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from tests.support.forged_models import tiny_model


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
