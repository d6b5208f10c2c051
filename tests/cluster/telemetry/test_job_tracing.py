"""The job forecast stays right when the cluster's caches change between two identical jobs.

Each test runs a job on the real engines and router (a tiny forged model), changes the
cluster (invalidation, eviction by another tenant's job, TTL expiry, worker loss, drain,
scale out), then forecasts and runs the same job again: the forecast multiplier of the
second job is within 0.05 of the measured one.

``TestRequestMetrics``: each request traced is counted once in the Prometheus metrics.
"""
import dataclasses
import random

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from tests.support.traced_cluster import TracedCluster, Turn
from router.cost import PriceTable, measured_usage, total_usage
from tests.support.telemetry_factories import in_memory
from tests.conftest import Clock
from cluster.backend.protocol import GenerateOutcome
from cluster.telemetry.job_tracing import JobTracing
from cluster.telemetry.observe import RequestObserver, ServedCache
from cluster.telemetry.prometheus import ScrapeState, ServingMetrics
from prometheus_client.parser import text_string_to_metric_families
from router.kv.key import Namespace
from router.policy import Reason
from router.pull_cost import PullChoice
from tests.support.telemetry_factories import decision, result
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams
from tests.support.forged_models import tiny_model

BS = 16
TTL = 300.0
PRICES = PriceTable()


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


def test_nothing_between_jobs_the_second_reads_the_first(tmp_path):
    tc, clock = build(tmp_path)
    first, second = twice(tc, clock, lambda: None)
    assert first[0] == pytest.approx(first[1], abs=0.05)
    assert second[0] == pytest.approx(second[1], abs=0.05)
    assert second[1] < first[1] - 0.3   # the cache really served the second job


def test_invalidation_empties_the_forecasts_memory(tmp_path):
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


def test_ttl_expiry(tmp_path):
    tc, clock = build(tmp_path)

    def wait():
        clock.now += TTL + 1
    first, second = twice(tc, clock, wait)
    assert second[1] == pytest.approx(first[1], abs=0.01)
    assert second[0] == pytest.approx(second[1], abs=0.05)


def test_eviction_by_another_tenants_job(tmp_path):
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
def test_worker_leaving(tmp_path, event):
    tc, clock = build(tmp_path, workers=2)
    turns = job(tc.engine().vocab_size, "acme", 1)
    forecast_and_run(tc, clock, turns)
    holder = max(tc.engines, key=lambda w: len(tc.engines[w].holdings()))
    if event == "drained":
        tc.router.drain_worker(holder)   # routed to no more, then stopped
    tc.remove_worker(holder)
    forecast, measured = forecast_and_run(tc, clock, turns)
    assert forecast == pytest.approx(measured, abs=0.05)


def test_scale_out(tmp_path):
    tc, clock = build(tmp_path, workers=1)
    first, second = twice(tc, clock, lambda: tc.add_worker("w9", tiny_model("llama"), 1 << 28))
    assert second[0] == pytest.approx(second[1], abs=0.05)
    assert tc.observer.holdings.capacity_tokens() == 2 * (1 << 28) // tc.engine().store_stats().bytes_per_token


class TestRequestMetrics:
    """``JobTracing.request`` counts each request once in the Prometheus metrics: served,
    failed with a code, or ended by an exception (its status named by ``status_of``)."""

    def tracing(self, tmp_path):
        tel, _, _ = in_memory(tmp_path)
        clock = Clock(1000.0)
        observer = RequestObserver(tel, PRICES, ServedCache("llama", BS, TTL, 100_000),
                                   clock=clock)
        return JobTracing(observer, ServingMetrics(m)), clock

    def finished(self, tracing) -> dict[tuple[str, str], float]:
        body = tracing.metrics.render(ScrapeState({}, {}, {}))[0].decode()
        return {(s.labels["tenant"], s.labels["status"]): s.value
                for f in text_string_to_metric_families(body) for s in f.samples
                if s.name == "orchard_requests_finished_total"}

    def test_a_result_a_failure_and_an_exception_each_count_once(self, tmp_path):
        tracing, clock = self.tracing(tmp_path)
        sampling = SamplingParams(4)
        served = result("r1", 40, 32, 0, "w0", LookupOutcome.HIT)
        request = GenerateRequest("r1", Namespace("acme", "llama"), tuple(range(40)),
                                  sampling)
        with pytest.raises(GeneratorExit):  # the caller stopped reading after the result
            with tracing.request("acme", "r1", "", "", sampling) as trace:
                clock.now += 0.25
                trace.done(request, (), GenerateOutcome(
                    served, decision("w0", Reason.PREFIX_MATCH, 32, 40, {"w0": 32}), 1, "w0"))
                raise GeneratorExit
        with tracing.request("beta", "r2", "j", "", sampling) as trace:
            trace.failed("UNAVAILABLE", "no worker")
            trace.failed("UNAVAILABLE", "no worker")
        with pytest.raises(TimeoutError):
            with tracing.request("beta", "r3", "", "", sampling):
                raise TimeoutError
        assert self.finished(tracing) == {("acme", "OK"): 1, ("beta", "UNAVAILABLE"): 1,
                                          ("beta", "DEADLINE_EXCEEDED"): 1}
        body = tracing.metrics.render(ScrapeState({}, {}, {}))[0].decode()
        assert 'orchard_e2e_request_latency_seconds_sum{worker="w0"} 0.25' in body
        assert 'orchard_router_decisions_total{outcome="hit",worker="w0"} 1.0' in body
        assert 'orchard_cached_tokens_total{tenant="acme",tier="memory",worker="w0"} 32.0' \
            in body

    def test_a_decision_that_planned_a_pull_counts_as_pulled(self, tmp_path):
        tracing, _ = self.tracing(tmp_path)
        sampling = SamplingParams(4)
        request = GenerateRequest("r1", Namespace("acme", "llama"), tuple(range(40)),
                                  sampling)
        planned = dataclasses.replace(decision("w1", Reason.PREFIX_MATCH, 32, 40, {"w1": 0}),
                                      pull=PullChoice("w0", 2, 32, 0.01))
        with tracing.request("acme", "r1", "", "", sampling) as trace:
            trace.done(request, (), GenerateOutcome(
                result("r1", 40, 32, 0, "w1", LookupOutcome.HIT), planned, 1, "w1"))
        body = tracing.metrics.render(ScrapeState({}, {}, {}))[0].decode()
        decisions = {(s.labels["worker"], s.labels["outcome"]): s.value
                     for f in text_string_to_metric_families(body) for s in f.samples
                     if s.name == "orchard_router_decisions_total"}
        assert decisions == {("w1", "pulled"): 1}
