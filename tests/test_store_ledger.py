"""BlockLedger: exact eviction order, TTL from last use, invalidation, events, capacity."""
from __future__ import annotations

import pytest

from router.kv.events import BlockRemoved, BlockStored
from router.kv.key import BlockHash, Namespace, hash_blocks
from router.kv.ledger import BlockLedger, Eviction, LedgerEventKind
from tests.conftest import Clock

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


def test_match_counts_leading_blocks_and_dedups_shared_prefix(eviction):
    ledger = make_ledger(eviction)
    assert store(ledger, A) == A
    assert store(ledger, B) == [B[2]]  # a0 a1 stored once
    assert ledger.stats().blocks == 4
    assert ledger.match(A) == 3
    assert ledger.match(chain(*range(0, 8), 7, 7, 7, 7)) == 2
    assert ledger.match(chain(5, 5, 5, 5)) == 0
    assert ledger.peek(B) == 3


def test_evicts_least_recently_used_leaves_before_parents(eviction):
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


def test_capacity_exhaustion_returns_what_fits(eviction):
    ledger = make_ledger(eviction, blocks=2)
    long = chain(*range(100, 120))  # 5 blocks, room for 2
    assert store(ledger, long) == long[:2]
    assert ledger.stats().blocks == 2
    # an oversized single block never evicts anything
    big = BlockLedger(3, 60.0, Clock(), 1)
    assert big.insert(A, BS, NS.label(), ROOT) == []


def test_ttl_is_measured_from_last_use(eviction):
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


def test_invalidate_namespace_and_prefix(eviction):
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


def test_events_and_log(eviction):
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


def test_holdings_list_parents_before_children(eviction):
    ledger = make_ledger(eviction)
    store(ledger, A)
    store(ledger, B)
    seen = set()
    for h in ledger.holdings():
        assert h.parent == ROOT or h.parent in seen
        seen.add(h.block)
    assert seen == set(A) | set(B)


def test_bad_config_is_a_value_error(eviction):
    with pytest.raises(ValueError, match="policy"):
        BlockLedger(10, 1.0, Clock(), 1, policy="fifo")
    with pytest.raises(ValueError, match="ttl_s"):
        BlockLedger(10, 0.0, Clock(), 1)
    with pytest.raises(ValueError, match="token_counts"):
        make_ledger(eviction).insert(A, [4, 4], NS.label(), ROOT)
