"""The 5-minute against the 1-hour TTL on traces whose answer is known exactly.

Prompt A: 4 full 512-token blocks and a 100-token tail (2,148 tokens). Rates: uncached 1,
read 0.1, write 1.25 (5 minutes) or 2.0 (1 hour): the break-even is 0.75 / 1.15 late
re-reads per 1-hour write.
"""
import pytest

from router.cost import Rates, TokenUsage
from router.sim.trace import TraceRequest
from router.sim.ttl_compare import break_even, compare_ttls

A = (0, 1, 2, 3, 4)
INPUT = 4 * 512 + 100
RATES = Rates()


def requests_at(*times: float, ids=A, length=INPUT) -> list[TraceRequest]:
    return [TraceRequest(t, length, 10, ids) for t in times]


def test_a_late_reread_too_few_to_pay_for_the_hour():
    # t=200: read at both TTLs; t=800 (600 s after): a miss at 5 minutes, a read at 1 hour;
    # t=5000 (4,200 s after): a miss at both
    result = compare_ttls(requests_at(0, 200, 800, 5000), RATES, 512)
    assert result.short == TokenUsage(4 * INPUT, 2048, 3 * 2048)
    assert result.long == TokenUsage(4 * INPUT, 2 * 2048, 2 * 2048)
    assert result.short_multiplier == pytest.approx((400 + 3 * 2048 * 1.25 + 2048 * 0.1)
                                                    / (4 * INPUT))
    assert result.long_multiplier == pytest.approx((400 + 2 * 2048 * 2.0 + 2 * 2048 * 0.1)
                                                   / (4 * INPUT))
    assert (result.reread_tokens, result.late_reread_tokens) == (3 * 2048, 2048)
    assert result.late_share == pytest.approx(1 / 3)
    assert result.late_per_write == 0.5  # under the break-even of 0.652
    assert result.break_even == pytest.approx(0.75 / 1.15)
    assert result.recommended_ttl_s == 300.0
    assert result.cost_per_request(False) == pytest.approx((400 + 3 * 2048 * 1.25
                                                            + 2048 * 0.1) / 4)


def test_rereads_every_ten_minutes_pay_for_the_hour():
    result = compare_ttls(requests_at(0, 600, 1200, 1800), RATES, 512)
    assert result.short == TokenUsage(4 * INPUT, 0, 4 * 2048)  # every read came too late
    assert result.long == TokenUsage(4 * INPUT, 3 * 2048, 2048)
    assert result.short_multiplier == pytest.approx((400 + 4 * 2048 * 1.25) / (4 * INPUT))
    assert result.long_multiplier == pytest.approx((400 + 2048 * 2.0 + 3 * 2048 * 0.1)
                                                   / (4 * INPUT))
    assert (result.late_share, result.late_per_write) == (1.0, 3.0)
    out = result.as_json()
    assert out["recommended_ttl_s"] == 3600.0
    assert out["late_reread_share"] == 1.0 and out["late_rereads_per_1h_write"] == 3.0
    assert out["break_even_rereads_per_1h_write"] == 0.6522
    assert out["m_5m"] == round((400 + 4 * 2048 * 1.25) / (4 * INPUT), 4)


def test_at_the_break_even_the_two_cost_the_same_and_the_shorter_is_kept():
    rates = Rates(cache_read=0.0, cache_write_5m=1.0, cache_write_1h=2.0)  # break-even: 1
    assert break_even(rates) == 1.0
    result = compare_ttls(requests_at(0, 600), rates, 512)  # one late re-read per write
    assert result.late_per_write == 1.0
    assert result.short_multiplier == result.long_multiplier == (200 + 2 * 2048) / (2 * INPUT)
    assert result.recommended_ttl_s == 300.0


def test_a_whole_prompt_held_still_computes_its_last_token():
    # 2,048 tokens, 4 full blocks and no tail: the second request reads 2,047 of them
    result = compare_ttls(requests_at(0, 10, ids=(0, 1, 2, 3), length=2048), RATES, 512)
    assert result.short == TokenUsage(4096, 2047, 2048)


def test_no_requests_or_no_block_size_is_a_clear_error():
    with pytest.raises(ValueError, match="no requests"):
        compare_ttls([], RATES, 512)
    with pytest.raises(ValueError, match="block must be positive"):
        compare_ttls(requests_at(0), RATES, 0)
