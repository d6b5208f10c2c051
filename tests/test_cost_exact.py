"""Cost and forecast at their edges: exact rates at each boundary, exact messages, exact usages."""
from __future__ import annotations

import pytest

from router.cost import (CostComparison, PriceTable, Rates, TokenUsage, compare,
                         forecast_request, measured_usage, parse_price_table, total_usage)
from router.forecast import CacheModel, PlannedRequest, batch_arrivals, forecast_job
from router.kv.key import BlockHash


def test_the_write_rate_switches_just_above_five_minutes():
    rates = Rates(uncached=1.0, cache_read=0.1, cache_write_5m=1.25, cache_write_1h=2.0)
    assert rates.write_rate(0.001) == 1.25
    assert rates.write_rate(300.0) == 1.25
    assert rates.write_rate(300.5) == 2.0
    with pytest.raises(ValueError, match=r"^ttl_s must be positive, got 0$"):
        rates.write_rate(0)
    with pytest.raises(ValueError, match=r"^ttl_s must be positive, got -1$"):
        rates.write_rate(-1)


def test_a_price_table_parses_to_exact_rates():
    table = parse_price_table({"version": "v1", "default": {"cache_read": 0, "uncached": 2},
                               "models": {"big": {"cache_write_1h": 3}}})
    assert table == PriceTable("v1", Rates(2.0, 0.0, 1.25, 2.0),
                               {"big": Rates(2.0, 0.0, 1.25, 3.0)})
    assert table.rates() == Rates(2.0, 0.0, 1.25, 2.0)
    assert table.rates("big").cache_write_1h == 3.0
    assert parse_price_table({"version": "v2"}) == PriceTable("v2", Rates(), {})


@pytest.mark.parametrize("data, message", [
    ({}, 'price table: set a non-empty string `version` (e.g. version = "2026-11-01")'),
    ({"version": ""}, 'price table: set a non-empty string `version` (e.g. version = "2026-11-01")'),
    ({"version": 3}, 'price table: set a non-empty string `version` (e.g. version = "2026-11-01")'),
    ({"version": "1", "default": []}, 'price table: [default] and [models."ID"] must be tables'),
    ({"version": "1", "models": 1}, 'price table: [default] and [models."ID"] must be tables'),
    ({"version": "1", "models": {"x": 1}}, "price table: models.x must be a table of rates"),
    ({"version": "1", "default": {"cache_read": True}},
     "price table: default.cache_read must be a non-negative number, got True"),
    ({"version": "1", "default": {"cache_read": -0.5}},
     "price table: default.cache_read must be a non-negative number, got -0.5"),
    ({"version": "1", "default": {"cheap": 1, "cache_reed": 1}},
     "price table: default: unknown price keys ['cache_reed', 'cheap']; use only uncached, "
     "cache_read, cache_write_5m, cache_write_1h"),
])
def test_a_bad_price_table_gets_its_exact_message(data, message):
    with pytest.raises(ValueError) as info:
        parse_price_table(data)
    assert str(info.value) == message


def test_usage_arithmetic_is_exact():
    usage = TokenUsage(100, 40, 32)
    assert usage.computed_tokens == 60
    assert usage + TokenUsage(10, 0, 10) == TokenUsage(110, 40, 42)
    assert total_usage([usage, TokenUsage(10, 0, 10), TokenUsage(0, 0, 0)]) == \
        TokenUsage(110, 40, 42)
    assert total_usage([]) == TokenUsage(0, 0, 0)
    rates = Rates(uncached=1.0, cache_read=0.5, cache_write_5m=3.0, cache_write_1h=5.0)
    assert usage.cost(rates, 60) == 28 + 3.0 * 32 + 0.5 * 40
    assert usage.cost(rates, 3600) == 28 + 5.0 * 32 + 0.5 * 40
    assert TokenUsage(4, 4, 0).multiplier(rates, 60) == 0.5
    assert TokenUsage(4, 0, 4).computed_tokens == 4  # written may equal computed


@pytest.mark.parametrize("counts, message", [
    ((-1, 0, 0), "token counts must be non-negative"),
    ((1, -1, 0), "token counts must be non-negative"),
    ((1, 0, -1), "token counts must be non-negative"),
    ((10, 11, 0), "cached_tokens 11 exceeds input_tokens 10"),
    ((10, 5, 6), "written_tokens 6 exceeds computed_tokens 5"),
])
def test_impossible_usages_are_refused(counts, message):
    with pytest.raises(ValueError, match=message):
        TokenUsage(*counts)


def test_compare_prices_forecast_and_measured_with_one_table():
    table = PriceTable("v9", Rates(), {"m": Rates(1.0, 0.5, 2.0, 4.0)})
    result = compare(TokenUsage(10, 5, 5), TokenUsage(10, 0, 10), table, "m", 60)
    assert result == CostComparison("v9", TokenUsage(10, 5, 5), TokenUsage(10, 0, 10),
                                    (5 * 2.0 + 5 * 0.5) / 10, 2.0)
    assert result.error == 1.25 - 2.0


def test_measured_usage_starts_writing_at_the_first_unread_block():
    # 20 cached of 100 at block 16: block 1 was read partially, so writes start at 32.
    assert measured_usage(100, 20, 48, 16) == TokenUsage(100, 20, 48)
    assert measured_usage(100, 20, 80, 16) == TokenUsage(100, 20, 68)
    assert measured_usage(100, 0, 0, 16) == TokenUsage(100, 0, 0)
    with pytest.raises(ValueError, match=r"^block_size must be positive, got 0$"):
        measured_usage(100, 0, 0, 0)


def test_request_forecast_bounds_are_exact():
    assert forecast_request(64, 0, 16) == TokenUsage(64, 0, 64)
    assert forecast_request(65, 64, 16) == TokenUsage(65, 64, 0)
    assert forecast_request(65, 64, 16, output_tokens=16) == TokenUsage(65, 64, 1)
    assert forecast_request(65, 64, 16, output_tokens=0) == TokenUsage(65, 64, 0)
    assert forecast_request(1, 0, 16) == TokenUsage(1, 0, 0)
    with pytest.raises(ValueError, match=r"^expected_cached -1 must be in \[0, input_tokens - 1\] "
                                         r"for a prompt of 64 tokens$"):
        forecast_request(64, -1, 16)
    with pytest.raises(ValueError, match=r"^block_size must be positive, got 0$"):
        forecast_request(64, 0, 0)


def test_cache_model_and_arrivals_refuse_bad_values():
    assert batch_arrivals(5, 2, 3.0) == [0.0, 0.0, 3.0, 3.0, 6.0]
    assert batch_arrivals(0, 1, 3.0) == []
    with pytest.raises(ValueError, match=r"^concurrency must be positive, got 0$"):
        batch_arrivals(3, 0, 1.0)
    CacheModel(block_size=1, capacity_tokens=0, ttl_s=0.5)  # the smallest valid model
    for bad in (dict(block_size=0, capacity_tokens=1, ttl_s=1.0),
                dict(block_size=1, capacity_tokens=-1, ttl_s=1.0),
                dict(block_size=1, capacity_tokens=1, ttl_s=0.0)):
        with pytest.raises(ValueError, match="cache model needs block_size > 0"):
            CacheModel(**bad)


def _request(blocks, tokens, at, service=1.0, output=1):
    return PlannedRequest(tuple(BlockHash(b) for b in blocks), tokens, at, service, output)


def test_a_held_block_expires_at_exactly_its_ttl_left():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=10.0)
    held = {BlockHash(1): 5.0, BlockHash(2): 0.0}  # 2 has no TTL left: not held at all
    plan = [_request([1], 5, 4.5), _request([1], 5, 0.0)]
    assert forecast_job(plan[:1], held, model) == [TokenUsage(5, 4, 0)]
    later = [_request([1], 5, 5.0)]
    assert forecast_job(later, held, model) == [TokenUsage(5, 0, 4)]
    assert forecast_job([_request([2], 5, 0.0)], held, model) == [TokenUsage(5, 0, 4)]


def test_stores_land_before_lookups_at_the_same_instant():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
    plan = [_request([1, 2], 9, 0.0, service=2.0), _request([1, 2, 3], 13, 2.0)]
    assert forecast_job(plan, {}, model) == [TokenUsage(9, 0, 8), TokenUsage(13, 8, 4)]
    just_before = [_request([1, 2], 9, 0.0, service=2.0), _request([1, 2, 3], 13, 1.5)]
    assert forecast_job(just_before, {}, model) == [TokenUsage(9, 0, 8), TokenUsage(13, 0, 4)]


def test_an_empty_planned_prompt_is_refused_by_index():
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
    with pytest.raises(ValueError, match=r"^planned request 1 has no input tokens; "
                                         r"drop empty prompts$"):
        forecast_job([_request([], 3, 0.0), _request([], 0, 1.0)], {}, model)
    with pytest.raises(ValueError, match=r"^realisation must be in \[0, 1\], got -0.1$"):
        forecast_job([], {}, model, realisation=-0.1)
    assert forecast_job([], {}, model, realisation=0.0) == []


def test_a_bad_price_table_file_is_named_in_the_message(tmp_path):
    from router.cost import load_price_table

    path = tmp_path / "prices.toml"
    path.write_text('version = "1"\n[default]\ncache_read = -1\n', encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_price_table(path)
    assert str(info.value) == f"{path}: default.cache_read must be a non-negative number, got -1"
    path.write_text('version = "é"\n[models."modèle"]\ncache_read = 0.5\n', encoding="utf-8")
    assert load_price_table(path).rates("modèle").cache_read == 0.5


def test_an_empty_prompt_has_no_multiplier_and_says_so():
    with pytest.raises(ValueError) as info:
        TokenUsage(0, 0, 0).multiplier(Rates(), 60)
    assert str(info.value) == "an empty prompt has no effective input multiplier"


def test_one_output_token_completes_no_block_and_one_token_blocks_work():
    # 63 tokens at 16: after one output token the K/V of 63 tokens is held, 3 full blocks.
    assert forecast_request(63, 0, 16) == TokenUsage(63, 0, 48)
    assert forecast_request(63, 0, 16, output_tokens=2) == TokenUsage(63, 0, 63)
    assert forecast_request(3, 1, 1) == TokenUsage(3, 1, 2)
    assert measured_usage(3, 1, 2, 1) == TokenUsage(3, 1, 2)
    assert forecast_request(0, 0, 16) == TokenUsage(0, 0, 0)
    with pytest.raises(ValueError, match=r"^expected_cached 1 must be in"):
        forecast_request(1, 1, 16)
