"""The job forecast's cache model at its edges: eviction policy, held blocks, tails, pending."""
from __future__ import annotations
from tests.support.requests import planned_request

from router.cost import TokenUsage
from router.forecast import CacheModel, PlannedRequest, forecast_job
from router.kv.key import BlockHash


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
