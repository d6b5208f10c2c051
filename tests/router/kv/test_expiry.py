"""The expiry order of blocks with their own TTLs (``router.kv.expiry.ExpiryOrder``): one LRU
order per TTL class, the earliest deadline of the classes' heads first, a block idle for
exactly its TTL due, a raised chain moved deepest first."""
from __future__ import annotations

from dataclasses import dataclass

from router.kv.expiry import ExpiryOrder
from router.kv.key import BlockHash

A, B, C, D = (BlockHash(n) for n in (1, 2, 3, 4))


@dataclass
class Entry:
    ttl_s: float


class TestDue:
    def test_nothing_is_due_before_its_ttl_and_the_head_is_at_exactly_its_ttl(self):
        order = ExpiryOrder()
        order.used(A, 300.0)
        order.used(B, 300.0)
        last = {A: 10.0, B: 20.0}
        assert order.due(309.0, last.__getitem__) is None
        assert order.due(310.0, last.__getitem__) == A     # idle 300 s: due
        order.remove(A, 300.0)
        assert order.due(310.0, last.__getitem__) is None  # B is due at 320
        assert order.due(320.0, last.__getitem__) == B

    def test_the_earliest_deadline_of_the_classes_heads_comes_first(self):
        order = ExpiryOrder()
        order.used(A, 3600.0)   # deadline 3600
        order.used(B, 300.0)    # deadline 500
        order.used(C, 300.0)    # deadline 550, behind B in its class
        last = {A: 0.0, B: 200.0, C: 250.0}
        assert order.due(4000.0, last.__getitem__) == B
        order.remove(B, 300.0)
        assert order.due(4000.0, last.__getitem__) == C
        order.remove(C, 300.0)
        assert order.due(4000.0, last.__getitem__) == A
        order.remove(A, 3600.0)
        assert order.due(1e9, last.__getitem__) is None     # every class gone

    def test_a_use_moves_a_block_behind_the_others_of_its_class(self):
        order = ExpiryOrder()
        order.used(A, 300.0)
        order.used(B, 300.0)
        order.used(A, 300.0)    # A used again: B is the head now
        last = {A: 0.0, B: 0.0}
        assert order.due(300.0, last.__getitem__) == B


class TestRaise:
    def test_a_raised_chain_joins_the_longer_class_deepest_first(self):
        order = ExpiryOrder()
        entries = {A: Entry(300.0), B: Entry(300.0), C: Entry(3600.0)}
        for h in (A, B, C):
            order.used(h, entries[h].ttl_s)
        assert order.raise_chain([A, B, C], entries, 3600.0) is True
        assert [entries[h].ttl_s for h in (A, B, C)] == [3600.0, 3600.0, 3600.0]
        # in the 3600 s class now: C (already there), then B, then A (deepest first)
        last = {A: 0.0, B: 0.0, C: 0.0}
        due = []
        while (h := order.due(3600.0, last.__getitem__)) is not None:
            due.append(h)
            order.remove(h, 3600.0)
        assert due == [C, B, A]

    def test_a_chain_already_as_long_is_left_as_it_is(self):
        order = ExpiryOrder()
        entries = {A: Entry(3600.0), D: Entry(3600.0)}
        order.used(A, 3600.0)
        order.used(D, 3600.0)
        assert order.raise_chain([A, D], entries, 300.0) is False
        assert order.raise_chain([A, D], entries, 3600.0) is False
        assert [entries[h].ttl_s for h in (A, D)] == [3600.0, 3600.0]
        assert order.due(3600.0, {A: 0.0, D: 0.0}.__getitem__) == A

    def test_moved_takes_a_block_out_of_its_old_class(self):
        order = ExpiryOrder()
        order.used(A, 300.0)
        order.moved(A, 300.0, 3600.0)
        last = {A: 0.0}
        assert order.due(300.0, last.__getitem__) is None   # no longer in the 300 s class
        assert order.due(3600.0, last.__getitem__) == A
