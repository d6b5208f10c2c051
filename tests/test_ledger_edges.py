"""BlockLedger's remaining edges: limits, byte arithmetic, tie order, the reuse horizon, restore.

Like ``test_ledger_exact.py``, each test pins an exact value that a one-token slip in
``router/kv/ledger.py`` changes: a bound off by one, a count assigned instead of added, the
horizon clamped at the wrong floor, an equal-priority tie broken by hash instead of age.
"""
from __future__ import annotations

import re

import pytest

from router.kv.events import BlockRemoved, Tier
from router.kv.key import BlockHash
from router.kv.ledger import BlockLedger, LedgerEvent, LedgerEventKind

from tests.conftest import Clock

ROOT = BlockHash(999)
NS = "ns"
CREATED, EVICTED = LedgerEventKind.CREATED, LedgerEventKind.EVICTED
INVALIDATED = LedgerEventKind.INVALIDATED


def blocks(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]


def evicted(led: BlockLedger) -> list[BlockHash]:
    return [e.block for e in led.log() if e.kind is EVICTED]


def test_constructor_bounds_and_their_messages():
    clock = Clock()
    assert BlockLedger(0, 0.5, clock, 1).insert(blocks(1), 1, NS, ROOT) == []  # both allowed
    with pytest.raises(ValueError, match=re.escape(
            "capacity_bytes must be >= 0 and bytes_per_token > 0, got -1 and 1")):
        BlockLedger(-1, 1.0, clock, 1)
    with pytest.raises(ValueError, match=re.escape("got 8 and 0")):
        BlockLedger(8, 1.0, clock, 0)
    with pytest.raises(ValueError, match=re.escape("ttl_s must be positive seconds, got 0")):
        BlockLedger(8, 0, clock, 1)
    with pytest.raises(ValueError, match=re.escape(
            "unknown eviction policy 'fifo': use one of lru, reuse")):
        BlockLedger(8, 1.0, clock, 1, policy="fifo")
    led = BlockLedger(8, 1.0, clock, 1)
    with pytest.raises(ValueError, match=re.escape(
            "token_counts must be one positive count per block (or one block size); "
            "got 2 counts for 2 blocks")):
        led.insert(blocks(1, 2), [4, 0], NS, ROOT)


def test_the_event_log_keeps_the_last_10000_entries_by_default():
    led = BlockLedger(100, 1e9, Clock(), 1)
    led.insert(blocks(1), 1, NS, ROOT)
    for _ in range(10_000):
        led.match(blocks(1))
    log = led.log()
    assert len(log) == 10_000 and log[0].kind is LedgerEventKind.HIT  # the CREATED one left


def test_ttl_left_age_and_lookup_counters_are_exact():
    clock = Clock(2.0)
    led = BlockLedger(100, 10.0, clock, 1)
    led.insert(blocks(1, 2), 1, NS, ROOT)
    clock.now = 6.0
    assert led.ttl_left(BlockHash(1)) == 6.0
    assert led.age(BlockHash(1)) == 4.0
    assert led.ttl_left(BlockHash(7)) == 0.0  # not held
    assert led.match(blocks(1, 2)) == 2 and led.match(blocks(1)) == 1
    assert led.match(blocks(5)) == 0
    assert (led.stats().lookups, led.stats().hit_blocks) == (3, 3)
    assert led.ttl_left(BlockHash(2)) == 10.0  # used now
    clock.now = 17.0
    assert led.ttl_left(BlockHash(2)) == 0.0   # 1 s past its expiry: clamped, not -1


def test_bytes_are_tokens_times_bytes_per_token():
    clock = Clock()
    led = BlockLedger(12, 1e9, clock, 2, policy="lru")  # room for 6 tokens
    assert led.insert(blocks(1), 7, NS, ROOT) == []     # 14 bytes can never fit
    assert led.insert(blocks(2), 4, NS, ROOT) == blocks(2)
    assert led.insert(blocks(3), 1, NS, ROOT) == blocks(3)
    assert led.used_bytes == 10
    assert led.insert(blocks(4), 2, NS, ROOT) == blocks(4)  # 14 > 12: block 2 goes
    assert (BlockHash(2) in led, led.used_bytes) == (False, 6)
    assert led.restore(BlockHash(5), ROOT, 4, NS, last_used=0.0) is False  # 6 + 8 > 12
    assert led.restore(BlockHash(5), ROOT, 3, NS, last_used=0.0) is True   # 6 + 6 = 12


def test_equal_priorities_go_oldest_first_not_by_hash():
    clock = Clock()
    led = BlockLedger(2, 1e9, clock, 1, policy="reuse")
    led.insert(blocks(9), 1, NS, ROOT)
    led.insert(blocks(1), 1, NS, ROOT)   # the same instant: a tie, block 9 is older
    led.insert(blocks(5), 1, NS, ROOT)
    assert evicted(led) == blocks(9)


def test_restored_blocks_are_evicted_by_their_last_use_oldest_first():
    clock = Clock(10.0)
    led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
    assert led.restore(BlockHash(9), ROOT, 1, NS, last_used=5.0)
    assert led.restore(BlockHash(1), ROOT, 1, NS, last_used=5.0)
    led.insert(blocks(4), 1, NS, ROOT)
    led.insert(blocks(6), 1, NS, ROOT)   # 9 and 1 (last used at 5) before 4 (at 10)
    led.insert(blocks(7), 1, NS, ROOT)
    assert evicted(led) == blocks(9, 1)


def test_reuse_counts_every_hit_and_evicts_in_priority_order():
    clock = Clock()
    led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
    led.insert(blocks(1), 1, NS, ROOT)
    clock.now = 1.0
    led.insert(blocks(2), 1, NS, ROOT)
    led.insert(blocks(3), 1, NS, ROOT)
    clock.now = 2.0
    led.insert(blocks(4), 1, NS, ROOT)  # 1 (priority 0) goes: horizon 2 s
    clock.now = 3.0
    led.match(blocks(2))
    led.match(blocks(2))                # two hits: priority 3 + 2 x 2 = 7
    clock.now = 6.0
    led.touch(blocks(3))                # priority 6
    clock.now = 8.0
    led.touch(blocks(4))                # priority 8
    assert led.insert(blocks(5, 6), 1, NS, ROOT) == blocks(5, 6)
    assert evicted(led) == blocks(1, 3, 2)  # 6, then 7; 8 stays


def test_the_horizon_starts_at_zero_and_is_the_victims_exact_age():
    clock = Clock()
    led = BlockLedger(2, 1e9, clock, 1, policy="reuse")
    led.insert(blocks(1), 1, NS, ROOT)
    led.match(blocks(1))                # no victim yet: horizon 0, the hit adds nothing
    clock.now = 0.5
    led.insert(blocks(2), 1, NS, ROOT)
    clock.now = 0.75
    led.insert(blocks(3), 1, NS, ROOT)  # 1 (priority 0) goes, not 2 (0.5): horizon 0.75
    clock.now = 1.0
    led.insert(blocks(4), 1, NS, ROOT)  # 2 (priority 0.5) goes: horizon 0.5, under a second
    led.match(blocks(3))                # priority 1 + 0.5 = 1.5
    clock.now = 1.25
    led.insert(blocks(5), 1, NS, ROOT)  # 4 (priority 1) goes
    clock.now = 1.75
    led.insert(blocks(6), 1, NS, ROOT)  # 5 (priority 1.25) goes ...
    led.insert(blocks(7), 1, NS, ROOT)  # ... then 3 (1.5), before 6 (1.75)
    assert evicted(led) == blocks(1, 2, 4, 5, 3)


def test_a_priority_never_drops_when_the_horizon_shrinks():
    clock = Clock()
    led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
    led.insert(blocks(1), 1, NS, ROOT)
    led.insert(blocks(2), 1, NS, ROOT)
    led.insert(blocks(3), 1, NS, ROOT)
    clock.now = 10.0
    led.insert(blocks(4), 1, NS, ROOT)  # 1 goes at age 10: horizon 10
    for _ in range(3):
        led.match(blocks(4))            # priority 10 + 10 x 3 = 40
    led.insert(blocks(5), 1, NS, ROOT)  # 2 goes (horizon 10), then 3 (horizon 10) ...
    led.insert(blocks(6), 1, NS, ROOT)
    clock.now = 11.0
    led.insert(blocks(7), 1, NS, ROOT)  # ... and 5 (priority 10): horizon 1
    led.touch(blocks(4))                # now + 1 x 3 = 14 < 40: it keeps 40
    clock.now = 20.0
    led.touch(blocks(6))                # 20
    led.touch(blocks(7))                # 20
    led.insert(blocks(8), 1, NS, ROOT)
    assert evicted(led) == blocks(1, 2, 3, 5, 6)
    assert BlockHash(4) in led


def test_a_long_lived_heap_is_compacted_and_keeps_its_order():
    clock = Clock()
    led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
    for h in (3, 8, 6):
        led.insert(blocks(h), 1, NS, ROOT)
    led.touch(blocks(8))                # two heap items for 8 at priority 0
    clock.now = 1.0
    led.touch(blocks(3))                # 3 before 6 at priority 1 ...
    led.touch(blocks(6))
    for _ in range(1100):               # ... and 1100 later items for 3: past 4 x 2 + 1024
        led.touch(blocks(3))
    led.insert(blocks(5), 1, NS, ROOT)  # 8 (priority 0) goes; the heap is rebuilt
    led.insert(blocks(7), 1, NS, ROOT)  # 3 and 6 tie at 1: 3 was used first
    led.insert(blocks(9), 1, NS, ROOT)
    assert evicted(led) == blocks(8, 3, 6)


def test_invalidation_removes_exactly_the_subtrees_and_logs_them():
    clock = Clock(1.0)
    led = BlockLedger(100, 10.0, clock, 1, tier=Tier.DISK)
    led.insert(blocks(1, 2, 5), 1, "a", ROOT)
    led.insert(blocks(1, 3), 1, "a", ROOT)
    led.insert(blocks(4), 1, "a", ROOT)
    led.insert(blocks(7), 1, "b", ROOT)
    with pytest.raises(ValueError, match="unknown namespace 'c': held namespaces are a, b"):
        led.invalidate_namespace("c")
    assert led.invalidate_prefix([]) == 0
    clock.now = 2.0
    assert led.invalidate_prefix(blocks(1, 2, 5)) == 1  # its last block only
    assert led.invalidate_prefix(blocks(1, 2)) == 1
    assert led.children(BlockHash(1)) == blocks(3)       # the sibling stays listed
    # 1 (with 3) and then 4, another root of "a": 3 is already gone when its turn comes
    assert led.invalidate_namespace("a") == 3
    assert led.namespaces() == ["b"]
    assert led.drain_events()[-3:] == [BlockRemoved(h, "a", Tier.DISK) for h in blocks(3, 1, 4)]
    assert led.log()[:5] == [LedgerEvent(CREATED, h, "a", 1.0) for h in blocks(1, 2, 5, 3, 4)]
    assert led.log()[6:] == [LedgerEvent(INVALIDATED, h, "a", 2.0)
                             for h in blocks(5, 2, 3, 1, 4)]


def test_a_parent_removed_before_its_child_is_an_invariant_error():
    clock = Clock()
    led = BlockLedger(100, 10.0, clock, 1)
    led.restore(BlockHash(1), ROOT, 1, NS, last_used=0.0)  # the parent first: the wrong order
    led.restore(BlockHash(2), BlockHash(1), 1, NS, last_used=0.0)
    clock.now = 10.0
    with pytest.raises(RuntimeError, match="block 0{31}1 removed before its children"):
        led.expire()
