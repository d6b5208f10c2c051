"""ReuseOrder (``router.kv.reuse_order``): priorities and victims, exactly.

A ledger stand-in holds the entries (hits and current priority); each test pins the exact
priority a touch hands out or the exact order in which ``evict`` removes blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.kv.key import BlockHash
from router.kv.reuse_order import MAX_REUSE_BONUS, ReuseOrder


@dataclass
class Held:
    hits: int = 0
    priority: float = 0.0


class Ledger:
    """Entries by hash, a capacity in blocks and a set of blocks ``evict`` must pass over."""

    def __init__(self, order: ReuseOrder, capacity: int) -> None:
        self.order = order
        self.entries: dict[BlockHash, Held] = {}
        self.capacity = capacity
        self.protected: set[BlockHash] = set()
        self.removed: list[BlockHash] = []

    def touch(self, h: int, now: float, hits: int = 0, deeper: float = 0.0) -> float:
        entry = self.entries.setdefault(BlockHash(h), Held())
        entry.hits = hits
        return self.order.touched(BlockHash(h), entry, now, deeper)

    def evict(self, now: float = 100.0) -> bool:
        return self.order.evict(
            fits=lambda: len(self.entries) <= self.capacity,
            live=lambda h, p: h in self.entries and self.entries[h].priority == p,
            evictable=lambda h: h not in self.protected,
            remove=self._remove, now=lambda: now, entries=len(self.entries))

    def _remove(self, h: BlockHash) -> None:
        del self.entries[h]
        self.removed.append(h)


class TestPriority:
    def test_with_no_horizon_a_touch_takes_the_latest_of_now_and_the_child(self):
        order = ReuseOrder()
        led = Ledger(order, 10)
        assert led.touch(1, now=5.0) == 5.0
        assert led.touch(1, now=3.0) == 5.0            # never lowered
        assert led.touch(1, now=6.0, deeper=9.0) == 9.0  # never below its child

    def test_the_bonus_is_the_horizon_per_hit_up_to_three(self):
        order = ReuseOrder()
        order.horizon = 10.0
        led = Ledger(order, 10)
        assert MAX_REUSE_BONUS == 3
        assert led.touch(1, now=5.0, hits=1) == 15.0
        assert led.touch(2, now=5.0, hits=3) == 35.0
        assert led.touch(3, now=5.0, hits=7) == 35.0  # hits beyond three earn nothing more


class TestEviction:
    def test_victims_go_lowest_priority_first_and_the_horizon_is_the_last_ones_age(self):
        order = ReuseOrder()
        led = Ledger(order, 1)
        led.touch(1, now=30.0)
        led.touch(2, now=10.0)
        led.touch(3, now=20.0)
        assert led.evict(now=100.0) is True
        assert led.removed == [BlockHash(2), BlockHash(3)]
        assert order.horizon == 80.0  # 100 - 20

    def test_a_stale_item_is_skipped_and_the_block_leaves_at_its_current_priority(self):
        order = ReuseOrder()
        led = Ledger(order, 1)
        led.touch(1, now=1.0)
        led.touch(2, now=2.0)
        led.touch(1, now=3.0)  # 1's item at 1.0 is dead now
        assert led.evict(now=10.0)
        assert led.removed == [BlockHash(2)]
        assert order.horizon == 8.0

    def test_equal_priorities_go_in_the_order_they_were_touched(self):
        order = ReuseOrder()
        led = Ledger(order, 0)
        for h in (7, 3, 5):
            led.touch(h, now=4.0)
        assert led.evict()
        assert led.removed == [BlockHash(7), BlockHash(3), BlockHash(5)]

    def test_protected_blocks_are_passed_over_and_kept_for_later(self):
        order = ReuseOrder()
        led = Ledger(order, 1)
        led.touch(1, now=1.0)
        led.touch(2, now=2.0)
        led.protected = {BlockHash(1)}
        assert led.evict()
        assert led.removed == [BlockHash(2)]
        led.protected = set()
        led.capacity = 0
        assert led.evict()
        assert led.removed == [BlockHash(2), BlockHash(1)]  # 1's item was pushed back

    def test_only_protected_blocks_left_is_capacity_exhausted(self):
        order = ReuseOrder()
        led = Ledger(order, 0)
        led.touch(1, now=1.0)
        led.protected = {BlockHash(1)}
        assert led.evict() is False
        assert led.removed == [] and order.horizon == 0.0

    def test_the_horizon_never_goes_below_zero(self):
        order = ReuseOrder()
        order.horizon = 10.0
        led = Ledger(order, 0)
        led.touch(1, now=5.0, hits=1)  # priority 15, later than the clock
        assert led.evict(now=6.0)
        assert order.horizon == 0.0

    def test_a_restored_block_enters_at_its_last_use_with_no_bonus(self):
        order = ReuseOrder()
        order.horizon = 50.0
        led = Ledger(order, 1)
        led.entries[BlockHash(1)] = Held(hits=3, priority=4.0)
        order.restored(BlockHash(1), led.entries[BlockHash(1)], last_used=4.0)
        led.touch(2, now=5.0)  # 5 + 50 x 0
        assert led.evict(now=10.0)
        assert led.removed == [BlockHash(1)] and order.horizon == 6.0

    def test_many_dead_items_are_compacted_without_changing_the_order(self):
        order = ReuseOrder()
        led = Ledger(order, 2)
        led.touch(3, now=1.0)
        led.touch(6, now=1.0)
        for _ in range(1100):  # dead items for 3 at the same priority: past 4 x 2 + 1024
            led.touch(3, now=1.0)
        led.touch(8, now=0.5)
        assert led.evict(now=2.0)   # 8 goes; the heap is rebuilt on the way out
        led.capacity = 0
        assert led.evict(now=2.0)
        assert led.removed == [BlockHash(8), BlockHash(3), BlockHash(6)]  # 3 was pushed first
