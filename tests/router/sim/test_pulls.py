"""Pulls in the simulator (``router.sim.pulls``, ``--link-gbps``): what a pull between two
simulated stores brings and costs, and a hot document whose second worker pulls it instead of
prefilling it, with the router's own decision; a slow link pulls nothing."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from router.kv.key import BlockHash
from router.kv.tiers import TieredLedger
from router.pull_cost import LinkRate
from router.sim.pulls import SimPull, pull_between
from router.sim.simulator import SimConfig, replay
from router.sim.trace import TraceRequest, write_trace

BS = 512
# a 4,096-token document (8 blocks) and one question block each, 20 requests a second
HOT = [TraceRequest(i * 0.05, 9 * BS, 4, tuple(range(1, 9)) + (1000 + i,)) for i in range(60)]


def _ledger(blocks: int) -> TieredLedger:
    tiers = TieredLedger(100 * BS, 0, 3600.0, lambda: 0.0)
    if blocks:
        tiers.insert([BlockHash(h) for h in range(1, blocks + 1)], BS, "trace", BlockHash(0))
    return tiers


def test_a_pull_brings_what_the_source_holds_past_the_receivers_own():
    link = LinkRate(1e9, 0.002)
    chain = [BlockHash(h) for h in range(1, 7)]
    got = pull_between(_ledger(1), _ledger(4), chain, 6, BS, link, 1000)
    assert got == SimPull(4, 3 * BS, pytest.approx(0.002 + 3 * BS * 1000 / 1e9))
    assert pull_between(_ledger(4), _ledger(4), chain, 6, BS, link, 1000) == SimPull(4, 0, 0.0)


def test_a_hot_documents_second_worker_pulls_it_instead_of_prefilling_it():
    alone = replay(HOT, "orchard", SimConfig(workers=2))
    pulled = replay(HOT, "orchard", SimConfig(workers=2, link_gbps=10.0))
    assert (alone.pulled_tokens, pulled.pulled_tokens) == (0, 8 * BS)   # one pull, once
    assert pulled.prefill_tokens == alone.prefill_tokens - 8 * BS
    assert pulled.ttft_mean_s < alone.ttft_mean_s
    assert pulled.reasons["load_spill"] == 1


def test_a_link_too_slow_pulls_nothing():
    slow = replay(HOT, "orchard", SimConfig(workers=2, link_gbps=0.01))
    alone = replay(HOT, "orchard", SimConfig(workers=2))
    assert slow.pulled_tokens == 0
    assert (slow.prefill_tokens, slow.reasons) == (alone.prefill_tokens, alone.reasons)


def test_the_cli_reports_the_setting_and_each_policys_pulled_tokens(tmp_path, capsys):
    path = tmp_path / "hot.jsonl"
    write_trace(HOT, path)
    assert main(["simulate", "--trace", str(path), "--workers", "2", "--policies",
                 "orchard,round_robin", "--link-gbps", "10", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pulls"] == {"link_gbps": 10.0, "link_fixed_s": 0.002}
    assert [(p["name"], p["pulled_tokens"]) for p in out["policies"]] == [
        ("orchard", 8 * BS), ("round_robin", 0)]


def test_a_negative_link_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match="--link-gbps and --link-fixed-ms must be >= 0"):
        SimConfig(link_gbps=-1.0)
