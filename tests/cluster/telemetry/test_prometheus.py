"""``cluster.telemetry.prometheus``: what requests push and one scrape's state, rendered and
read back with ``prometheus_client``'s own text parser; exact values throughout."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.telemetry.prometheus import (RouteOutcome, ScrapeState, ServedRequest,
                                          ServingMetrics, TierUsage, WorkerSnapshot,
                                          default_status)
from router.cost import TokenUsage
from tests.support.paths import REPO

DASHBOARD = REPO / "infra" / "grafana" / "orchard.json"
API_DOC = REPO / "docs" / "api.md"


def samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def served(worker="w0", tenant="acme", prompt=40, cached=32, disk=16, generated=3,
           route=RouteOutcome.HIT, usage=None) -> ServedRequest:
    return ServedRequest(worker=worker, tenant=tenant, prompt_tokens=prompt,
                         cached_tokens=cached, disk_tokens=disk, generated_tokens=generated,
                         ttft_s=0.02, tpot_s=0.004, e2e_s=0.3, route=route, usage=usage)


EMPTY = ScrapeState(queue_depth={}, running={}, jobs={})


class TestRouteOutcome:
    @pytest.mark.parametrize("expected, prompt, outcome", [
        (0, 40, RouteOutcome.MISS),       # nothing believed cached
        (16, 40, RouteOutcome.PARTIAL),   # 1 of the 2 full blocks
        (32, 40, RouteOutcome.HIT),       # both full blocks
        (31, 32, RouteOutcome.HIT),       # an exact multiple: the last token is computed
        (16, 32, RouteOutcome.PARTIAL),
        (0, 0, RouteOutcome.MISS),        # an empty prompt
        (0, 10, RouteOutcome.MISS),       # shorter than a block: nothing to reuse
    ])
    def test_outcome_against_the_prompts_reusable_tokens(self, expected, prompt, outcome):
        assert RouteOutcome.of(expected, prompt, 16) is outcome

    @pytest.mark.parametrize("expected", [0, 16, 32])
    def test_a_decision_that_planned_a_pull_is_pulled_whatever_it_expected(self, expected):
        assert RouteOutcome.of(expected, 40, 16, pulled=True) is RouteOutcome.PULLED


class TestServingMetrics:
    def test_served_requests_count_tokens_by_worker_tenant_and_tier(self):
        metrics = ServingMetrics(lambda usage: 0.5)
        metrics.served(served())
        metrics.served(served(worker="w1", cached=0, disk=0, route=RouteOutcome.MISS,
                              generated=1))
        metrics.finished("acme", "DEADLINE_EXCEEDED")
        metrics.served(served(worker="w2", route=RouteOutcome.PULLED))
        metrics.served(served(worker="w2", route=RouteOutcome.PULLED))
        got = samples(metrics.render(EMPTY)[0])
        assert got[("orchard_requests_finished_total",
                    (("status", "OK"), ("tenant", "acme")))] == 4
        assert got[("orchard_requests_finished_total",
                    (("status", "DEADLINE_EXCEEDED"), ("tenant", "acme")))] == 1
        assert got[("orchard_prompt_tokens_total", (("tenant", "acme"), ("worker", "w0")))] == 40
        assert got[("orchard_cached_tokens_total",
                    (("tenant", "acme"), ("tier", "memory"), ("worker", "w0")))] == 16
        assert got[("orchard_cached_tokens_total",
                    (("tenant", "acme"), ("tier", "disk"), ("worker", "w0")))] == 16
        assert got[("orchard_cached_tokens_total",
                    (("tenant", "acme"), ("tier", "memory"), ("worker", "w1")))] == 0
        assert got[("orchard_generation_tokens_total",
                    (("tenant", "acme"), ("worker", "w1")))] == 1
        assert got[("orchard_router_decisions_total",
                    (("outcome", "hit"), ("worker", "w0")))] == 1
        assert got[("orchard_router_decisions_total",
                    (("outcome", "miss"), ("worker", "w1")))] == 1
        assert got[("orchard_router_decisions_total",
                    (("outcome", "pulled"), ("worker", "w2")))] == 2
        assert got[("orchard_time_to_first_token_seconds_count", (("worker", "w0"),))] == 1
        assert got[("orchard_time_to_first_token_seconds_bucket",
                    (("le", "0.025"), ("worker", "w0")))] == 1
        assert got[("orchard_time_to_first_token_seconds_bucket",
                    (("le", "0.01"), ("worker", "w0")))] == 0
        assert got[("orchard_e2e_request_latency_seconds_sum", (("worker", "w0"),))] == 0.3
        # one output token has no time per output token
        assert got[("orchard_time_per_output_token_seconds_count", (("worker", "w0"),))] == 1
        assert ("orchard_time_per_output_token_seconds_count", (("worker", "w1"),)) not in got

    def test_the_multiplier_prices_each_tenants_summed_usage(self):
        priced: list[TokenUsage] = []

        def multiplier(usage: TokenUsage) -> float:
            priced.append(usage)
            return usage.cached_tokens / usage.input_tokens

        metrics = ServingMetrics(multiplier)
        metrics.served(served(usage=TokenUsage(40, 32, 0)))
        metrics.served(served(usage=TokenUsage(60, 0, 48)))
        metrics.served(served(tenant="beta", usage=TokenUsage(0, 0, 0)))  # empty: no M
        got = samples(metrics.render(EMPTY)[0])
        assert got[("orchard_effective_input_multiplier", (("tenant", "acme"),))] == 0.32
        assert ("orchard_effective_input_multiplier", (("tenant", "beta"),)) not in got
        assert priced == [TokenUsage(100, 32, 48)]

    def test_scrape_state_gauges_per_tenant_job_state_and_worker(self):
        state = ScrapeState(
            queue_depth={"acme": 5, "beta": 1}, running={"acme": 2, "beta": 3},
            jobs={"queued": 1, "running": 2, "succeeded": 0, "cancelled": 4},
            workers=[WorkerSnapshot("w1", 1, TierUsage(2048, 2, 4096, 3), None, 0),
                     WorkerSnapshot("w0", 2, TierUsage(1024, 1, 4096, 0),
                                    TierUsage(8192, 8, 1 << 20, 6), 5)],
            tenants=("acme", "beta", "idle"))
        got = samples(ServingMetrics(lambda usage: 1.0).render(state)[0])
        assert got[("orchard_requests_running", (("tenant", "acme"),))] == 2
        assert got[("orchard_requests_waiting", (("tenant", "acme"),))] == 3
        assert got[("orchard_requests_waiting", (("tenant", "beta"),))] == 0  # never negative
        assert got[("orchard_queue_depth", (("tenant", "beta"),))] == 1
        assert got[("orchard_queue_depth", (("tenant", "idle"),))] == 0
        assert {labels[0][1]: v for (name, labels), v in got.items()
                if name == "orchard_jobs"} == {"queued": 1, "running": 2, "succeeded": 0,
                                               "cancelled": 4}
        assert got[("orchard_worker_requests_running", (("worker", "w0"),))] == 2
        assert got[("orchard_prefix_store_bytes", (("tier", "disk"), ("worker", "w0")))] == 8192
        assert got[("orchard_prefix_store_blocks", (("tier", "memory"), ("worker", "w1")))] == 2
        assert ("orchard_prefix_store_blocks", (("tier", "disk"), ("worker", "w1"))) not in got
        assert got[("orchard_prefix_store_capacity_bytes",
                    (("tier", "memory"), ("worker", "w1")))] == 4096
        assert got[("orchard_prefix_store_evictions_total",
                    (("tier", "memory"), ("worker", "w1")))] == 3
        assert got[("orchard_prefix_store_evictions_total",
                    (("tier", "disk"), ("worker", "w0")))] == 6
        assert got[("orchard_prefix_store_evictions_total",
                    (("tier", "memory"), ("worker", "w0")))] == 0
        assert ("orchard_prefix_store_evictions_total",
                (("tier", "disk"), ("worker", "w1"))) not in got  # no disk tier
        assert got[("orchard_prefix_store_expirations_total", (("worker", "w0"),))] == 5

    def test_refusals_count_by_tenant_and_reason(self):
        metrics = ServingMetrics(lambda usage: 1.0)
        for tenant, reason in [("acme", "shed"), ("acme", "shed"),
                               ("acme", "requests_in_flight"), ("beta", "tokens_per_minute")]:
            metrics.refused(tenant, reason)
        got = {labels: v for (name, labels), v in samples(metrics.render(EMPTY)[0]).items()
               if name == "orchard_requests_refused_total"}
        assert got == {(("reason", "shed"), ("tenant", "acme")): 2,
                       (("reason", "requests_in_flight"), ("tenant", "acme")): 1,
                       (("reason", "tokens_per_minute"), ("tenant", "beta")): 1}

    def test_two_frontends_in_one_process_keep_their_own_counts(self):
        first, second = ServingMetrics(lambda u: 1.0), ServingMetrics(lambda u: 1.0)
        first.finished("acme", "CANCELLED")
        got = samples(second.render(EMPTY)[0])
        assert ("orchard_requests_finished_total",
                (("status", "CANCELLED"), ("tenant", "acme"))) not in got

    def test_the_scrape_is_openmetrics_when_asked(self):
        body, content_type = ServingMetrics(lambda u: 1.0).render(
            EMPTY, "application/openmetrics-text; version=1.0.0")
        assert content_type.startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")
        assert ServingMetrics(lambda u: 1.0).render(EMPTY)[1].startswith("text/plain")


@pytest.mark.parametrize("exc, status", [
    (asyncio.CancelledError(), "CANCELLED"), (GeneratorExit(), "CANCELLED"),
    (TimeoutError(), "DEADLINE_EXCEEDED"), (ValueError("x"), "INVALID_ARGUMENT"),
    (RuntimeError("x"), "INTERNAL")])
def test_default_status(exc, status):
    assert default_status(exc) == status


def exported() -> dict[str, tuple[str, frozenset[str]]]:
    """Every metric a scrape can hold, as PromQL names it (a counter with ``_total``, a
    histogram by its base name): ``{name: (type, labels)}``, from a scrape with one of each."""
    metrics = ServingMetrics(lambda usage: 1.0)
    metrics.served(served(usage=TokenUsage(40, 32, 0)))
    metrics.finished("acme", "CANCELLED")
    metrics.refused("acme", "shed")
    state = ScrapeState({"acme": 1}, {"acme": 1}, {"queued": 1},
                        [WorkerSnapshot("w0", 1, TierUsage(1, 1, 2), TierUsage(1, 1, 2), 0)])
    found = {}
    for family in text_string_to_metric_families(metrics.render(state)[0].decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        found[name] = (family.type, labels)
    return found


def promql_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (a histogram's series by its base name)."""
    return {re.sub(r"_(bucket|sum|count)$", "", name)
            for name in re.findall(r"\b(orchard_\w+)", expr)}


class TestGrafanaDashboard:
    def targets(self) -> list[str]:
        dashboard = json.loads(DASHBOARD.read_text())
        return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]

    def test_every_expression_names_only_metrics_the_endpoint_exports(self):
        names = exported()
        for expr in self.targets():
            assert promql_names(expr), f"{expr!r} reads no orchard metric"
            assert promql_names(expr) <= set(names), expr

    def test_every_exported_metric_has_a_panel(self):
        shown = set().union(*(promql_names(e) for e in self.targets()))
        assert shown == set(exported())

    def test_the_check_catches_a_misspelt_name(self):
        assert promql_names("sum(rate(orchard_request_finished_total[5m]))") - set(exported()) \
            == {"orchard_request_finished_total"}
        assert promql_names("histogram_quantile(0.9, rate(orchard_e2e_request_latency_seconds_"
                            "bucket[5m]))") == {"orchard_e2e_request_latency_seconds"}


class TestDocumented:
    def documented(self) -> dict[str, tuple[str, frozenset[str]]]:
        """docs/api.md's metric table: ``| `name` | type | `label`, ... | meaning |``."""
        text = API_DOC.read_text()
        start = text.index("\n## Prometheus metrics\n")
        section = text[start:text.find("\n## ", start + 1)]
        rows = re.findall(r"^\| `(orchard_\w+)` \| (\w+) \| ([^|]*) \|", section, re.MULTILINE)
        return {name: (kind, frozenset(re.findall(r"`(\w+)`", labels)))
                for name, kind, labels in rows}

    def test_every_metric_is_documented_with_its_type_and_labels(self):
        assert self.documented() == exported()
