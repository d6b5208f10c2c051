"""BlockLedger at its edges: the exact expiry instant, the reuse-bonus cap, exact counters.

Each test pins a value a plausible one-token slip would change (``<`` for ``<=`` at the TTL,
the bonus cap of 3 reuses, which counter a removal lands in), so a mutation run of
``router/kv/ledger.py`` has a behaviour to break.
"""
from __future__ import annotations

import pytest

from router.kv.events import BlockRemoved, BlockStored, Tier
from router.kv.key import BlockHash
from router.kv.ledger import (BlockLedger, Eviction, Holding, LedgerEvent, LedgerEventKind,
                           LedgerStats)
from tests.conftest import Clock

ROOT = BlockHash(999)
NS = "ns"


def blocks(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]


def test_a_block_expires_at_exactly_its_ttl_and_not_before():
    clock = Clock()
    removed: list = []
    led = BlockLedger(100, 10.0, clock, 1, on_remove=lambda h, why: removed.append((h, why)))
    chain = blocks(1, 2, 3)
    assert led.insert(chain, 4, NS, ROOT) == chain
    clock.now = 9.5
    assert led.peek(chain) == 3
    assert led.expire() == []
    clock.now = 10.0  # idle for exactly ttl_s: gone
    assert led.peek(chain) == 0
    assert led.expire() == blocks(3, 2, 1)  # leaves first
    assert removed == [(h, LedgerEventKind.EXPIRED) for h in blocks(3, 2, 1)]
    assert [(e.kind, e.block, e.at) for e in led.log()[3:]] == [
        (LedgerEventKind.EXPIRED, h, 10.0) for h in blocks(3, 2, 1)]
    assert led.stats() == LedgerStats(blocks=0, tokens=0, bytes=0, capacity_bytes=100,
                                      lookups=0, hit_blocks=0, stored_blocks=3, evictions=0,
                                      expirations=3, invalidations=0)


def test_match_and_insert_drop_a_block_at_exactly_its_ttl():
    clock = Clock()
    led = BlockLedger(100, 10.0, clock, 1)
    chain = blocks(1, 2)
    led.insert(chain, 4, NS, ROOT)
    clock.now = 10.0
    assert led.match(chain) == 0
    assert len(led) == 0
    led.insert(chain, 4, NS, ROOT)
    clock.now = 20.0
    assert led.insert(chain, 4, NS, ROOT) == chain  # stored again, not touched
    assert led.stats().expirations == 4


def test_the_reuse_bonus_stops_at_three_reuses():
    """Priority is last use + horizon x min(hits, 3): a fourth reuse earns nothing more."""
    clock = Clock()
    led = BlockLedger(2, 1e9, clock, 1, policy=Eviction.REUSE)
    led.insert(blocks(1), 1, NS, ROOT)
    clock.now = 1.0
    led.insert(blocks(2), 1, NS, ROOT)
    clock.now = 2.0
    led.insert(blocks(3), 1, NS, ROOT)  # evicts 1 (priority 0): horizon = 2 s
    assert BlockHash(1) not in led
    clock.now = 3.0
    for _ in range(4):
        assert led.match(blocks(2)) == 1  # 4 hits, capped at 3: priority 3 + 2 x 3 = 9
    clock.now = 4.0
    for _ in range(3):
        assert led.match(blocks(3)) == 1  # 3 hits: priority 4 + 2 x 3 = 10
    clock.now = 5.0
    assert led.insert(blocks(4), 1, NS, ROOT) == blocks(4)
    assert [h for h in blocks(2, 3, 4) if h in led] == blocks(3, 4)  # 9 < 10: block 2 goes
    assert [e.block for e in led.log() if e.kind is LedgerEventKind.EVICTED] == blocks(1, 2)


def test_reuse_horizon_is_the_age_of_the_last_victim():
    clock = Clock()
    led = BlockLedger(2, 1e9, clock, 1, policy=Eviction.REUSE)
    led.insert(blocks(1), 1, NS, ROOT)
    clock.now = 1.0
    led.insert(blocks(2), 1, NS, ROOT)
    clock.now = 5.0
    led.insert(blocks(3), 1, NS, ROOT)  # victim 1 last used at 0: horizon = 5 s
    led.match(blocks(2))                # one hit at 5: priority 5 + 5 = 10
    clock.now = 9.0
    led.insert(blocks(4), 1, NS, ROOT)  # 3 (priority 5) goes, horizon = 9 - 5 = 4 s
    assert [h for h in blocks(2, 3, 4) if h in led] == blocks(2, 4)
    clock.now = 9.5
    led.insert(blocks(5), 1, NS, ROOT)  # 4 (priority 9) goes before 2 (priority 10)
    assert [h for h in blocks(2, 4, 5) if h in led] == blocks(2, 5)


def test_restore_fills_the_budget_exactly_and_never_evicts():
    clock = Clock()
    clock.now = 100.0
    led = BlockLedger(8, 60.0, clock, 1, policy=Eviction.REUSE, tier=Tier.DISK)
    assert led.restore(BlockHash(1), ROOT, 4, NS, last_used=90.0) is True
    assert led.restore(BlockHash(1), ROOT, 4, NS, last_used=90.0) is False  # already held
    assert led.restore(BlockHash(2), BlockHash(1), 4, NS, last_used=95.0) is True  # 8 of 8
    assert led.restore(BlockHash(3), BlockHash(2), 1, NS, last_used=95.0) is False
    assert led.used_bytes == 8
    assert led.holdings() == [Holding(BlockHash(2), BlockHash(1), 4, NS, Tier.DISK),
                              Holding(BlockHash(1), ROOT, 4, NS, Tier.DISK)]
    clock.now = 150.0  # block 1 last used at 90: idle 60 s, expired; block 2 idle 55 s
    assert led.peek(blocks(1)) == 0
    assert led.chain_to(BlockHash(2)) == blocks(1, 2)
    assert led.drain_events() == [BlockStored(BlockHash(1), ROOT, 4, NS, Tier.DISK),
                                  BlockStored(BlockHash(2), BlockHash(1), 4, NS, Tier.DISK)]


def test_counters_and_log_name_each_removal_reason():
    clock = Clock()
    led = BlockLedger(8, 10.0, clock, 2)  # 2 bytes per token: room for 4 tokens
    led.insert(blocks(1), 2, NS, ROOT)
    led.insert(blocks(2), 2, "other", ROOT)
    assert led.used_bytes == 8
    clock.now = 1.0
    assert led.match(blocks(1, 7)) == 1
    led.insert(blocks(3), 2, NS, ROOT)    # evicts 2 (the LRU leaf)
    assert led.namespaces() == [NS]
    assert led.invalidate_namespace(NS) == 2
    assert led.drain_events() == [
        BlockStored(BlockHash(1), ROOT, 2, NS), BlockStored(BlockHash(2), ROOT, 2, "other"),
        BlockRemoved(BlockHash(2), "other"), BlockStored(BlockHash(3), ROOT, 2, NS),
        BlockRemoved(BlockHash(1), NS), BlockRemoved(BlockHash(3), NS)]
    assert [e.kind for e in led.log()] == [
        LedgerEventKind.CREATED, LedgerEventKind.CREATED, LedgerEventKind.HIT,
        LedgerEventKind.EVICTED, LedgerEventKind.CREATED, LedgerEventKind.INVALIDATED,
        LedgerEventKind.INVALIDATED]
    assert led.stats() == LedgerStats(blocks=0, tokens=0, bytes=0, capacity_bytes=8,
                                      lookups=1, hit_blocks=1, stored_blocks=3, evictions=1,
                                      expirations=0, invalidations=2)
    assert led.log()[2] == LedgerEvent(LedgerEventKind.HIT, BlockHash(1), NS, 1.0, 1)
    with pytest.raises(ValueError, match=r"unknown namespace 'ns': held namespaces are none"):
        led.invalidate_namespace(NS)


def test_children_age_and_touch_report_exact_values():
    clock = Clock()
    led = BlockLedger(100, 10.0, clock, 1)
    led.insert(blocks(1, 2), 4, NS, ROOT)
    led.insert(blocks(1, 3), 4, NS, ROOT)
    assert sorted(led.children(BlockHash(1))) == blocks(2, 3)
    assert led.children(ROOT) == blocks(1)
    assert led.children(BlockHash(2)) == []
    assert led.parent(BlockHash(3)) == BlockHash(1)
    clock.now = 6.0
    assert led.age(BlockHash(2)) == 6.0
    led.touch(blocks(1, 2, 7))  # 7 is not held: ignored; 1 and 2 used now, 3 is not
    assert led.log()[-1].kind is LedgerEventKind.CREATED  # touching logs no hit
    clock.now = 10.0            # 3 idle for exactly 10 s: expired; 1 and 2 idle for 4 s
    assert led.expire() == blocks(3)
    assert led.age(BlockHash(2)) == 10.0  # age counts from creation, not last use
    assert led.chain_to(BlockHash(9)) == []
