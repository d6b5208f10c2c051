"""What crosses the engine thread's boundary (``workers.engine.channel``): a worker's holdings
split by tier, in the order its store listed them, with the batch sequence they include."""
from __future__ import annotations

from router.kv.events import Tier
from router.kv.key import BlockHash
from router.kv.ledger_records import Holding
from workers.engine.channel import Holdings


def _held(block: int, tier: Tier) -> Holding:
    return Holding(BlockHash(block), BlockHash(block - 1), 16, "t", tier)


class TestHoldings:
    def test_are_split_by_tier_in_the_stores_order(self):
        held = [_held(5, Tier.MEMORY), _held(9, Tier.DISK), _held(3, Tier.MEMORY),
                _held(5, Tier.DISK)]
        assert Holdings.of(12, iter(held)) == Holdings(12, (5, 3), (9, 5))

    def test_nothing_held_is_two_empty_tiers(self):
        assert Holdings.of(0, []) == Holdings(0, (), ())
