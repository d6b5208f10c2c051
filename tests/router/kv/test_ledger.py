"""BlockLedger: exact eviction order, TTL from last use, invalidation, events, capacity.

BlockLedger at its edges: the exact expiry instant, the reuse-bonus cap, exact counters.

Each test pins a value a plausible one-token slip would change (``<`` for ``<=`` at the TTL,
the bonus cap of 3 reuses, which counter a removal lands in), so a mutation run of
``router/kv/ledger.py`` has a behaviour to break.

BlockLedger's remaining edges: limits, byte arithmetic, tie order, the reuse horizon, restore.

Like ``test_ledger_exact.py``, each test pins an exact value that a one-token slip in
``router/kv/ledger.py`` changes: a bound off by one, a count assigned instead of added, the
horizon clamped at the wrong floor, an equal-priority tie broken by hash instead of age.

The ledger's "reuse" eviction variant: reused blocks outlive blocks used once; leaves first.
"""
from __future__ import annotations

import pytest
from router.kv.events import BlockRemoved, BlockStored
from router.kv.key import BlockHash, Namespace, hash_blocks
from router.kv.ledger import BlockLedger, Eviction, LedgerEventKind
from tests.conftest import Clock
from router.kv.events import BlockRemoved, BlockStored, Tier
from router.kv.key import BlockHash
from router.kv.ledger import (BlockLedger, Eviction, Holding, LedgerEvent, LedgerEventKind,
                           LedgerStats)
import re
from router.kv.events import BlockRemoved, Tier
from router.kv.ledger import BlockLedger, LedgerEvent, LedgerEventKind
from router.kv.ledger import BlockLedger


BS = 4  # tokens per block

NS = Namespace("tenant-a", "m")

ROOT = NS.root()

def make_ledger(eviction: Eviction, blocks: int = 100, ttl: float = 60.0,
                clock: Clock | None = None, removed=None):
    """A ledger with room for ``blocks`` blocks of BS tokens at 1 byte per token."""
    on_remove = (lambda h, why: removed.append((h, why))) if removed is not None else None
    return BlockLedger(blocks * BS, ttl, clock or Clock(), 1, eviction, on_remove=on_remove)

def chain(*tokens: int) -> list[BlockHash]:
    """Block hashes of a prompt made of the given token ids (full blocks only)."""
    return hash_blocks(list(tokens), BS, NS)

def store(ledger: BlockLedger, hashes: list[BlockHash]) -> list[BlockHash]:
    return ledger.insert(hashes, BS, NS.label(), ROOT)

A = chain(*range(0, 12))           # a0 a1 a2

B = chain(*range(0, 8), 90, 91, 92, 93)  # shares a0 a1, then b2


class TestStoreLedger:
    def test_match_counts_leading_blocks_and_dedups_shared_prefix(self, eviction):
        ledger = make_ledger(eviction)
        assert store(ledger, A) == A
        assert store(ledger, B) == [B[2]]  # a0 a1 stored once
        assert ledger.stats().blocks == 4
        assert ledger.match(A) == 3
        assert ledger.match(chain(*range(0, 8), 7, 7, 7, 7)) == 2
        assert ledger.match(chain(5, 5, 5, 5)) == 0
        assert ledger.peek(B) == 3

    def test_evicts_least_recently_used_leaves_before_parents(self, eviction):
        clock = Clock()
        removed: list = []
        ledger = make_ledger(eviction, blocks=4, clock=clock, removed=removed)
        store(ledger, A)            # a0 a1 a2
        clock.now = 1
        store(ledger, B)            # b2 (a0 a1 touched)
        clock.now = 2
        ledger.match(A)             # a2 now more recent than b2
        clock.now = 3
        c = chain(50, 51, 52, 53, 54, 55, 56, 57)  # two new blocks: needs two evictions
        assert store(ledger, c) == c
        # b2 is the LRU leaf; then a2; a0/a1 (parents) only after their children.
        assert removed == [(B[2], LedgerEventKind.EVICTED), (A[2], LedgerEventKind.EVICTED)]
        clock.now = 4
        d = chain(60, 61, 62, 63, 64, 65, 66, 67)
        store(ledger, d)
        assert [h for h, _ in removed[2:]] == [A[1], A[0]]
        assert ledger.stats().evictions == 4

    def test_capacity_exhaustion_returns_what_fits(self, eviction):
        ledger = make_ledger(eviction, blocks=2)
        long = chain(*range(100, 120))  # 5 blocks, room for 2
        assert store(ledger, long) == long[:2]
        assert ledger.stats().blocks == 2
        # an oversized single block never evicts anything
        big = BlockLedger(3, 60.0, Clock(), 1)
        assert big.insert(A, BS, NS.label(), ROOT) == []

    def test_ttl_is_measured_from_last_use(self, eviction):
        clock = Clock()
        removed: list = []
        ledger = make_ledger(eviction, ttl=10, clock=clock, removed=removed)
        store(ledger, A)
        clock.now = 8
        assert ledger.match(A[:1]) == 1   # touches a0 only... and its chain to the root
        clock.now = 12                    # a1, a2 idle for 12 s; a0 for 4 s
        assert ledger.peek(A) == 1
        assert ledger.match(A) == 1
        assert removed == [(A[2], LedgerEventKind.EXPIRED), (A[1], LedgerEventKind.EXPIRED)]
        clock.now = 30
        assert ledger.expire() == [A[0]]
        assert ledger.stats().expirations == 3

    def test_invalidate_namespace_and_prefix(self, eviction):
        ledger = make_ledger(eviction)
        other = Namespace("tenant-b", "m")
        store(ledger, A)
        ledger.insert(hash_blocks(list(range(12)), BS, other), BS, other.label(), other.root())
        assert ledger.namespaces() == sorted([NS.label(), other.label()])
        assert ledger.invalidate_namespace(other.label()) == 3
        with pytest.raises(ValueError, match="unknown namespace"):
            ledger.invalidate_namespace(other.label())
        store(ledger, B)
        assert ledger.invalidate_prefix(A[:2]) == 3  # a1 takes a2 and b2 with it; a0 stays
        assert ledger.match(A) == 1
        assert ledger.invalidate_prefix(chain(9, 9, 9, 9)) == 0
        assert ledger.stats().blocks == 1

    def test_events_and_log(self, eviction):
        ledger = make_ledger(eviction, blocks=3)
        store(ledger, A)
        ledger.match(A)
        store(ledger, chain(7, 7, 7, 7))
        events = ledger.drain_events()
        assert events[:3] == [BlockStored(A[0], ROOT, BS, NS.label()),
                              BlockStored(A[1], A[0], BS, NS.label()),
                              BlockStored(A[2], A[1], BS, NS.label())]
        assert events[3] == BlockRemoved(A[2], NS.label())
        assert ledger.drain_events() == []
        kinds = [e.kind for e in ledger.log()]
        assert kinds == [LedgerEventKind.CREATED] * 3 + [
            LedgerEventKind.HIT, LedgerEventKind.EVICTED, LedgerEventKind.CREATED]
        assert ledger.log()[3].blocks == 3

    def test_holdings_list_parents_before_children(self, eviction):
        ledger = make_ledger(eviction)
        store(ledger, A)
        store(ledger, B)
        seen = set()
        for h in ledger.holdings():
            assert h.parent == ROOT or h.parent in seen
            seen.add(h.block)
        assert seen == set(A) | set(B)

    def test_bad_config_is_a_value_error(self, eviction):
        with pytest.raises(ValueError, match="policy"):
            BlockLedger(10, 1.0, Clock(), 1, policy="fifo")
        with pytest.raises(ValueError, match="ttl_s"):
            BlockLedger(10, 0.0, Clock(), 1)
        with pytest.raises(ValueError, match="token_counts"):
            make_ledger(eviction).insert(A, [4, 4], NS.label(), ROOT)


ROOT_EXACT = BlockHash(999)

NS_EXACT = "ns"

def blocks(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]


class TestExact:
    def test_a_block_expires_at_exactly_its_ttl_and_not_before(self):
        clock = Clock()
        removed: list = []
        led = BlockLedger(100, 10.0, clock, 1, on_remove=lambda h, why: removed.append((h, why)))
        chain = blocks(1, 2, 3)
        assert led.insert(chain, 4, NS_EXACT, ROOT_EXACT) == chain
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

    def test_match_and_insert_drop_a_block_at_exactly_its_ttl(self):
        clock = Clock()
        led = BlockLedger(100, 10.0, clock, 1)
        chain = blocks(1, 2)
        led.insert(chain, 4, NS_EXACT, ROOT_EXACT)
        clock.now = 10.0
        assert led.match(chain) == 0
        assert len(led) == 0
        led.insert(chain, 4, NS_EXACT, ROOT_EXACT)
        clock.now = 20.0
        assert led.insert(chain, 4, NS_EXACT, ROOT_EXACT) == chain  # stored again, not touched
        assert led.stats().expirations == 4

    def test_the_reuse_bonus_stops_at_three_reuses(self):
        """Priority is last use + horizon x min(hits, 3): a fourth reuse earns nothing more."""
        clock = Clock()
        led = BlockLedger(2, 1e9, clock, 1, policy=Eviction.REUSE)
        led.insert(blocks(1), 1, NS_EXACT, ROOT_EXACT)
        clock.now = 1.0
        led.insert(blocks(2), 1, NS_EXACT, ROOT_EXACT)
        clock.now = 2.0
        led.insert(blocks(3), 1, NS_EXACT, ROOT_EXACT)  # evicts 1 (priority 0): horizon = 2 s
        assert BlockHash(1) not in led
        clock.now = 3.0
        for _ in range(4):
            assert led.match(blocks(2)) == 1  # 4 hits, capped at 3: priority 3 + 2 x 3 = 9
        clock.now = 4.0
        for _ in range(3):
            assert led.match(blocks(3)) == 1  # 3 hits: priority 4 + 2 x 3 = 10
        clock.now = 5.0
        assert led.insert(blocks(4), 1, NS_EXACT, ROOT_EXACT) == blocks(4)
        assert [h for h in blocks(2, 3, 4) if h in led] == blocks(3, 4)  # 9 < 10: block 2 goes
        assert [e.block for e in led.log() if e.kind is LedgerEventKind.EVICTED] == blocks(1, 2)

    def test_reuse_horizon_is_the_age_of_the_last_victim(self):
        clock = Clock()
        led = BlockLedger(2, 1e9, clock, 1, policy=Eviction.REUSE)
        led.insert(blocks(1), 1, NS_EXACT, ROOT_EXACT)
        clock.now = 1.0
        led.insert(blocks(2), 1, NS_EXACT, ROOT_EXACT)
        clock.now = 5.0
        led.insert(blocks(3), 1, NS_EXACT, ROOT_EXACT)  # victim 1 last used at 0: horizon = 5 s
        led.match(blocks(2))                # one hit at 5: priority 5 + 5 = 10
        clock.now = 9.0
        led.insert(blocks(4), 1, NS_EXACT, ROOT_EXACT)  # 3 (priority 5) goes, horizon = 9 - 5 = 4 s
        assert [h for h in blocks(2, 3, 4) if h in led] == blocks(2, 4)
        clock.now = 9.5
        led.insert(blocks(5), 1, NS_EXACT, ROOT_EXACT)  # 4 (priority 9) goes before 2 (priority 10)
        assert [h for h in blocks(2, 4, 5) if h in led] == blocks(2, 5)

    def test_restore_fills_the_budget_exactly_and_never_evicts(self):
        clock = Clock()
        clock.now = 100.0
        led = BlockLedger(8, 60.0, clock, 1, policy=Eviction.REUSE, tier=Tier.DISK)
        assert led.restore(BlockHash(1), ROOT_EXACT, 4, NS_EXACT, last_used=90.0) is True
        assert led.restore(BlockHash(1), ROOT_EXACT, 4, NS_EXACT, last_used=90.0) is False  # already held
        assert led.restore(BlockHash(2), BlockHash(1), 4, NS_EXACT, last_used=95.0) is True  # 8 of 8
        assert led.restore(BlockHash(3), BlockHash(2), 1, NS_EXACT, last_used=95.0) is False
        assert led.used_bytes == 8
        assert led.holdings() == [Holding(BlockHash(2), BlockHash(1), 4, NS_EXACT, Tier.DISK),
                                  Holding(BlockHash(1), ROOT_EXACT, 4, NS_EXACT, Tier.DISK)]
        clock.now = 150.0  # block 1 last used at 90: idle 60 s, expired; block 2 idle 55 s
        assert led.peek(blocks(1)) == 0
        assert led.chain_to(BlockHash(2)) == blocks(1, 2)
        assert led.drain_events() == [BlockStored(BlockHash(1), ROOT_EXACT, 4, NS_EXACT, Tier.DISK),
                                      BlockStored(BlockHash(2), BlockHash(1), 4, NS_EXACT, Tier.DISK)]

    def test_counters_and_log_name_each_removal_reason(self):
        clock = Clock()
        led = BlockLedger(8, 10.0, clock, 2)  # 2 bytes per token: room for 4 tokens
        led.insert(blocks(1), 2, NS_EXACT, ROOT_EXACT)
        led.insert(blocks(2), 2, "other", ROOT_EXACT)
        assert led.used_bytes == 8
        clock.now = 1.0
        assert led.match(blocks(1, 7)) == 1
        led.insert(blocks(3), 2, NS_EXACT, ROOT_EXACT)    # evicts 2 (the LRU leaf)
        assert led.namespaces() == [NS_EXACT]
        assert led.invalidate_namespace(NS_EXACT) == 2
        assert led.drain_events() == [
            BlockStored(BlockHash(1), ROOT_EXACT, 2, NS_EXACT), BlockStored(BlockHash(2), ROOT_EXACT, 2, "other"),
            BlockRemoved(BlockHash(2), "other"), BlockStored(BlockHash(3), ROOT_EXACT, 2, NS_EXACT),
            BlockRemoved(BlockHash(1), NS_EXACT), BlockRemoved(BlockHash(3), NS_EXACT)]
        assert [e.kind for e in led.log()] == [
            LedgerEventKind.CREATED, LedgerEventKind.CREATED, LedgerEventKind.HIT,
            LedgerEventKind.EVICTED, LedgerEventKind.CREATED, LedgerEventKind.INVALIDATED,
            LedgerEventKind.INVALIDATED]
        assert led.stats() == LedgerStats(blocks=0, tokens=0, bytes=0, capacity_bytes=8,
                                          lookups=1, hit_blocks=1, stored_blocks=3, evictions=1,
                                          expirations=0, invalidations=2)
        assert led.log()[2] == LedgerEvent(LedgerEventKind.HIT, BlockHash(1), NS_EXACT, 1.0, 1)
        with pytest.raises(ValueError, match=r"unknown namespace 'ns': held namespaces are none"):
            led.invalidate_namespace(NS_EXACT)

    def test_children_age_and_touch_report_exact_values(self):
        clock = Clock()
        led = BlockLedger(100, 10.0, clock, 1)
        led.insert(blocks(1, 2), 4, NS_EXACT, ROOT_EXACT)
        led.insert(blocks(1, 3), 4, NS_EXACT, ROOT_EXACT)
        assert sorted(led.children(BlockHash(1))) == blocks(2, 3)
        assert led.children(ROOT_EXACT) == blocks(1)
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


ROOT_EDGES = BlockHash(999)

NS_EDGES = "ns"

CREATED, EVICTED = LedgerEventKind.CREATED, LedgerEventKind.EVICTED

INVALIDATED = LedgerEventKind.INVALIDATED

def evicted(led: BlockLedger) -> list[BlockHash]:
    return [e.block for e in led.log() if e.kind is EVICTED]


class TestEdges:
    def test_constructor_bounds_and_their_messages(self):
        clock = Clock()
        assert BlockLedger(0, 0.5, clock, 1).insert(blocks(1), 1, NS_EDGES, ROOT_EDGES) == []  # both allowed
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
            led.insert(blocks(1, 2), [4, 0], NS_EDGES, ROOT_EDGES)

    def test_the_event_log_keeps_the_last_10000_entries_by_default(self):
        led = BlockLedger(100, 1e9, Clock(), 1)
        led.insert(blocks(1), 1, NS_EDGES, ROOT_EDGES)
        for _ in range(10_000):
            led.match(blocks(1))
        log = led.log()
        assert len(log) == 10_000 and log[0].kind is LedgerEventKind.HIT  # the CREATED one left

    def test_ttl_left_age_and_lookup_counters_are_exact(self):
        clock = Clock(2.0)
        led = BlockLedger(100, 10.0, clock, 1)
        led.insert(blocks(1, 2), 1, NS_EDGES, ROOT_EDGES)
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

    def test_bytes_are_tokens_times_bytes_per_token(self):
        clock = Clock()
        led = BlockLedger(12, 1e9, clock, 2, policy="lru")  # room for 6 tokens
        assert led.insert(blocks(1), 7, NS_EDGES, ROOT_EDGES) == []     # 14 bytes can never fit
        assert led.insert(blocks(2), 4, NS_EDGES, ROOT_EDGES) == blocks(2)
        assert led.insert(blocks(3), 1, NS_EDGES, ROOT_EDGES) == blocks(3)
        assert led.used_bytes == 10
        assert led.insert(blocks(4), 2, NS_EDGES, ROOT_EDGES) == blocks(4)  # 14 > 12: block 2 goes
        assert (BlockHash(2) in led, led.used_bytes) == (False, 6)
        assert led.restore(BlockHash(5), ROOT_EDGES, 4, NS_EDGES, last_used=0.0) is False  # 6 + 8 > 12
        assert led.restore(BlockHash(5), ROOT_EDGES, 3, NS_EDGES, last_used=0.0) is True   # 6 + 6 = 12

    def test_equal_priorities_go_oldest_first_not_by_hash(self):
        clock = Clock()
        led = BlockLedger(2, 1e9, clock, 1, policy="reuse")
        led.insert(blocks(9), 1, NS_EDGES, ROOT_EDGES)
        led.insert(blocks(1), 1, NS_EDGES, ROOT_EDGES)   # the same instant: a tie, block 9 is older
        led.insert(blocks(5), 1, NS_EDGES, ROOT_EDGES)
        assert evicted(led) == blocks(9)

    def test_restored_blocks_are_evicted_by_their_last_use_oldest_first(self):
        clock = Clock(10.0)
        led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
        assert led.restore(BlockHash(9), ROOT_EDGES, 1, NS_EDGES, last_used=5.0)
        assert led.restore(BlockHash(1), ROOT_EDGES, 1, NS_EDGES, last_used=5.0)
        led.insert(blocks(4), 1, NS_EDGES, ROOT_EDGES)
        led.insert(blocks(6), 1, NS_EDGES, ROOT_EDGES)   # 9 and 1 (last used at 5) before 4 (at 10)
        led.insert(blocks(7), 1, NS_EDGES, ROOT_EDGES)
        assert evicted(led) == blocks(9, 1)

    def test_reuse_counts_every_hit_and_evicts_in_priority_order(self):
        clock = Clock()
        led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
        led.insert(blocks(1), 1, NS_EDGES, ROOT_EDGES)
        clock.now = 1.0
        led.insert(blocks(2), 1, NS_EDGES, ROOT_EDGES)
        led.insert(blocks(3), 1, NS_EDGES, ROOT_EDGES)
        clock.now = 2.0
        led.insert(blocks(4), 1, NS_EDGES, ROOT_EDGES)  # 1 (priority 0) goes: horizon 2 s
        clock.now = 3.0
        led.match(blocks(2))
        led.match(blocks(2))                # two hits: priority 3 + 2 x 2 = 7
        clock.now = 6.0
        led.touch(blocks(3))                # priority 6
        clock.now = 8.0
        led.touch(blocks(4))                # priority 8
        assert led.insert(blocks(5, 6), 1, NS_EDGES, ROOT_EDGES) == blocks(5, 6)
        assert evicted(led) == blocks(1, 3, 2)  # 6, then 7; 8 stays

    def test_the_horizon_starts_at_zero_and_is_the_victims_exact_age(self):
        clock = Clock()
        led = BlockLedger(2, 1e9, clock, 1, policy="reuse")
        led.insert(blocks(1), 1, NS_EDGES, ROOT_EDGES)
        led.match(blocks(1))                # no victim yet: horizon 0, the hit adds nothing
        clock.now = 0.5
        led.insert(blocks(2), 1, NS_EDGES, ROOT_EDGES)
        clock.now = 0.75
        led.insert(blocks(3), 1, NS_EDGES, ROOT_EDGES)  # 1 (priority 0) goes, not 2 (0.5): horizon 0.75
        clock.now = 1.0
        led.insert(blocks(4), 1, NS_EDGES, ROOT_EDGES)  # 2 (priority 0.5) goes: horizon 0.5, under a second
        led.match(blocks(3))                # priority 1 + 0.5 = 1.5
        clock.now = 1.25
        led.insert(blocks(5), 1, NS_EDGES, ROOT_EDGES)  # 4 (priority 1) goes
        clock.now = 1.75
        led.insert(blocks(6), 1, NS_EDGES, ROOT_EDGES)  # 5 (priority 1.25) goes ...
        led.insert(blocks(7), 1, NS_EDGES, ROOT_EDGES)  # ... then 3 (1.5), before 6 (1.75)
        assert evicted(led) == blocks(1, 2, 4, 5, 3)

    def test_a_priority_never_drops_when_the_horizon_shrinks(self):
        clock = Clock()
        led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
        led.insert(blocks(1), 1, NS_EDGES, ROOT_EDGES)
        led.insert(blocks(2), 1, NS_EDGES, ROOT_EDGES)
        led.insert(blocks(3), 1, NS_EDGES, ROOT_EDGES)
        clock.now = 10.0
        led.insert(blocks(4), 1, NS_EDGES, ROOT_EDGES)  # 1 goes at age 10: horizon 10
        for _ in range(3):
            led.match(blocks(4))            # priority 10 + 10 x 3 = 40
        led.insert(blocks(5), 1, NS_EDGES, ROOT_EDGES)  # 2 goes (horizon 10), then 3 (horizon 10) ...
        led.insert(blocks(6), 1, NS_EDGES, ROOT_EDGES)
        clock.now = 11.0
        led.insert(blocks(7), 1, NS_EDGES, ROOT_EDGES)  # ... and 5 (priority 10): horizon 1
        led.touch(blocks(4))                # now + 1 x 3 = 14 < 40: it keeps 40
        clock.now = 20.0
        led.touch(blocks(6))                # 20
        led.touch(blocks(7))                # 20
        led.insert(blocks(8), 1, NS_EDGES, ROOT_EDGES)
        assert evicted(led) == blocks(1, 2, 3, 5, 6)
        assert BlockHash(4) in led

    def test_a_long_lived_heap_is_compacted_and_keeps_its_order(self):
        clock = Clock()
        led = BlockLedger(3, 1e9, clock, 1, policy="reuse")
        for h in (3, 8, 6):
            led.insert(blocks(h), 1, NS_EDGES, ROOT_EDGES)
        led.touch(blocks(8))                # two heap items for 8 at priority 0
        clock.now = 1.0
        led.touch(blocks(3))                # 3 before 6 at priority 1 ...
        led.touch(blocks(6))
        for _ in range(1100):               # ... and 1100 later items for 3: past 4 x 2 + 1024
            led.touch(blocks(3))
        led.insert(blocks(5), 1, NS_EDGES, ROOT_EDGES)  # 8 (priority 0) goes; the heap is rebuilt
        led.insert(blocks(7), 1, NS_EDGES, ROOT_EDGES)  # 3 and 6 tie at 1: 3 was used first
        led.insert(blocks(9), 1, NS_EDGES, ROOT_EDGES)
        assert evicted(led) == blocks(8, 3, 6)

    def test_invalidation_removes_exactly_the_subtrees_and_logs_them(self):
        clock = Clock(1.0)
        led = BlockLedger(100, 10.0, clock, 1, tier=Tier.DISK)
        led.insert(blocks(1, 2, 5), 1, "a", ROOT_EDGES)
        led.insert(blocks(1, 3), 1, "a", ROOT_EDGES)
        led.insert(blocks(4), 1, "a", ROOT_EDGES)
        led.insert(blocks(7), 1, "b", ROOT_EDGES)
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

    def test_a_parent_removed_before_its_child_is_an_invariant_error(self):
        clock = Clock()
        led = BlockLedger(100, 10.0, clock, 1)
        led.restore(BlockHash(1), ROOT_EDGES, 1, NS_EDGES, last_used=0.0)  # the parent first: the wrong order
        led.restore(BlockHash(2), BlockHash(1), 1, NS_EDGES, last_used=0.0)
        clock.now = 10.0
        with pytest.raises(RuntimeError, match="block 0{31}1 removed before its children"):
            led.expire()


ROOT_ROUTEREVICTION = BlockHash(999)

def ledger(policy: str, clock: Clock, blocks: int = 2) -> BlockLedger:
    return BlockLedger(capacity_bytes=blocks, ttl_s=1e9, clock=clock, bytes_per_token=1,
                       policy=policy)

def play(policy: str) -> BlockLedger:
    clock = Clock()
    led = ledger(policy, clock)
    for t, block in enumerate((1, 2, 3)):  # 1 is evicted at t=2: horizon becomes 2 s
        clock.now = float(t)
        led.insert([BlockHash(block)], 1, "ns", ROOT_ROUTEREVICTION)
    clock.now = 3.0
    assert led.match([BlockHash(2)]) == 1  # 2 is reused: priority 3 + 2 x 1
    clock.now = 4.0
    led.insert([BlockHash(4)], 1, "ns", ROOT_ROUTEREVICTION)  # evicts 3 under both policies
    clock.now = 5.0
    led.insert([BlockHash(5)], 1, "ns", ROOT_ROUTEREVICTION)
    return led


class TestRouterEviction:
    def test_reuse_keeps_the_reused_block_that_lru_evicts(self):
        lru, reuse = play("lru"), play("reuse")
        assert sorted(h for h in (1, 2, 3, 4, 5) if BlockHash(h) in lru) == [4, 5]
        assert sorted(h for h in (1, 2, 3, 4, 5) if BlockHash(h) in reuse) == [2, 5]

    def test_reuse_evicts_leaves_before_their_parents(self):
        clock = Clock()
        led = ledger("reuse", clock, blocks=3)
        chain = [BlockHash(10), BlockHash(11), BlockHash(12)]
        led.insert(chain, 1, "ns", ROOT_ROUTEREVICTION)
        clock.now = 1.0
        led.match(chain[:2])
        clock.now = 2.0
        assert led.insert([BlockHash(20)], 1, "ns", ROOT_ROUTEREVICTION) == [BlockHash(20)]
        assert [h for h in chain if h in led] == chain[:2]  # the leaf went, never a parent
        assert led.stats().evictions == 1

    def test_unknown_policy_names_the_choices(self):
        with pytest.raises(ValueError, match="lru, reuse"):
            ledger("lfu", Clock())

    @pytest.mark.parametrize("policy", ["lru", "reuse"])
    def test_random_workload_keeps_capacity_and_the_prefix_property(self, policy):
        import random

        rng = random.Random(11)
        clock = Clock()
        led = BlockLedger(capacity_bytes=40, ttl_s=50.0, clock=clock, bytes_per_token=1,
                          policy=policy)
        chains = [[BlockHash(1000 * c + i) for i in range(1, 9)] for c in range(12)]
        parent_of = {}
        for chain in chains:
            for parent, block in zip([ROOT_ROUTEREVICTION] + chain[:-1], chain):
                parent_of[block] = parent
        for step in range(3000):
            clock.now += rng.choice((0.1, 0.5, 2.0))
            chain = rng.choice(chains)[: rng.randint(1, 8)]
            if rng.random() < 0.5:
                led.match(chain)
            else:
                led.insert(chain, 2, "ns", ROOT_ROUTEREVICTION)
            held = [b for b in parent_of if b in led]
            assert led.used_bytes <= 40
            assert all(parent_of[b] == ROOT_ROUTEREVICTION or parent_of[b] in led for b in held), step
        stats = led.stats()
        assert stats.evictions > 0 and stats.hit_blocks > 0
        clock.now += 100.0  # past the TTL: everything expires, whatever the policy
        led.expire()
        assert len(led) == 0


class TestWriterTtl:
    """A block's TTL is the longest any writer of a chain through it asked for."""

    def test_a_writer_ttl_is_each_new_block_ttl(self, eviction):
        clock = Clock()
        ledger = make_ledger(eviction, ttl=60.0, clock=clock)
        ledger.insert(A, BS, NS.label(), ROOT, ttl_s=3600.0)
        assert [ledger.ttl_of(h) for h in A] == [3600.0, 3600.0, 3600.0]
        clock.now = 3599.0
        assert ledger.peek(A) == 3
        assert ledger.ttl_left(A[2]) == 1.0
        clock.now = 3600.0
        assert ledger.expire() == [A[2], A[1], A[0]]  # leaves first

    def test_a_longer_writer_raises_the_shared_prefix_and_a_shorter_lowers_nothing(
            self, eviction):
        clock = Clock()
        ledger = make_ledger(eviction, ttl=60.0, clock=clock)
        ledger.insert(A, BS, NS.label(), ROOT, ttl_s=300.0)
        ledger.insert(B, BS, NS.label(), ROOT, ttl_s=3600.0)  # shares a0 a1
        assert [ledger.ttl_of(h) for h in A] == [3600.0, 3600.0, 300.0]
        assert ledger.ttl_of(B[2]) == 3600.0
        ledger.insert(B, BS, NS.label(), ROOT, ttl_s=300.0)
        assert [ledger.ttl_of(h) for h in B] == [3600.0, 3600.0, 3600.0]
        ledger.insert(A, BS, NS.label(), ROOT)  # the default (60 s) lowers nothing either
        assert [ledger.ttl_of(h) for h in A] == [3600.0, 3600.0, 300.0]

    def test_blocks_expire_in_order_of_their_own_deadlines(self, eviction):
        clock = Clock()
        ledger = make_ledger(eviction, ttl=60.0, clock=clock)
        short = chain(*range(200, 204))
        ledger.insert(A, BS, NS.label(), ROOT, ttl_s=3600.0)
        ledger.insert(short, BS, NS.label(), ROOT)  # the default 60 s
        clock.now = 60.0
        assert ledger.expire() == [short[0]]
        assert ledger.peek(A) == 3
        clock.now = 3600.0
        assert ledger.expire() == [A[2], A[1], A[0]]
        assert len(ledger) == 0

    def test_a_ttl_that_is_not_positive_is_refused(self, eviction):
        ledger = make_ledger(eviction)
        with pytest.raises(ValueError, match="ttl_s must be positive seconds, got 0"):
            ledger.insert(A, BS, NS.label(), ROOT, ttl_s=0)
