"""``orchard bench ttl-forecast``: a job's TTLs change what a real engine reads, and the
forecast knows it; the command runs small and prints its figures."""
from __future__ import annotations

import json

import pytest

from cluster.bench.ttl_forecast import TtlRequest, mixed_job, run_jobs, small_shape
from cluster.cli import main
from router.cost import TokenUsage
from router.sim.trace import TraceRequest
from tests.support.forged_models import tiny_model

A = (0, 1, 2, 3, 4)  # 4 full 16-token blocks and a 5-token tail
N = 4 * 16 + 5


def at(t: float, ttl: float | None) -> TtlRequest:
    return TtlRequest(TraceRequest(t, N, 1, A), ttl)


@pytest.mark.slow
def test_a_prefix_back_after_ten_minutes_is_read_only_under_the_hour():
    # the store's own TTL is 5 minutes: what is written at 5 minutes is gone at 600 s
    five, hour = run_jobs(tiny_model(), [[at(0, 300.0), at(600, 300.0)],
                                         [at(0, 3600.0), at(600, None)]], store_ttl_s=300.0)
    assert five.measured == five.forecast == TokenUsage(2 * N, 0, 2 * 64)
    assert hour.measured == hour.forecast == TokenUsage(2 * N, 64, 64)
    assert five.measured_m == pytest.approx((2 * 5 + 128 * 1.25) / (2 * N))
    # the first request priced at the hour's write rate, the second (default) at 5 minutes'
    assert hour.measured_m == pytest.approx((10 + 64 * 2.0 + 64 * 0.1) / (2 * N))
    assert (five.error, hour.error) == (0.0, 0.0)
    assert hour.ttl_mix == {"5m": 0, "1h": 1, "default": 1}


@pytest.mark.slow
def test_agent_jobs_mixing_ttls_are_forecast_within_the_target(capsys):
    job = mixed_job(small_shape(3, 16), seed=1)
    assert {r.ttl_s for r in job} == {300.0, 3600.0, None}
    assert any(r.trace.write_blocks is not None for r in job)  # breakpoints too
    assert main(["bench", "ttl-forecast", "--model", str(tiny_model()), "--jobs", "2",
                 "--sessions", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["jobs"] == 2 and len(out["per_job"]) == 2
    assert out["forecast_error_max"] == max(j["forecast_error"] for j in out["per_job"])
    assert out["forecast_error_max"] <= 0.05
    assert all(j["measured_cached_tokens"] > 0 for j in out["per_job"])
