"""The messages between the cluster and a worker's engine (``workers.messages``): what a
request's cache controls let it store and keep, its priority, what a lookup report says it
reused, and the disk tiers of several workers summed."""
from __future__ import annotations

import pytest

from router.kv.key import Namespace
from workers.messages import (CacheControls, DiskTierStats, GenerateRequest, LookupOutcome,
                              LookupReport, Priority, SamplingParams)


def _disk(blocks: int, free: int | None, full: bool = False) -> DiskTierStats:
    return DiskTierStats(blocks, blocks * 100, 10_000, free, 1, 2, 3, full, blocks)


class TestCacheControls:
    @pytest.mark.parametrize("controls, tokens, writable", [
        (CacheControls(), 100, 100), (CacheControls(write_limit=64), 100, 64),
        (CacheControls(write_limit=64), 40, 40), (CacheControls(write=False), 100, 0),
        (CacheControls(write=False, write_limit=64), 100, 0)])
    def test_store_at_most_the_tokens_before_the_write_limit(self, controls, tokens, writable):
        assert controls.writable(tokens) == writable

    def test_a_cache_is_kept_for_the_next_turn_only_when_nothing_stops_writing(self):
        assert CacheControls().keeps is True
        assert CacheControls(write_limit=0).keeps is False
        assert CacheControls(write=False).keeps is False

    @pytest.mark.parametrize("kwargs, message", [
        ({"write_limit": -1}, "write_limit must be >= 0 tokens, got -1"),
        ({"ttl_s": 0.0}, "ttl_s must be positive seconds, got 0.0")])
    def test_bad_controls_are_refused_saying_which(self, kwargs, message):
        with pytest.raises(ValueError) as refused:
            CacheControls(**kwargs)
        assert str(refused.value) == message

    def test_a_write_limit_of_zero_is_allowed(self):
        assert CacheControls(write_limit=0).writable(50) == 0


class TestGenerateRequest:
    def test_a_batch_request_is_batch_priority_else_interactive(self):
        request = GenerateRequest("r", Namespace("t", "m"), (1, 2), SamplingParams(4))
        assert request.priority is Priority.INTERACTIVE
        batch = GenerateRequest("r", Namespace("t", "m"), (1, 2), SamplingParams(4), batch=True)
        assert batch.priority is Priority.BATCH


class TestLookupReport:
    def test_reused_tokens_are_the_stores_match_and_the_kept_tail(self):
        report = LookupReport(LookupOutcome.PARTIAL, 5923, 5904, 5919, 7, 9, 1.5, 300.0,
                              kept_tokens=15)
        assert report.reused_tokens == 5919
        assert report.line() == "common=5919 of 5923"


class TestDiskTierStats:
    def test_no_tiers_sum_to_none(self):
        assert DiskTierStats.total([]) is None

    def test_several_tiers_sum_field_by_field_and_any_full_is_full(self):
        assert DiskTierStats.total([_disk(2, 500), _disk(3, 700, full=True)]) == \
            DiskTierStats(5, 500, 20_000, 1200, 2, 4, 6, True, 5)
        assert DiskTierStats.total([_disk(2, 500), _disk(3, 700)]).full is False

    def test_the_free_space_is_unknown_when_any_tier_cannot_read_it(self):
        assert DiskTierStats.total([_disk(1, 500), _disk(1, None)]).free_bytes is None
        assert DiskTierStats.total([_disk(1, 0), _disk(1, 0)]).free_bytes == 0
