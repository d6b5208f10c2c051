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
