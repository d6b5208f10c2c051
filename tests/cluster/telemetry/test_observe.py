"""The request observer (``cluster.telemetry.observe``) prices a request's cache controls: its
writes at the TTL it asked for, its forecast writes only the blocks before its breakpoint,
and a request that reads nothing is forecast to read nothing. Real engines and router
(``TracedCluster``), exact multipliers.
"""
from __future__ import annotations

import random

import pytest

from router.kv.key import hash_blocks
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.telemetry_factories import in_memory
from tests.support.traced_cluster import TracedCluster, Turn
from workers.messages import CacheControls

BS = 16
PROMPT = tuple(random.Random(7).randrange(32000) for _ in range(70))  # 4 full blocks + 6


@pytest.fixture
def cluster(tmp_path):
    tel, _, _ = in_memory(tmp_path)
    tc = TracedCluster(tiny_model("llama"), 1, tel, block_size=BS, ttl_s=300.0,
                       clock=Clock(1000.0))
    yield tc
    tc.close()
    tel.shutdown()


def priced(cluster, rid: str, cache: CacheControls = CacheControls(), prompt=PROMPT):
    ran = cluster.run(Turn(rid, "t", prompt, 4, cache=cache))
    return ran.result, ran.observed.cost


class TestPrices:
    def test_an_hour_write_is_priced_at_the_hour_rate(self, cluster):
        result, cost = priced(cluster, "a", CacheControls(ttl_s=3600.0))
        assert result.written_tokens == 64
        assert cost.measured.written_tokens == 64
        assert cost.measured_multiplier == pytest.approx((6 + 2.0 * 64) / 70, abs=1e-12)
        assert cost.forecast_multiplier == cost.measured_multiplier

    def test_the_store_ttl_is_priced_at_the_five_minute_rate(self, cluster):
        _, cost = priced(cluster, "a")
        assert cost.measured_multiplier == pytest.approx((6 + 1.25 * 64) / 70, abs=1e-12)

    def test_a_breakpoint_is_forecast_and_measured_writing_the_blocks_before_it(self, cluster):
        result, cost = priced(cluster, "a", CacheControls(write_limit=40))
        assert result.written_tokens == 32
        assert (cost.forecast.written_tokens, cost.measured.written_tokens) == (32, 32)
        assert cost.measured_multiplier == pytest.approx((38 + 1.25 * 32) / 70, abs=1e-12)

    def test_write_false_is_forecast_and_measured_writing_nothing(self, cluster):
        _, cost = priced(cluster, "a", CacheControls(write=False))
        assert (cost.forecast.written_tokens, cost.measured.written_tokens) == (0, 0)
        assert cost.measured_multiplier == 1.0

    def test_read_false_is_forecast_reading_nothing(self, cluster):
        priced(cluster, "a")
        _, warm = priced(cluster, "b")
        assert warm.forecast.cached_tokens == 64
        _, cold = priced(cluster, "c", CacheControls(read=False))
        assert (cold.forecast.cached_tokens, cold.measured.cached_tokens) == (0, 0)
        assert cold.measured_multiplier == 1.0  # every block was held: nothing written


class TestJobForecast:
    def test_each_request_s_breakpoint_and_bypass_shape_the_job_forecast(self, cluster):
        observer = cluster.observer
        hashes = hash_blocks(PROMPT, BS, cluster.engine().namespace("t"))
        plans, held = observer.plan_job(
            [hashes] * 3, [70] * 3, [4] * 3, 1, 1.0,
            [CacheControls(write_limit=40), CacheControls(), CacheControls(read=False)])
        assert [(p.read, p.write_limit, p.ttl_s) for p in plans] == [
            (True, 40, None), (True, None, None), (False, None, None)]
        usages = observer.forecast_job(plans, held)
        assert [(u.cached_tokens, u.written_tokens) for u in usages] == [
            (0, 32),   # two blocks before its breakpoint
            (32, 32),  # reads them; writes the other two (4 outputs do not complete a 5th)
            (0, 0)]    # reads nothing; every block is held already: writes nothing
