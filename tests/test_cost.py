"""The price table, the measured multiplier's definition, and the forecasts."""
import pytest

from router.cost import (Rates, TokenUsage, forecast_request, job_multiplier,
                         load_price_table, measured_usage)
from router.forecast import CacheModel, PlannedRequest, batch_arrivals, forecast_job
from router.kv.key import Namespace, hash_blocks

NS = Namespace("t", "m")


def test_default_table_file_has_the_documented_rates():
    table = load_price_table()
    assert table.version
    rates = table.rates("any-model")
    assert (rates.uncached, rates.cache_read) == (1.0, 0.1)
    assert rates.write_rate(300) == 1.25 and rates.write_rate(301) == 2.0
    assert rates.write_rate(3600) == 2.0 and rates.write_rate(86400) == 2.0


def test_model_override_inherits_unset_rates(tmp_path):
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
def test_bad_price_tables_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_price_table(path)


def test_missing_price_table_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_price_table(tmp_path / "nope.toml")


def test_written_tokens_are_part_of_computed_and_priced_once():
    # 100 input: 40 read, 60 prefilled of which 32 newly stored.
    usage = TokenUsage(input_tokens=100, cached_tokens=40, written_tokens=32)
    assert usage.computed_tokens == 60
    rates = Rates()
    expected = (1.0 * 28 + 1.25 * 32 + 0.1 * 40) / 100
    assert usage.multiplier(rates, ttl_s=300) == pytest.approx(expected)
    assert usage.multiplier(rates, ttl_s=3600) == pytest.approx((28 + 2.0 * 32 + 4) / 100)


def test_cold_request_storing_everything_costs_the_write_rate():
    assert TokenUsage(64, 0, 64).multiplier(Rates(), 300) == pytest.approx(1.25)
    assert TokenUsage(64, 0, 0).multiplier(Rates(), 300) == pytest.approx(1.0)


def test_usage_rejects_impossible_counts_and_empty_prompts():
    with pytest.raises(ValueError, match="exceeds input"):
        TokenUsage(10, 11, 0)
    with pytest.raises(ValueError, match="only prefilled"):
        TokenUsage(10, 5, 6)
    with pytest.raises(ValueError, match="empty prompt"):
        TokenUsage(0, 0, 0).multiplier(Rates(), 300)
    with pytest.raises(ValueError, match="ttl_s"):
        TokenUsage(1, 0, 0).multiplier(Rates(), 0)


def test_job_multiplier_is_token_weighted():
    usages = [TokenUsage(100, 0, 96), TokenUsage(300, 96, 192)]
    num = (4 + 1.25 * 96) + (12 + 1.25 * 192 + 0.1 * 96)
    assert job_multiplier(usages, Rates(), 300) == pytest.approx(num / 400)
    assert job_multiplier([], Rates(), 300) is None


def test_request_forecast_writes_full_blocks_past_the_match():
    assert forecast_request(100, 32, 16) == TokenUsage(100, 32, 64)   # 6 full blocks, 2 held
    assert forecast_request(64, 63, 16) == TokenUsage(64, 63, 0)      # fully held
    assert forecast_request(10, 0, 16) == TokenUsage(10, 0, 0)        # shorter than a block
    with pytest.raises(ValueError, match="expected_cached"):
        forecast_request(64, 64, 16)


def test_request_forecast_counts_the_tail_block_the_output_completes():
    # 100 tokens, 6 full blocks; 13 outputs make the K/V of 112 tokens: 7 full blocks.
    assert forecast_request(100, 32, 16, output_tokens=13) == TokenUsage(100, 32, 68)
    assert forecast_request(100, 32, 16, output_tokens=12) == TokenUsage(100, 32, 64)


def test_measured_usage_splits_input_writes_from_output_writes():
    # Cached 32 of 100; the engine wrote 64 prompt tokens, then a block of 4 prompt + 12 output.
    assert measured_usage(100, 32, 80, 16) == TokenUsage(100, 32, 68)
    assert measured_usage(100, 32, 64, 16) == TokenUsage(100, 32, 64)
    # A fully held prompt of whole blocks (cached = input - 1) writes no input tokens.
    assert measured_usage(64, 63, 16, 16) == TokenUsage(64, 63, 0)
    # A block stored by a sibling first is not written twice: fewer written tokens.
    assert measured_usage(100, 0, 48, 16) == TokenUsage(100, 0, 48)


def _plan(prompts, arrivals, service_s=1.0):
    return [PlannedRequest(tuple(hash_blocks(p, 4, NS)), len(p), t, service_s)
            for p, t in zip(prompts, arrivals)]


def test_job_forecast_reuses_inside_the_job_after_prefill():
    system = list(range(8))
    prompts = [system + [100 + i, 1, 2, 3, 9] for i in range(3)]
    model = CacheModel(block_size=4, capacity_tokens=1000, ttl_s=300)
    # Two at once: both compute the shared system blocks, only the first writes them.
    usages = forecast_job(_plan(prompts, batch_arrivals(3, 2, 1.0)), {}, model)
    assert usages[0] == TokenUsage(13, 0, 12)
    assert usages[1] == TokenUsage(13, 0, 4)
    assert usages[2] == TokenUsage(13, 8, 4)


def test_job_forecast_uses_what_the_cluster_holds_and_its_ttl():
    prompt = list(range(12)) + [7]
    chain = hash_blocks(prompt, 4, NS)
    model = CacheModel(block_size=4, capacity_tokens=1000, ttl_s=300)
    held = {chain[0]: 100.0, chain[1]: 100.0}
    assert forecast_job(_plan([prompt], [0.0]), held, model)[0] == TokenUsage(13, 8, 4)
    # Arriving after the held blocks' TTL ran out: nothing is read.
    assert forecast_job(_plan([prompt], [150.0]), held, model)[0] == TokenUsage(13, 0, 12)


def test_job_forecast_evicts_past_capacity():
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


def test_job_forecast_realisation_moves_reads_to_writes():
    a = list(range(9))
    model = CacheModel(block_size=4, capacity_tokens=100, ttl_s=300)
    plans = _plan([a, a], [0.0, 5.0])
    assert forecast_job(plans, {}, model)[1] == TokenUsage(9, 8, 0)
    # Half the modelled reuse realised: 4 tokens read, the other 4 computed and stored again.
    assert forecast_job(plans, {}, model, realisation=0.5)[1] == TokenUsage(9, 4, 4)
    with pytest.raises(ValueError, match="realisation"):
        forecast_job(plans, {}, model, realisation=1.5)
