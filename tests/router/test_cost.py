"""The price table, the measured multiplier's definition, and the forecasts.

Cost and forecast at their edges: exact rates at each boundary, exact messages, exact usages.
"""
from __future__ import annotations
from tests.support.requests import planned_request

import pytest
from router.cost import (Rates, TokenUsage, forecast_request, job_multiplier,
                         load_price_table, measured_usage)
from router.forecast import CacheModel, PlannedRequest, batch_arrivals, forecast_job
from router.kv.key import Namespace, hash_blocks
from router.cost import (CostComparison, PriceTable, Rates, TokenUsage, compare,
                         forecast_request, measured_usage, parse_price_table, total_usage)
from router.kv.key import BlockHash


NS = Namespace("t", "m")

def _plan(prompts, arrivals, service_s=1.0):
    return [PlannedRequest(tuple(hash_blocks(p, 4, NS)), len(p), t, service_s)
            for p, t in zip(prompts, arrivals)]


class TestBehaviour:
    def test_default_table_file_has_the_documented_rates(self):
        table = load_price_table()
        assert table.version
        rates = table.rates("any-model")
        assert (rates.uncached, rates.cache_read) == (1.0, 0.1)
        assert rates.write_rate(300) == 1.25 and rates.write_rate(301) == 2.0
        assert rates.write_rate(3600) == 2.0 and rates.write_rate(86400) == 2.0

    def test_model_override_inherits_unset_rates(self, tmp_path):
        path = tmp_path / "p.toml"
        path.write_text('version = "v7"\n[default]\ncache_read = 0.2\n'
                        '[models."big"]\ncache_write_5m = 1.5\n')
        table = load_price_table(path)
        assert table.version == "v7"
        assert table.rates("big") == Rates(1.0, 0.2, 1.5, 2.0)
        assert table.rates("small") == Rates(1.0, 0.2, 1.25, 2.0)

    @pytest.mark.parametrize("text, needle", [
        ('[default]\ncache_read = 0.1\n', "version"),
        ('version = "1"\n[default]\ncache_reed = 0.1\n', "cache_reed"),
        ('version = "1"\n[default]\ncache_read = -1\n', "non-negative"),
        ('version = "1"\n[models.x]\ncache_read = "cheap"\n', "models.x"),
        ('version = \n', "not valid TOML"),
    ])
    def test_bad_price_tables_name_the_problem(self, tmp_path, text, needle):
        path = tmp_path / "p.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_price_table(path)

    def test_missing_price_table_says_so(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load_price_table(tmp_path / "nope.toml")

    def test_written_tokens_are_part_of_computed_and_priced_once(self):
        # 100 input: 40 read, 60 prefilled of which 32 newly stored.
        usage = TokenUsage(input_tokens=100, cached_tokens=40, written_tokens=32)
        assert usage.computed_tokens == 60
        rates = Rates()
        expected = (1.0 * 28 + 1.25 * 32 + 0.1 * 40) / 100
        assert usage.multiplier(rates, ttl_s=300) == pytest.approx(expected)
        assert usage.multiplier(rates, ttl_s=3600) == pytest.approx((28 + 2.0 * 32 + 4) / 100)

    def test_cold_request_storing_everything_costs_the_write_rate(self):
        assert TokenUsage(64, 0, 64).multiplier(Rates(), 300) == pytest.approx(1.25)
        assert TokenUsage(64, 0, 0).multiplier(Rates(), 300) == pytest.approx(1.0)

    def test_usage_rejects_impossible_counts_and_empty_prompts(self):
        with pytest.raises(ValueError, match="exceeds input"):
            TokenUsage(10, 11, 0)
        with pytest.raises(ValueError, match="only prefilled"):
            TokenUsage(10, 5, 6)
        with pytest.raises(ValueError, match="empty prompt"):
            TokenUsage(0, 0, 0).multiplier(Rates(), 300)
        with pytest.raises(ValueError, match="ttl_s"):
            TokenUsage(1, 0, 0).multiplier(Rates(), 0)

    def test_job_multiplier_is_token_weighted(self):
        usages = [TokenUsage(100, 0, 96), TokenUsage(300, 96, 192)]
        num = (4 + 1.25 * 96) + (12 + 1.25 * 192 + 0.1 * 96)
        assert job_multiplier(usages, Rates(), 300) == pytest.approx(num / 400)
        assert job_multiplier([], Rates(), 300) is None

    def test_request_forecast_writes_full_blocks_past_the_match(self):
        assert forecast_request(100, 32, 16) == TokenUsage(100, 32, 64)   # 6 full blocks, 2 held
        assert forecast_request(64, 63, 16) == TokenUsage(64, 63, 0)      # fully held
        assert forecast_request(10, 0, 16) == TokenUsage(10, 0, 0)        # shorter than a block
        with pytest.raises(ValueError, match="expected_cached"):
            forecast_request(64, 64, 16)

    def test_request_forecast_counts_the_tail_block_the_output_completes(self):
        # 100 tokens, 6 full blocks; 13 outputs make the K/V of 112 tokens: 7 full blocks.
        assert forecast_request(100, 32, 16, output_tokens=13) == TokenUsage(100, 32, 68)
        assert forecast_request(100, 32, 16, output_tokens=12) == TokenUsage(100, 32, 64)

    def test_measured_usage_splits_input_writes_from_output_writes(self):
        # Cached 32 of 100; the engine wrote 64 prompt tokens, then a block of 4 prompt + 12 output.
        assert measured_usage(100, 32, 80, 16) == TokenUsage(100, 32, 68)
        assert measured_usage(100, 32, 64, 16) == TokenUsage(100, 32, 64)
        # A fully held prompt of whole blocks (cached = input - 1) writes no input tokens.
        assert measured_usage(64, 63, 16, 16) == TokenUsage(64, 63, 0)
        # A block stored by a sibling first is not written twice: fewer written tokens.
        assert measured_usage(100, 0, 48, 16) == TokenUsage(100, 0, 48)

    def test_job_forecast_reuses_inside_the_job_after_prefill(self):
        system = list(range(8))
        prompts = [system + [100 + i, 1, 2, 3, 9] for i in range(3)]
        model = CacheModel(block_size=4, capacity_tokens=1000, ttl_s=300)
        # Two at once: both compute the shared system blocks, only the first writes them.
        usages = forecast_job(_plan(prompts, batch_arrivals(3, 2, 1.0)), {}, model)
        assert usages[0] == TokenUsage(13, 0, 12)
        assert usages[1] == TokenUsage(13, 0, 4)
        assert usages[2] == TokenUsage(13, 8, 4)

    def test_job_forecast_uses_what_the_cluster_holds_and_its_ttl(self):
        prompt = list(range(12)) + [7]
        chain = hash_blocks(prompt, 4, NS)
        model = CacheModel(block_size=4, capacity_tokens=1000, ttl_s=300)
        held = {chain[0]: 100.0, chain[1]: 100.0}
        assert forecast_job(_plan([prompt], [0.0]), held, model)[0] == TokenUsage(13, 8, 4)
        # Arriving after the held blocks' TTL ran out: nothing is read.
        assert forecast_job(_plan([prompt], [150.0]), held, model)[0] == TokenUsage(13, 0, 12)

    def test_job_forecast_evicts_past_capacity(self):
        a, b = list(range(9)), list(range(50, 59))
        model = CacheModel(block_size=4, capacity_tokens=8, ttl_s=300)
        usages = forecast_job(_plan([a, b, a], [0.0, 5.0, 10.0]), {}, model)
        assert usages[2] == TokenUsage(9, 0, 8)   # b's two blocks pushed a's out
        # An output that completes the partial last block writes the prompt's tail as well.
        long_out = [PlannedRequest(p.block_hashes, p.input_tokens, p.arrival_s, p.service_s, 4)
                    for p in _plan([a], [0.0])]
        assert forecast_job(long_out, {}, model)[0] == TokenUsage(9, 0, 9)
        roomy = CacheModel(block_size=4, capacity_tokens=16, ttl_s=300)
        assert forecast_job(_plan([a, b, a], [0.0, 5.0, 10.0]), {}, roomy)[2] == TokenUsage(9, 8, 0)

    def test_job_forecast_realisation_moves_reads_to_writes(self):
        a = list(range(9))
        model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300)
        plans = _plan([a, a], [0.0, 5.0])
        assert forecast_job(plans, {}, model)[1] == TokenUsage(9, 8, 0)
        # Half the modelled reuse realised: 4 tokens read, the other 4 computed and stored again.
        assert forecast_job(plans, {}, model, realisation=0.5)[1] == TokenUsage(9, 4, 4)
        with pytest.raises(ValueError, match="realisation"):
            forecast_job(plans, {}, model, realisation=1.5)


class TestExact:
    def test_the_write_rate_switches_just_above_five_minutes(self):
        rates = Rates(uncached=1.0, cache_read=0.1, cache_write_5m=1.25, cache_write_1h=2.0)
        assert rates.write_rate(0.001) == 1.25
        assert rates.write_rate(300.0) == 1.25
        assert rates.write_rate(300.5) == 2.0
        with pytest.raises(ValueError, match=r"^ttl_s must be positive, got 0$"):
            rates.write_rate(0)
        with pytest.raises(ValueError, match=r"^ttl_s must be positive, got -1$"):
            rates.write_rate(-1)

    def test_a_price_table_parses_to_exact_rates(self):
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
    def test_a_bad_price_table_gets_its_exact_message(self, data, message):
        with pytest.raises(ValueError) as info:
            parse_price_table(data)
        assert str(info.value) == message

    def test_usage_arithmetic_is_exact(self):
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
    def test_impossible_usages_are_refused(self, counts, message):
        with pytest.raises(ValueError, match=message):
            TokenUsage(*counts)

    def test_compare_prices_forecast_and_measured_with_one_table(self):
        table = PriceTable("v9", Rates(), {"m": Rates(1.0, 0.5, 2.0, 4.0)})
        result = compare(TokenUsage(10, 5, 5), TokenUsage(10, 0, 10), table, "m", 60)
        assert result == CostComparison("v9", TokenUsage(10, 5, 5), TokenUsage(10, 0, 10),
                                        (5 * 2.0 + 5 * 0.5) / 10, 2.0)
        assert result.error == 1.25 - 2.0

    def test_measured_usage_starts_writing_at_the_first_unread_block(self):
        # 20 cached of 100 at block 16: block 1 was read partially, so writes start at 32.
        assert measured_usage(100, 20, 48, 16) == TokenUsage(100, 20, 48)
        assert measured_usage(100, 20, 80, 16) == TokenUsage(100, 20, 68)
        assert measured_usage(100, 0, 0, 16) == TokenUsage(100, 0, 0)
        with pytest.raises(ValueError, match=r"^block_size must be positive, got 0$"):
            measured_usage(100, 0, 0, 0)

    def test_request_forecast_bounds_are_exact(self):
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

    def test_cache_model_and_arrivals_refuse_bad_values(self):
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

    def test_a_held_block_expires_at_exactly_its_ttl_left(self):
        model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=10.0)
        held = {BlockHash(1): 5.0, BlockHash(2): 0.0}  # 2 has no TTL left: not held at all
        plan = [planned_request([1], 5, 4.5, service=1.0), planned_request([1], 5, 0.0, service=1.0)]
        assert forecast_job(plan[:1], held, model) == [TokenUsage(5, 4, 0)]
        later = [planned_request([1], 5, 5.0, service=1.0)]
        assert forecast_job(later, held, model) == [TokenUsage(5, 0, 4)]
        assert forecast_job([planned_request([2], 5, 0.0, service=1.0)], held, model) == [TokenUsage(5, 0, 4)]

    def test_stores_land_before_lookups_at_the_same_instant(self):
        model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
        plan = [planned_request([1, 2], 9, 0.0, service=2.0), planned_request([1, 2, 3], 13, 2.0, service=1.0)]
        assert forecast_job(plan, {}, model) == [TokenUsage(9, 0, 8), TokenUsage(13, 8, 4)]
        just_before = [planned_request([1, 2], 9, 0.0, service=2.0), planned_request([1, 2, 3], 13, 1.5, service=1.0)]
        assert forecast_job(just_before, {}, model) == [TokenUsage(9, 0, 8), TokenUsage(13, 0, 4)]

    def test_an_empty_planned_prompt_is_refused_by_index(self):
        model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300.0)
        with pytest.raises(ValueError, match=r"^planned request 1 has no input tokens; "
                                             r"drop empty prompts$"):
            forecast_job([planned_request([], 3, 0.0, service=1.0), planned_request([], 0, 1.0, service=1.0)], {}, model)
        with pytest.raises(ValueError, match=r"^realisation must be in \[0, 1\], got -0.1$"):
            forecast_job([], {}, model, realisation=-0.1)
        assert forecast_job([], {}, model, realisation=0.0) == []

    def test_a_bad_price_table_file_is_named_in_the_message(self, tmp_path):
        from router.cost import load_price_table

        path = tmp_path / "prices.toml"
        path.write_text('version = "1"\n[default]\ncache_read = -1\n', encoding="utf-8")
        with pytest.raises(ValueError) as info:
            load_price_table(path)
        assert str(info.value) == f"{path}: default.cache_read must be a non-negative number, got -1"
        path.write_text('version = "é"\n[models."modèle"]\ncache_read = 0.5\n', encoding="utf-8")
        assert load_price_table(path).rates("modèle").cache_read == 0.5

    def test_an_empty_prompt_has_no_multiplier_and_says_so(self):
        with pytest.raises(ValueError) as info:
            TokenUsage(0, 0, 0).multiplier(Rates(), 60)
        assert str(info.value) == "an empty prompt has no effective input multiplier"

    def test_one_output_token_completes_no_block_and_one_token_blocks_work(self):
        # 63 tokens at 16: after one output token the K/V of 63 tokens is held, 3 full blocks.
        assert forecast_request(63, 0, 16) == TokenUsage(63, 0, 48)
        assert forecast_request(63, 0, 16, output_tokens=2) == TokenUsage(63, 0, 63)
        assert forecast_request(3, 1, 1) == TokenUsage(3, 1, 2)
        assert measured_usage(3, 1, 2, 1) == TokenUsage(3, 1, 2)
        assert forecast_request(0, 0, 16) == TokenUsage(0, 0, 0)
        with pytest.raises(ValueError, match=r"^expected_cached 1 must be in"):
            forecast_request(1, 1, 16)


class TestCacheControls:
    """A request's breakpoint and TTL in the price: the blocks before the breakpoint are
    written, at the rate of the TTL the request asked for."""

    def test_a_breakpoint_writes_only_the_full_blocks_before_it(self):
        assert forecast_request(100, 0, 16, 4, write_limit=40) == TokenUsage(100, 0, 32)
        assert forecast_request(100, 32, 16, 4, write_limit=40) == TokenUsage(100, 32, 0)
        assert forecast_request(100, 16, 16, 4, write_limit=48) == TokenUsage(100, 16, 32)
        assert forecast_request(100, 0, 16, 4, write_limit=0) == TokenUsage(100, 0, 0)
        assert forecast_request(100, 0, 16, 4) == TokenUsage(100, 0, 96)  # no breakpoint

    def test_a_write_is_priced_at_the_ttl_the_request_asked_for(self):
        usage = TokenUsage(100, 0, 32)
        rates = Rates()
        assert usage.cost(rates, 300.0) == 68 + 1.25 * 32  # 5 minutes: 108.0
        assert usage.cost(rates, 3600.0) == 68 + 2.0 * 32  # 1 hour: 132.0
        assert usage.multiplier(rates, 3600.0) == 1.32
