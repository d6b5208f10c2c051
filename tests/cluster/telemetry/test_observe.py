"""The request observer (``cluster.telemetry.observe``).

It prices a request's cache controls: its writes at the TTL it asked for, its forecast
writes only the blocks before its breakpoint, and a request that reads nothing is forecast
to read nothing. Real engines and router (``TracedCluster``), exact multipliers.

Its job forecast stays right when the cluster's caches change between two identical jobs:
each test runs a job, changes the cluster (invalidation, eviction by another tenant's job,
TTL expiry, worker loss, drain, scale out), then forecasts and runs the same job again: the
forecast multiplier of the second job is within 0.05 of the measured one. The forecast's
memory uses the blocks held and the share of modelled reuse routing realised, and mirrors
both tiers of each store.
"""
from __future__ import annotations

import random

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from router.cost import PriceTable, measured_usage, total_usage
from router.kv.events import Tier
from router.kv.key import hash_blocks
from router.policy import Reason
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.request_traces import BS as TRACE_BS
from tests.support.request_traces import NS, SYSTEM, observed, run, tiered_cluster
from tests.support.telemetry_factories import decision, in_memory, result
from tests.support.traced_cluster import TracedCluster, Turn
from workers.messages import CacheControls, LookupOutcome

BS = 16
TTL = 300.0
PRICES = PriceTable()
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


@pytest.fixture
def setup(tmp_path):
    return observed(tmp_path)


@pytest.fixture
def tiered(tmp_path):
    tc, exporter, a, b, a2 = tiered_cluster(tmp_path)
    yield tc, exporter, a, b, a2
    tc.close()


def job(vocab: int, tenant: str, seed: int, requests: int = 6) -> list[Turn]:
    """A shared 64-token system prefix, then 24 tokens of each request's own."""
    rng = random.Random(seed)
    system = tuple(rng.randrange(vocab) for _ in range(64))
    return [Turn(f"{tenant}-{seed}-{i}", tenant, system + tuple(rng.randrange(vocab) for _ in range(24)), 2)
            for i in range(requests)]


def m(usage) -> float:
    return usage.multiplier(PRICES.rates(), TTL)


def forecast_and_run(tc: TracedCluster, clock: Clock, turns: list[Turn]) -> tuple[float, float]:
    """(forecast M, measured M) of ``turns`` run as one job."""
    forecast = total_usage(tc.forecast(turns, 1, 1.0))
    measured = []
    for turn in turns:
        result = tc.run(turn).result
        measured.append(measured_usage(result.input_tokens, result.cached_tokens,
                                       result.written_tokens, BS))
        clock.now += 1.0
    return m(forecast), m(total_usage(measured))


def build(tmp_path, workers: int = 2, store_bytes: int = 1 << 28):
    tel, _, _ = in_memory(tmp_path)
    clock = Clock(1000.0)
    return TracedCluster(tiny_model("llama"), workers, tel, block_size=BS, ttl_s=TTL,
                         store_bytes=store_bytes, clock=clock), clock


def twice(tc, clock, between) -> tuple[tuple[float, float], tuple[float, float]]:
    turns = job(tc.engine().vocab_size, "acme", 1)
    first = forecast_and_run(tc, clock, turns)
    between()
    return first, forecast_and_run(tc, clock, turns)


class TestTheJobForecastAcrossChanges:
    def test_nothing_between_jobs_the_second_reads_the_first(self, tmp_path):
        tc, clock = build(tmp_path)
        first, second = twice(tc, clock, lambda: None)
        assert first[0] == pytest.approx(first[1], abs=0.05)
        assert second[0] == pytest.approx(second[1], abs=0.05)
        assert second[1] < first[1] - 0.3   # the cache really served the second job

    def test_invalidation_empties_the_forecasts_memory(self, tmp_path):
        tc, clock = build(tmp_path)
        held, removed = [], []

        def invalidate() -> None:
            held.append(sum(e.store_stats().ledger.blocks for e in tc.engines.values()))
            removed.append(tc.invalidate("acme"))
            held.append(sum(e.store_stats().ledger.blocks for e in tc.engines.values()))
        first, second = twice(tc, clock, invalidate)
        assert removed[0] == held[0] and held[1] == 0   # acme's blocks were every block held
        assert second[1] == pytest.approx(first[1], abs=0.01)   # nothing was left to read
        assert second[0] == pytest.approx(second[1], abs=0.05)

    def test_ttl_expiry(self, tmp_path):
        tc, clock = build(tmp_path)

        def wait():
            clock.now += TTL + 1
        first, second = twice(tc, clock, wait)
        assert second[1] == pytest.approx(first[1], abs=0.01)
        assert second[0] == pytest.approx(second[1], abs=0.05)

    def test_eviction_by_another_tenants_job(self, tmp_path):
        tc, clock = build(tmp_path, workers=1)
        per_token = tc.engine().store_stats().bytes_per_token
        tc2, clock = build(tmp_path / "small", workers=1, store_bytes=200 * per_token)
        other = job(tc2.engine().vocab_size, "other", 2, requests=4)

        def crowd():
            for turn in other:
                tc2.run(turn)
                clock.now += 1.0
        first, second = twice(tc2, clock, crowd)
        assert second[1] > first[1] - 0.2          # the crowd evicted most of the first job
        assert second[0] == pytest.approx(second[1], abs=0.05)

    @pytest.mark.parametrize("event", ["lost", "drained"])
    def test_worker_leaving(self, tmp_path, event):
        tc, clock = build(tmp_path, workers=2)
        turns = job(tc.engine().vocab_size, "acme", 1)
        forecast_and_run(tc, clock, turns)
        holder = max(tc.engines, key=lambda w: len(tc.engines[w].holdings()))
        if event == "drained":
            tc.router.drain_worker(holder)   # routed to no more, then stopped
        tc.remove_worker(holder)
        forecast, measured = forecast_and_run(tc, clock, turns)
        assert forecast == pytest.approx(measured, abs=0.05)

    def test_scale_out(self, tmp_path):
        tc, clock = build(tmp_path, workers=1)
        first, second = twice(tc, clock, lambda: tc.add_worker("w9", tiny_model("llama"), 1 << 28))
        assert second[0] == pytest.approx(second[1], abs=0.05)
        assert tc.observer.holdings.capacity_tokens() == 2 * (1 << 28) // tc.engine().store_stats().bytes_per_token


def _leading(chain, blocks) -> int:
    """How many leading blocks of ``chain`` are in ``blocks`` (a tier's holdings)."""
    n = 0
    while n < len(chain) and chain[n] in blocks:
        n += 1
    return n


class TestTheJobForecastsMemory:
    def test_job_forecast_uses_held_blocks_and_the_realised_share(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        chain = hash_blocks(prompt, TRACE_BS, NS)
        fresh_plans, held = observer.plan_job([chain], [17], [1], 1, 0.1)
        assert held == {} and observer.forecast_job(fresh_plans, held)[0].cached_tokens == 0
        run(observer, tel, "r1", prompt, decision("w1", Reason.COLD_HASH, 0, 17, {"w1": 0}),
            result("r1", 17, 0, 16, "w1", LookupOutcome.MISS))
        clock.now = 5.0
        plans, held = observer.plan_job([chain], [17], [1], 1, 0.1)
        assert set(held) == set(chain) and all(0 < left <= 300 for left in held.values())
        assert observer.realisation() == 1.0
        assert observer.forecast_job(plans, held)[0].cached_tokens == 16
        # The next one went elsewhere and read nothing: routing realised none of the model's reuse.
        run(observer, tel, "r2", prompt, decision("w0", Reason.LOAD_SPILL, 0, 17, {"w0": 0, "w1": 16}),
            result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
        assert observer.realisation() == 0.0
        assert observer.forecast_job(plans, held)[0].cached_tokens == 0

    def test_the_forecast_mirror_keeps_both_tiers_as_the_store_does(self, tiered):
        tc, _, a, b, a2 = tiered
        for rid, prompt in (("a", a), ("b", b), ("a2", a2)):
            tc.run(Turn(rid, "acme", prompt, 4))
        ns = tc.engine().namespace("acme")
        held, holdings = tc.engine().holdings(), tc.observer.holdings
        memory = {h.block for h in held if h.tier == Tier.MEMORY}
        disk = {h.block for h in held if h.tier == Tier.DISK}
        for prompt, want in ((a2, (6, 0)), (b, (0, 4)), (a, (4, 0))):
            chain = hash_blocks(prompt, BS, ns)
            real = _leading(chain, memory)
            real = (real, _leading(chain[real:], disk))
            assert holdings.held_by_tier("w0", chain) == real == want
        per_token = tc.engine().kv_bytes_per_token
        assert holdings.capacity_by_tier() == (6 * BS, 64 * BS)
        assert tc.engine().disk_kv_bytes_per_token == per_token
        # B's blocks, on disk only, are read, not computed: the job forecast counts them as cached
        (usage,) = tc.forecast([Turn("b2", "acme", b, 4)])
        assert (usage.input_tokens, usage.cached_tokens, usage.written_tokens) == (70, 64, 0)
