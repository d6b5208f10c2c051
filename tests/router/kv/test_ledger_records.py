"""The ledger's records (``router.kv.ledger_records``): policy names, event kinds, defaults.

These names travel: config files, the event log and the router's rebuild read them, so each
test pins the exact spelling or default a reader depends on.
"""
from __future__ import annotations

import dataclasses

import pytest

from router.kv.events import Tier
from router.kv.key import BlockHash
from router.kv.ledger_records import (DEFAULT_EVICTION, EVICTION_POLICIES, Eviction, Holding,
                                      LedgerEvent, LedgerEventKind, LedgerStats, RemovalReason)


class TestEvictionPolicies:
    def test_the_policies_are_named_as_config_spells_them(self):
        assert EVICTION_POLICIES == ("lru", "reuse")
        assert Eviction("reuse") is Eviction.REUSE and Eviction("lru") is Eviction.LRU
        assert Eviction.LRU == "lru"  # a plain string where config compares one

    def test_the_default_is_reuse(self):
        assert DEFAULT_EVICTION is Eviction.REUSE

    def test_an_unknown_policy_name_is_not_a_policy(self):
        with pytest.raises(ValueError):
            Eviction("fifo")


class TestEvents:
    def test_event_kinds_keep_their_log_names(self):
        assert [k.value for k in LedgerEventKind] == [
            "created", "hit", "expired", "evicted", "invalidated"]
        assert RemovalReason is LedgerEventKind

    def test_an_event_counts_one_block_unless_told_and_cannot_change(self):
        event = LedgerEvent(LedgerEventKind.HIT, BlockHash(3), "a", 2.5)
        assert event.blocks == 1
        assert LedgerEvent(LedgerEventKind.HIT, BlockHash(3), "a", 2.5, 4).blocks == 4
        with pytest.raises(dataclasses.FrozenInstanceError):
            event.at = 3.0  # type: ignore[misc]


class TestHoldingsAndStats:
    def test_a_holding_is_in_memory_unless_told(self):
        held = Holding(BlockHash(2), BlockHash(1), 4, "a")
        assert held.tier is Tier.MEMORY
        assert Holding(BlockHash(2), BlockHash(1), 4, "a", Tier.DISK).tier is Tier.DISK

    def test_stats_count_no_collisions_unless_told(self):
        stats = LedgerStats(blocks=1, tokens=4, bytes=16, capacity_bytes=64, lookups=2,
                            hit_blocks=1, stored_blocks=1, evictions=0, expirations=0,
                            invalidations=0)
        assert stats.collisions == 0
        assert dataclasses.replace(stats, collisions=2).collisions == 2
