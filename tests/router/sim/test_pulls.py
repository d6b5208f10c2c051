"""``router.sim.pulls``: what a pull between two simulated stores brings and costs. The pull a
simulated worker makes first is in ``test_linear.py``."""
from __future__ import annotations

import pytest

from router.kv.key import BlockHash
from router.kv.tiers import TieredLedger
from router.pull_cost import LinkRate
from router.sim.pulls import SimPull, pull_between
from tests.support.sim_traces import BS


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
