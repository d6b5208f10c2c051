"""The job forecast's cache model at its edges: eviction policy, held blocks, tails, pending."""
from __future__ import annotations
import pytest

from router.cost import TokenUsage
from router.forecast import CacheModel, ClusterHoldings, PlannedRequest, forecast_job
from router.kv.key import BlockHash, Namespace, hash_blocks
from tests.conftest import Clock
from tests.support.requests import planned_request


def test_the_forecast_evicts_by_the_stores_policy():
    # Room for two 1-token blocks; block 2 is reused at t=3, then two new blocks arrive.
    plan = [planned_request([b], 2, float(t)) for t, b in enumerate((1, 2, 3, 2, 4, 5, 2))]
    lru = CacheModel(block_size=1, capacity_tokens=2, ttl_s=1e6, eviction="lru")
    reuse = CacheModel(block_size=1, capacity_tokens=2, ttl_s=1e6, eviction="reuse")
    assert forecast_job(plan, {}, lru)[-1] == TokenUsage(2, 0, 1)    # 2 was evicted at t=5
    assert forecast_job(plan, {}, reuse)[-1] == TokenUsage(2, 1, 0)  # the reused 2 stayed


def test_held_blocks_enter_oldest_first():
    # Room for one block: the one with more TTL left entered last and is the one held.
    model = CacheModel(block_size=4, capacity_tokens=4, ttl_s=100.0)
    held = {BlockHash(2): 5.0, BlockHash(1): 10.0}
    assert forecast_job([planned_request([1], 5, 0.0)], held, model) == [TokenUsage(5, 4, 0)]
    assert forecast_job([planned_request([2], 5, 0.0)], held, model) == [TokenUsage(5, 0, 4)]


def test_a_block_held_past_a_miss_is_not_written_again():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
    held = {BlockHash(2): 50.0}  # the cluster holds block 2 but not its parent 1
    assert forecast_job([planned_request([1, 2], 9, 0.0)], held, model) == [TokenUsage(9, 0, 4)]


def test_the_tail_is_written_only_when_the_output_completes_its_block():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
    assert forecast_job([planned_request([1], 7, 0.0, output=1)], {}, model) == [TokenUsage(7, 0, 4)]
    assert forecast_job([planned_request([1], 7, 0.0, output=2)], {}, model) == [TokenUsage(7, 0, 7)]
    # Two at once: the second finds both blocks pending and writes only its own tail.
    plan = [planned_request([1, 2], 9, 0.0, 1.0, output=4), planned_request([1, 2], 9, 0.0, 1.0, output=4)]
    assert forecast_job(plan, {}, model) == [TokenUsage(9, 0, 9), TokenUsage(9, 0, 1)]


def test_a_block_with_half_a_second_left_is_still_read():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
    assert forecast_job([planned_request([1], 5, 0.0)], {BlockHash(1): 0.5}, model) == [
        TokenUsage(5, 4, 0)]
    assert forecast_job([planned_request([1], 5, 0.5)], {BlockHash(1): 0.5}, model) == [
        TokenUsage(5, 0, 4)]


def test_a_one_token_prompt_is_forecast():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
    assert forecast_job([planned_request([], 1, 0.0)], {}, model) == [TokenUsage(1, 0, 0)]


class TestCacheControls:
    """Each request's breakpoint, TTL and bypass in the job forecast, exactly."""

    MODEL = CacheModel(block_size=4, capacity_tokens=1000, ttl_s=300.0)

    def plan(self, first: dict, second: dict | None = None, at: float = 10.0):
        blocks = [1, 2, 3, 4]
        return [PlannedRequest(tuple(map(BlockHash, blocks)), 18, 0.0, 1.0, 4, **first),
                PlannedRequest(tuple(map(BlockHash, blocks)), 18, at, 1.0, 4,
                               **(second or {}))]

    def test_a_breakpoint_writes_the_blocks_before_it_and_so_limits_later_reads(self):
        assert forecast_job(self.plan({"write_limit": 9}), {}, self.MODEL) == [
            TokenUsage(18, 0, 8), TokenUsage(18, 8, 10)]  # 2 blocks written; then the rest
        assert forecast_job(self.plan({}), {}, self.MODEL) == [
            TokenUsage(18, 0, 18), TokenUsage(18, 16, 2)]  # without: all; each its own tail

    def test_write_nothing_leaves_nothing_to_read(self):
        assert forecast_job(self.plan({"write_limit": 0}), {}, self.MODEL) == [
            TokenUsage(18, 0, 0), TokenUsage(18, 0, 18)]

    def test_read_false_reads_nothing_and_writes_only_what_is_not_held(self):
        assert forecast_job(self.plan({}, {"read": False}), {}, self.MODEL) == [
            TokenUsage(18, 0, 18), TokenUsage(18, 0, 2)]  # its tail's block only is new

    def test_an_hour_ttl_keeps_blocks_past_the_model_ttl(self):
        late = 1000.0  # past the model's 300 s, within an hour
        assert forecast_job(self.plan({"ttl_s": 3600.0}, at=late), {}, self.MODEL)[1] == \
            TokenUsage(18, 16, 2)
        assert forecast_job(self.plan({}, at=late), {}, self.MODEL)[1] == \
            TokenUsage(18, 0, 18)


class TestRealisation:
    """The share of the one-cache model's reuse the cluster's routing realises: that share of
    a request's modelled cached tokens is read, the rest computed and written again."""

    MODEL = TestCacheControls.MODEL
    BLOCKS = tuple(map(BlockHash, [1, 2, 3, 4]))

    def plan(self, first: dict, second: dict) -> list[PlannedRequest]:
        return [PlannedRequest(self.BLOCKS, 18, 0.0, 1.0, 4, **first),
                PlannedRequest(self.BLOCKS, 18, 10.0, 1.0, 4, **second)]

    def test_half_realised_reads_half_and_writes_the_rest_with_the_tail(self):
        # The second matches all 16 tokens: it reads 8 and writes 8 again, and its tail's 2.
        assert forecast_job(self.plan({}, {}), {}, self.MODEL, 0.5) == [
            TokenUsage(18, 0, 18), TokenUsage(18, 8, 10)]

    def test_behind_a_breakpoint_what_is_written_again_stops_at_it(self):
        # Writable up to block 3 (13 tokens): of the 8 computed again, 4 are before it.
        assert forecast_job(self.plan({}, {"write_limit": 13}), {}, self.MODEL, 0.5) == [
            TokenUsage(18, 0, 18), TokenUsage(18, 8, 4)]

    def test_a_block_held_past_a_miss_is_not_counted_as_written_again(self):
        # The cluster holds block 4; the first writes blocks 1 and 2; the second matches
        # those two (8 tokens), reads half of them and writes 4 again, and block 3.
        held = {BlockHash(4): 100.0}
        plan = self.plan({"write_limit": 9}, {"write_limit": 17})
        assert forecast_job(plan, held, self.MODEL, 0.5) == [
            TokenUsage(18, 0, 8), TokenUsage(18, 4, 8)]
        assert forecast_job(plan, held, self.MODEL, 1.0) == [
            TokenUsage(18, 0, 8), TokenUsage(18, 8, 4)]

    @pytest.mark.parametrize("realisation", [-0.1, 1.1])
    def test_a_share_outside_0_to_1_is_refused(self, realisation):
        with pytest.raises(ValueError) as refused:
            forecast_job(self.plan({}, {}), {}, self.MODEL, realisation)
        assert str(refused.value) == f"realisation must be in [0, 1], got {realisation}"


class TestClusterHoldings:
    """What the frontend knows each serving worker's store holds (``ClusterHoldings``): one
    mirror a worker, each block's TTL left from its last use, the serving set, invalidation."""

    BS = 4
    ACME = Namespace("acme", "m")
    BETA = Namespace("beta", "m")

    def _holdings(self, clock, **kw):
        args = {"block_size": self.BS, "worker_capacity_tokens": 100, "ttl_s": 60.0,
                "clock": clock, **kw}
        return ClusterHoldings(**args)

    def _chain(self, ns=ACME, blocks=3):
        return hash_blocks(list(range(blocks * self.BS)), self.BS, ns)

    @pytest.mark.parametrize("field, value", [("block_size", 0), ("worker_capacity_tokens", -1),
                                              ("ttl_s", 0.0), ("workers", -1),
                                              ("worker_disk_tokens", -1)])
    def test_a_bad_size_is_refused_naming_every_bound(self, field, value):
        with pytest.raises(ValueError) as refused:
            self._holdings(Clock(), **{field: value})
        assert str(refused.value) == (
            "cluster holdings need block_size > 0, worker_capacity_tokens >= 0, "
            "worker_disk_tokens >= 0, ttl_s > 0 and workers >= 0")

    def test_the_smallest_sizes_are_taken(self):
        holdings = self._holdings(Clock(), block_size=1, worker_capacity_tokens=0, ttl_s=0.5,
                                  workers=0)
        assert holdings.capacity_by_tier() == (0, 0)

    def test_before_any_poll_the_capacity_is_one_workers(self):
        assert self._holdings(Clock(), worker_disk_tokens=50).capacity_by_tier() == (100, 50)

    def test_a_block_with_half_a_second_left_is_held(self):
        clock = Clock()
        holdings = self._holdings(clock)
        chain = self._chain()
        holdings.stored("w0", self.ACME, chain, 1)
        clock.now = 59.5
        assert holdings.held(chain) == {chain[0]: 0.5}

    def test_held_is_the_stored_leading_blocks_with_their_ttl_left(self):
        clock = Clock()
        holdings = self._holdings(clock)
        chain = self._chain()
        holdings.stored("w0", self.ACME, chain, 2)
        clock.now = 10.0
        assert holdings.held(chain) == {chain[0]: 50.0, chain[1]: 50.0}
        assert holdings.held([chain[2], chain[0]]) == {}  # held from the first block on
        clock.now = 60.0
        assert holdings.held(chain) == {}

    def test_storing_no_blocks_stores_nothing_and_names_no_worker(self):
        holdings = self._holdings(Clock(), workers=2)
        holdings.serving(["w0"])
        holdings.stored("w1", self.ACME, self._chain(), 0)
        assert holdings.held(self._chain()) == {}
        assert holdings.held_by_tier("w1", self._chain()) == (0, 0)
        assert holdings.capacity_by_tier() == (100, 0)

    def test_the_longest_ttl_left_of_any_worker_is_the_clusters(self):
        clock = Clock()
        holdings = self._holdings(clock)
        chain = self._chain()
        holdings.stored("w0", self.ACME, chain, 3)
        clock.now = 20.0
        holdings.stored("w1", self.ACME, chain, 1)
        clock.now = 30.0
        assert holdings.held(chain) == {chain[0]: 50.0, chain[1]: 30.0, chain[2]: 30.0}

    def test_as_of_leaves_out_blocks_stored_after_it(self):
        clock = Clock()
        holdings = self._holdings(clock)
        chain = self._chain()
        holdings.stored("w0", self.ACME, chain, 1)
        clock.now = 5.0
        holdings.stored("w0", self.ACME, chain, 3)  # touches block 0 again, adds 1 and 2
        clock.now = 10.0
        # stored 10 s ago, used 5 s ago: block 0 was there 3 s ago, blocks 1 and 2 were not
        assert holdings.held(chain, as_of=3.0) == {chain[0]: 55.0}
        assert holdings.held(chain, as_of=5.0) == {chain[0]: 55.0, chain[1]: 55.0,
                                                   chain[2]: 55.0}

    def test_capacity_counts_the_serving_workers_both_tiers(self):
        holdings = self._holdings(Clock(), workers=3, worker_disk_tokens=50)
        assert holdings.capacity_by_tier() == (300, 150)
        assert holdings.capacity_tokens() == 450
        holdings.serving(["a", "b"])
        assert holdings.capacity_by_tier() == (200, 100)
        holdings.serving([])
        assert holdings.capacity_by_tier() == (100, 50)  # never below one worker's

    def test_a_worker_no_longer_serving_loses_its_blocks_and_a_late_result_joins(self):
        clock = Clock()
        holdings = self._holdings(clock)
        chain = self._chain()
        holdings.stored("w0", self.ACME, chain, 3)
        holdings.serving(["w1"])
        assert holdings.held(chain) == {}
        assert holdings.held_by_tier("w0", chain) == (0, 0)
        holdings.stored("w2", self.ACME, chain, 2)  # a worker the last poll missed
        assert holdings.capacity_by_tier() == (200, 0)
        assert holdings.held_by_tier("w2", chain) == (2, 0)

    def test_invalidating_a_tenant_drops_its_blocks_everywhere_and_only_its(self):
        holdings = self._holdings(Clock())
        acme, beta = self._chain(self.ACME), self._chain(self.BETA)
        holdings.stored("w0", self.ACME, acme, 3)
        holdings.stored("w1", self.ACME, acme, 2)
        holdings.stored("w1", self.BETA, beta, 3)
        holdings.invalidated("acme")
        assert holdings.held(acme) == {}
        assert holdings.held_by_tier("w1", beta) == (3, 0)

    def test_a_block_read_back_from_disk_is_promoted_to_memory(self):
        holdings = self._holdings(Clock(), worker_capacity_tokens=2 * self.BS,
                                  worker_disk_tokens=100)
        acme, beta = self._chain(self.ACME, 2), self._chain(self.BETA, 2)
        holdings.stored("w0", self.ACME, acme, 2)
        holdings.stored("w0", self.BETA, beta, 2)  # memory holds two blocks: acme's spill
        assert (holdings.held_by_tier("w0", acme), holdings.held_by_tier("w0", beta)) == (
            (0, 2), (2, 0))
        holdings.stored("w0", self.ACME, acme, 2)  # read back: promoted, beta's spill
        assert (holdings.held_by_tier("w0", acme), holdings.held_by_tier("w0", beta)) == (
            (2, 0), (0, 2))
