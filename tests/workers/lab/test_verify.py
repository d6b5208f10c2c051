"""``orchard verify``: passes on standard-cache models, fails on a wrong reuse, refuses the rest."""
from __future__ import annotations

import json

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from cluster.cli import main
from tests.support.forged_models import tiny_model
from workers.engine.kept import KeptCaches
from workers.cache import store


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verify_passes(arch, capsys):
    assert main(["verify", "--model", str(tiny_model(arch)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["greedy_token_agreement"] == 1.0
    assert report["max_abs_logit_diff"] <= 1e-4
    assert len(report["cases"]) == 9
    assert report["cases"][5]["name"] == "next turns extend the kept cache"
    assert report["cases"][6]["name"] == "returned log-probabilities (top 5) vs a recompute"
    assert all(c["cached_tokens"] > 0 for c in report["cases"][:7])
    spec = report["cases"][7]
    assert spec["name"] == "speculation (drafts verified) vs plain decoding"
    assert spec["notes"][0].startswith("drafted ") and spec["passed"]
    pulled = report["cases"][8]
    assert pulled["name"] == "a prefix pulled from a peer's store"
    assert pulled["cached_tokens"] > 0


def test_verify_catches_a_verify_pass_that_accepts_a_rejected_draft(monkeypatch, capsys):
    import workers.engine.decode as decode

    accepted = decode.greedy_accepted
    monkeypatch.setattr(decode, "greedy_accepted",
                        lambda draft, targets: min(len(draft), accepted(draft, targets) + 1))
    assert main(["verify", "--model", str(tiny_model("llama")), "--json", "--no-tiers"]) == 1
    cases = json.loads(capsys.readouterr().out)["cases"]


def test_verify_catches_a_wrong_reuse(monkeypatch, capsys):
    assemble = store.assemble

    def off_by_a_little(parts, tokens, layers):
        caches = assemble(parts, tokens, layers)
        for c in caches:
            c.keys = c.keys + 1e-2
        mx.eval([c.keys for c in caches])
        return caches

    monkeypatch.setattr(store, "assemble", off_by_a_little)
    assert main(["verify", "--model", str(tiny_model("llama"))]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_catches_a_wrong_kept_cache(monkeypatch, capsys):
    take = KeptCaches.take

    def off_by_a_little(self, namespace, prompt, tokens, block_size=1):
        taken = take(self, namespace, prompt, tokens, block_size)
        for c in taken[0] if taken else ():
            c.keys = c.keys + 1e-2
        return taken

    monkeypatch.setattr(KeptCaches, "take", off_by_a_little)
    assert main(["verify", "--model", str(tiny_model("llama")), "--json"]) == 1
    cases = json.loads(capsys.readouterr().out)["cases"]
    assert [c["name"] for c in cases if not c["passed"]] == ["next turns extend the kept cache"]


def test_verify_refuses_unsupported_caches(capsys):
    assert main(["verify", "--model", str(tiny_model("llama", sliding=True))]) == 2
    assert "RotatingKVCache" in capsys.readouterr().err
