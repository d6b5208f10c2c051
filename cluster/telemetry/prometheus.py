"""orchard's Prometheus metrics: the frontend's one registry, served at ``GET /metrics``.

Two kinds, told apart by who knows the figure:

Pushed when a request ends (``JobTracing`` calls ``served`` or ``finished``)::

    orchard_requests_finished_total        counter   {tenant, status}   OK or the gRPC code
    orchard_requests_refused_total         counter   {tenant, reason}   refused at admission
    orchard_time_to_first_token_seconds    histogram {worker}
    orchard_time_per_output_token_seconds  histogram {worker}   requests of 2+ output tokens
    orchard_e2e_request_latency_seconds    histogram {worker}   the frontend's own clock
    orchard_prompt_tokens_total            counter   {worker, tenant}   cached ones included
    orchard_cached_tokens_total            counter   {worker, tenant, tier}   memory | disk
    orchard_generation_tokens_total        counter   {worker, tenant}
    orchard_router_decisions_total         counter   {worker, outcome}   hit | partial | miss
                                                                         | pulled
    orchard_effective_input_multiplier     gauge     {tenant}   M of its finished requests

Read at each scrape from a ``ScrapeState`` the frontend gathers on its loop just before
(the runner's counts, the job store, ``backend.workers()``)::

    orchard_requests_running               gauge     {tenant}   in one of the runner's slots
    orchard_requests_waiting               gauge     {tenant}   accepted, waiting for a slot
    orchard_queue_depth                    gauge     {tenant}   accepted, not finished
    orchard_jobs                           gauge     {state}    jobs the store holds
    orchard_worker_requests_running        gauge     {worker}
    orchard_prefix_store_bytes             gauge     {worker, tier}
    orchard_prefix_store_capacity_bytes    gauge     {worker, tier}
    orchard_prefix_store_blocks            gauge     {worker, tier}
    orchard_prefix_store_evictions_total   counter   {worker, tier}   since it started
    orchard_prefix_store_expirations_total counter   {worker}   memory tier (TTL)

A router decision's outcome is the router's belief at routing time, against the prompt's
reusable tokens (``router.kv.key.reusable_tokens`` of its full blocks): ``hit`` expected
all of them cached, ``miss`` none, ``partial`` some; ``pulled`` is a decision that planned a
pull (``router.pull_cost``: the chosen worker fetches the prefix from a peer first), whatever
the chosen worker was believed to hold. A refusal's reason is the one the OpenTelemetry
``orchard.requests.refused`` counts (``cluster.telemetry.metrics``). The registry is the frontend's own (not
the library's global one), so two frontends in one process never share a counter.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from cluster.telemetry.metrics import LATENCY_BUCKETS
from router.cost import TokenUsage
from router.kv.key import reusable_tokens

# No ``*_created`` series beside each counter and histogram (a series per label set that
# dashboards never read; vLLM turns them off too). The library's switch is process-wide.
disable_created_metrics()

TIERS = ("memory", "disk")


class RouteOutcome(str, Enum):
    HIT = "hit"
    PARTIAL = "partial"
    MISS = "miss"
    PULLED = "pulled"

    @classmethod
    def of(cls, expected_cached_tokens: int, prompt_tokens: int, block_size: int,
           pulled: bool = False) -> RouteOutcome:
        """What the router expected of a prompt: all its reusable tokens, some, or none;
        ``PULLED`` when the decision planned a pull from a peer."""
        if pulled:
            return cls.PULLED
        reusable = reusable_tokens(prompt_tokens, prompt_tokens // block_size, block_size)
        if expected_cached_tokens <= 0:
            return cls.MISS
        return cls.HIT if expected_cached_tokens >= reusable else cls.PARTIAL


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """One request that ended with a result, as the metrics count it."""

    worker: str
    tenant: str
    prompt_tokens: int        # cached ones included
    cached_tokens: int        # read from the store, both tiers
    disk_tokens: int          # of those, read from the disk tier
    generated_tokens: int
    ttft_s: float
    tpot_s: float             # 0.0 for a single output token: not observed
    e2e_s: float
    route: RouteOutcome | None  # None: no routing decision (a single worker, say)
    usage: TokenUsage | None    # the priced usage; None for an empty prompt


@dataclass(frozen=True, slots=True)
class TierUsage:
    bytes: int
    blocks: int
    capacity_bytes: int
    evictions: int = 0        # blocks the tier evicted for capacity, cumulative


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker at scrape time (``cluster.backend.protocol.WorkerInfo``, narrowed)."""

    worker: str
    running: int
    memory: TierUsage
    disk: TierUsage | None    # None: the worker has no disk tier
    expirations: int          # the memory tier's, cumulative


@dataclass(frozen=True, slots=True)
class ScrapeState:
    """What the frontend's owners report at one scrape."""

    queue_depth: Mapping[str, int]   # tenant -> accepted, not finished
    running: Mapping[str, int]       # tenant -> in a slot now
    jobs: Mapping[str, int]          # job state -> jobs
    workers: Sequence[WorkerSnapshot] = ()
    tenants: Sequence[str] = field(default_factory=tuple)  # every tenant reads 0 at least


def default_status(exc: BaseException) -> str:
    """A request's status from what ended it, when no edge gives a better mapping."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED"
    return "INVALID_ARGUMENT" if isinstance(exc, ValueError) else "INTERNAL"


class ServingMetrics:
    """The counters and histograms requests push, and the rendering of one scrape.

    ``multiplier`` prices a tenant's summed usage (``router.cost.TokenUsage.multiplier`` at
    the served model's rates and TTL); ``status_of`` names the status an exception ends a
    request with (the edge's gRPC mapping).
    """

    def __init__(self, multiplier: Callable[[TokenUsage], float],
                 status_of: Callable[[BaseException], str] = default_status) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._multiplier = multiplier
        self.status_of = status_of
        self._lock = threading.Lock()
        self._usage: dict[str, TokenUsage] = {}
        r = self.registry
        self._finished = Counter("orchard_requests_finished", "Requests that ended, by status",
                                 ["tenant", "status"], registry=r)
        self._ttft = Histogram("orchard_time_to_first_token_seconds",
                               "Request received by the worker to its first output token",
                               ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram("orchard_time_per_output_token_seconds",
                               "Mean time per output token after the first",
                               ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("orchard_e2e_request_latency_seconds",
                              "Request start in the frontend to its result",
                              ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self._prompt = Counter("orchard_prompt_tokens", "Prompt tokens, cached ones included",
                               ["worker", "tenant"], registry=r)
        self._cached = Counter("orchard_cached_tokens", "Prompt tokens read from the prefix "
                               "store, by tier", ["worker", "tenant", "tier"], registry=r)
        self._generated = Counter("orchard_generation_tokens", "Output tokens generated",
                                  ["worker", "tenant"], registry=r)
        self._refused = Counter("orchard_requests_refused", "Requests refused at admission, "
                                "by reason", ["tenant", "reason"], registry=r)
        self._routes = Counter("orchard_router_decisions", "Routing decisions of served "
                               "requests, by what the router expected cached",
                               ["worker", "outcome"], registry=r)

    def served(self, s: ServedRequest) -> None:
        """A request ended with a result (status OK)."""
        self._finished.labels(s.tenant, "OK").inc()
        self._ttft.labels(s.worker).observe(s.ttft_s)
        if s.generated_tokens > 1:
            self._tpot.labels(s.worker).observe(s.tpot_s)
        self._e2e.labels(s.worker).observe(s.e2e_s)
        self._prompt.labels(s.worker, s.tenant).inc(s.prompt_tokens)
        self._cached.labels(s.worker, s.tenant, "memory").inc(s.cached_tokens - s.disk_tokens)
        self._cached.labels(s.worker, s.tenant, "disk").inc(s.disk_tokens)
        self._generated.labels(s.worker, s.tenant).inc(s.generated_tokens)
        if s.route is not None:
            self._routes.labels(s.worker, s.route.value).inc()
        if s.usage is not None and s.usage.input_tokens:
            with self._lock:
                self._usage[s.tenant] = self._usage.get(s.tenant, TokenUsage(0, 0, 0)) + s.usage

    def finished(self, tenant: str, status: str) -> None:
        """A request ended without a result (``status``: its gRPC code's name)."""
        self._finished.labels(tenant, status).inc()

    def refused(self, tenant: str, reason: str) -> None:
        """A request of ``tenant`` refused at admission for ``reason`` (``shed``,
        ``requests_in_flight``, ``tokens_per_minute``, ``pending``)."""
        self._refused.labels(tenant, reason).inc()

    def render(self, state: ScrapeState, accept: str | None = None) -> tuple[bytes, str]:
        """One scrape: the body and its content type (negotiated from ``accept``)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(_Scrape(self.registry, self._families(state))), content_type

    def _families(self, state: ScrapeState) -> list[Metric]:
        tenants = sorted({*state.tenants, *state.queue_depth, *state.running})
        running = _gauge("orchard_requests_running", "Requests in one of the runner's slots",
                         ["tenant"])
        waiting = _gauge("orchard_requests_waiting", "Requests accepted, waiting for a slot",
                         ["tenant"])
        depth = _gauge("orchard_queue_depth", "Requests accepted and not finished", ["tenant"])
        for tenant in tenants:
            held, queued = state.running.get(tenant, 0), state.queue_depth.get(tenant, 0)
            running.add_metric([tenant], held)
            waiting.add_metric([tenant], max(0, queued - held))
            depth.add_metric([tenant], queued)
        jobs = _gauge("orchard_jobs", "Jobs the job store holds, by state", ["state"])
        for job_state, count in sorted(state.jobs.items()):
            jobs.add_metric([job_state], count)
        multiplier = _gauge("orchard_effective_input_multiplier", "Effective input multiplier "
                            "M of the tenant's finished requests (input cost over uncached "
                            "cost)", ["tenant"])
        with self._lock:
            usage = sorted(self._usage.items())
        for tenant, total in usage:
            multiplier.add_metric([tenant], self._multiplier(total))
        return [running, waiting, depth, jobs, multiplier, *_worker_families(state.workers)]


def _gauge(name: str, documentation: str, labels: Sequence[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


def _worker_families(workers: Sequence[WorkerSnapshot]) -> list[Metric]:
    running = _gauge("orchard_worker_requests_running", "Requests in flight on the worker",
                     ["worker"])
    used = _gauge("orchard_prefix_store_bytes", "Bytes the prefix store holds, by tier",
                  ["worker", "tier"])
    capacity = _gauge("orchard_prefix_store_capacity_bytes", "The prefix store's capacity, "
                      "by tier", ["worker", "tier"])
    blocks = _gauge("orchard_prefix_store_blocks", "Blocks the prefix store holds, by tier",
                    ["worker", "tier"])
    evictions = CounterMetricFamily("orchard_prefix_store_evictions", "Blocks a tier evicted "
                                    "for capacity", labels=["worker", "tier"])
    expirations = CounterMetricFamily("orchard_prefix_store_expirations", "Blocks dropped "
                                      "from the memory tier after their TTL", labels=["worker"])
    for w in sorted(workers, key=lambda w: w.worker):
        running.add_metric([w.worker], w.running)
        for tier, usage in zip(TIERS, (w.memory, w.disk)):
            if usage is None:
                continue
            used.add_metric([w.worker, tier], usage.bytes)
            capacity.add_metric([w.worker, tier], usage.capacity_bytes)
            blocks.add_metric([w.worker, tier], usage.blocks)
            evictions.add_metric([w.worker, tier], usage.evictions)
        expirations.add_metric([w.worker], w.expirations)
    return [running, used, capacity, blocks, evictions, expirations]


class _Scrape:
    """The registry's metrics and one scrape's families, as one collector to encode."""

    def __init__(self, registry: CollectorRegistry, families: Iterable[Metric]) -> None:
        self._registry = registry
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        yield from self._families
