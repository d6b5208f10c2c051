"""``orchard bench spec`` at a tiny size: it runs, and prints the keys the checks read."""
from __future__ import annotations

import json

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.bench.spec import SpecWorkload, copy_messages
from cluster.cli import main
from tests.support.forged_models import near_draft, tiny_model


def test_the_json_names_every_figure(capsys):
    assert main(["bench", "spec", "--model", str(tiny_model("llama")), "--requests", "2",
                 "--passage-tokens", "20", "--max-tokens", "6", "--chats", "1", "--batch", "2",
                 "--no-mlx-lm", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    for key in ("copy_speedup_batch1", "copy_speedup_batch8", "chat_speedup"):
        assert figures[key] > 0
    assert figures["vs_mlx_lm_copy_wall_ratio"] is None  # --no-mlx-lm
    assert figures["greedy_identical"] is True
    assert figures["workload"]["requests"] == 2
    assert figures["draft_model"] is figures["draft_prefill_over_target_prefill"] is None


def test_with_a_draft_model(capsys):
    draft = str(near_draft())
    assert main(["bench", "spec", "--model", str(tiny_model("llama")), "--requests", "2",
                 "--passage-tokens", "20", "--max-tokens", "6", "--chats", "1", "--batch", "2",
                 "--no-mlx-lm", "--json", "--draft-model", draft]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["draft_model"] == figures["workload"]["draft_model"] == draft
    assert figures["greedy_identical"] is True
    assert figures["acceptance_rate"] is not None and figures["draft_s_per_verify_pass"] > 0
    assert figures["draft_prefill_over_target_prefill"] > 0


def test_the_copy_job_quotes_corrects_and_reformats_its_own_passage():
    messages = copy_messages(SpecWorkload(requests=3, passage_tokens=60))
    tasks = [m[0]["content"].split("\n\n")[0] for m in messages]
    assert [t.split()[0] for t in tasks] == ["Quote", "Correct", "Rewrite"]
    assert all(45 <= len(m[0]["content"].split("\n\n")[1].split()) <= 60 for m in messages)


def test_bad_sizes_are_refused(capsys):
    assert main(["bench", "spec", "--requests", "0"]) != 0
    assert "--requests must be >= 1, got 0" in capsys.readouterr().err
