"""``router.kv.tiers.TieredLedger``: the store's two tiers as bookkeeping, exact blocks per tier."""
import pytest

from router.kv.events import BlockRemoved, BlockStored, Tier
from router.kv.key import Namespace, hash_blocks
from router.kv.tiers import TieredLedger

BS = 4
NS = Namespace("t", "m")
A, B = list(range(1, 13)), list(range(101, 113))  # three blocks each


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def tiers(memory_blocks: int = 3, disk_blocks: int = 4, clock=None) -> TieredLedger:
    return TieredLedger(memory_blocks * BS, disk_blocks * BS, 60.0, clock or Clock(), "lru")


def put(t: TieredLedger, tokens: list[int]) -> list:
    return t.insert(hash_blocks(tokens, BS, NS), BS, NS.label(), NS.root())


def test_evicted_blocks_go_to_disk_and_a_match_continues_there():
    t = tiers()
    a, b = hash_blocks(A, BS, NS), hash_blocks(B, BS, NS)
    put(t, A)
    t.drain_events()
    put(t, B)  # memory holds 3 blocks: A's go to disk, leaves first
    assert t.drain_events() == [
        BlockRemoved(a[2], NS.label()), BlockStored(b[0], NS.root(), BS, NS.label()),
        BlockRemoved(a[1], NS.label()), BlockStored(b[1], b[0], BS, NS.label()),
        BlockRemoved(a[0], NS.label()), BlockStored(b[2], b[1], BS, NS.label()),
        BlockStored(a[2], a[1], BS, NS.label(), Tier.DISK),
        BlockStored(a[1], a[0], BS, NS.label(), Tier.DISK),
        BlockStored(a[0], NS.root(), BS, NS.label(), Tier.DISK)]
    assert (t.peek(a), t.peek(b)) == ((0, 3), (3, 0))
    assert t.match(a) == (0, 3)
    assert put(t, A) == a  # promoted: stored in memory again, read, not written
    assert (t.promoted, t.written_blocks()) == (3, 6)
    # B's spills pushed A's LRU leaves a2, a1 off the 4-block disk (counted as promoted all
    # the same: they were read before the insert)
    assert (t.peek(a), t.peek(b)) == ((3, 0), (0, 3))
    assert {h.block for h in t.disk.holdings()} == {a[0], *b}
    assert t.capacity_tokens() == (3 * BS, 4 * BS)


def test_ttl_and_invalidation_cover_both_tiers():
    clock = Clock()
    t = tiers(clock=clock)
    a = hash_blocks(A, BS, NS)
    put(t, A)
    put(t, B)
    clock.now = 30.0
    assert t.ttl_left(a[0]) == 30.0 and t.age(a[0]) == 30.0
    assert t.invalidate_namespace(NS.label()) == 6
    assert t.namespaces() == [] and t.invalidate_namespace("nobody") == 0
    put(t, A)
    clock.now = 91.0
    assert t.peek(a) == (0, 0) and t.ttl_left(a[0]) == 0.0


def test_without_a_disk_tier_evicted_blocks_are_gone():
    t = tiers(disk_blocks=0)
    a = hash_blocks(A, BS, NS)
    put(t, A)
    put(t, B)
    assert t.disk is None and t.peek(a) == (0, 0) and t.capacity_tokens() == (3 * BS, 0)
    with pytest.raises(ValueError, match="disk_tokens must be >= 0"):
        TieredLedger(BS, -1, 60.0, Clock())
