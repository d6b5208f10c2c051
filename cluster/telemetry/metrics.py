"""orchard's OpenTelemetry metrics: the instruments, and what feeds them.

Pushed by whoever sees the event (``record_request`` after a request finishes)::

    orchard.cache.requests        counter    {worker, tenant, outcome}
    orchard.cache.input_tokens    counter    {worker, tenant}   cached tokens included
    orchard.cache.cached_tokens   counter    {worker, tenant}
    orchard.cache.written_tokens  counter    {worker, tenant}
    gen_ai.server.time_to_first_token   histogram (s) {worker, tenant}
    gen_ai.server.time_per_output_token histogram (s) {worker, tenant}
    gen_ai.client.token.usage     histogram  {gen_ai.token.type, gen_ai.operation.name,
                                              gen_ai.provider.name, gen_ai.request.model,
                                              gen_ai.response.model}   (GenAI conventions)

Observed at each export from callbacks the owners register (``watch_store``, ``watch_queue``)::

    orchard.cache.hit_ratio       gauge      {worker, tenant}   cached / input so far
    orchard.store.bytes           gauge      {worker}
    orchard.store.evictions       counter    {worker}   cumulative, from the store's stats
    orchard.store.expirations     counter    {worker}
    orchard.queue.depth           gauge      {tenant}   requests accepted, not finished

With no meter (telemetry disabled) every call is a no-op.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from cluster.telemetry import attrs as A

# Seconds, for TTFT, TPOT and request latency; also the Prometheus histograms'
# (cluster.telemetry.prometheus). Up to 300 s: a long batch request's end-to-end time.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
# The GenAI conventions' advised boundaries for gen_ai.client.token.usage.
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                  16777216, 67108864)


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """One finished request, as the metrics count it."""

    worker: str
    tenant: str
    outcome: str          # the cache lookup's outcome
    operation: str        # gen_ai.operation.name: "chat" or "text_completion"
    model: str            # the served model's own name
    input_tokens: int     # cached ones included
    cached_tokens: int
    written_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class StoreGauges:
    """What a worker's store reports at each metric export."""

    bytes: int
    evictions: int     # cumulative
    expirations: int   # cumulative


class Instruments:
    def __init__(self, meter: Meter | None) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, str], list[int]] = {}   # (worker, tenant) -> [input, cached]
        self._stores: dict[str, Callable[[], StoreGauges]] = {}
        self._queues: list[Callable[[], Mapping[str, int]]] = []
        self._queue_tenants: set[str] = set()
        self._meter = meter
        if meter is None:
            return
        self._requests = meter.create_counter("orchard.cache.requests", "{request}",
                                              "Requests by cache lookup outcome")
        self._input = meter.create_counter("orchard.cache.input_tokens", "{token}",
                                           "Input tokens, cached ones included")
        self._cached = meter.create_counter("orchard.cache.cached_tokens", "{token}",
                                            "Input tokens read from the prefix store")
        self._written = meter.create_counter("orchard.cache.written_tokens", "{token}",
                                             "Input tokens newly stored in the prefix store")
        self._ttft = meter.create_histogram(
            A.GEN_AI_TTFT_METRIC, "s", "Time to first token",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self._tpot = meter.create_histogram(
            A.GEN_AI_TPOT_METRIC, "s", "Time per output token after the first",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS)
        self._token_usage = meter.create_histogram(
            A.GEN_AI_TOKEN_USAGE_METRIC, "{token}", "Input and output tokens per request",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)
        meter.create_observable_gauge("orchard.cache.hit_ratio", [self._observe_hit_ratio],
                                      "1", "Cached over input tokens so far")
        meter.create_observable_gauge("orchard.store.bytes", [self._observe_store("bytes")],
                                      "By", "Bytes held by the prefix store")
        meter.create_observable_counter("orchard.store.evictions",
                                        [self._observe_store("evictions")], "{block}",
                                        "Blocks evicted from the prefix store")
        meter.create_observable_counter("orchard.store.expirations",
                                        [self._observe_store("expirations")], "{block}",
                                        "Blocks expired from the prefix store (TTL)")
        meter.create_observable_gauge("orchard.queue.depth", [self._observe_queues],
                                      "{request}", "Requests accepted and not finished")

    def record_request(self, u: RequestUsage) -> None:
        if self._meter is None:
            return
        attrs = {"worker": u.worker, "tenant": u.tenant}
        self._requests.add(1, {**attrs, "outcome": u.outcome})
        self._input.add(u.input_tokens, attrs)
        self._cached.add(u.cached_tokens, attrs)
        self._written.add(u.written_tokens, attrs)
        self._ttft.record(u.ttft_s, attrs)
        if u.tpot_s > 0:
            self._tpot.record(u.tpot_s, attrs)
        gen_ai = {A.GEN_AI_OPERATION: u.operation, A.GEN_AI_SYSTEM: A.PROVIDER,
                  A.GEN_AI_REQUEST_MODEL: u.model, A.GEN_AI_RESPONSE_MODEL: u.model}
        self._token_usage.record(u.input_tokens, {**gen_ai, A.GEN_AI_TOKEN_TYPE: "input"})
        self._token_usage.record(u.output_tokens, {**gen_ai, A.GEN_AI_TOKEN_TYPE: "output"})
        with self._lock:
            sums = self._tokens.setdefault((u.worker, u.tenant), [0, 0])
            sums[0] += u.input_tokens
            sums[1] += u.cached_tokens

    def watch_store(self, worker: str, gauges: Callable[[], StoreGauges]) -> None:
        """Observe ``worker``'s store at each export (replaces an earlier callback)."""
        with self._lock:
            self._stores[worker] = gauges

    def watch_queue(self, depths: Callable[[], Mapping[str, int]]) -> None:
        """Observe queue depth per tenant at each export."""
        with self._lock:
            self._queues.append(depths)

    def _observe_hit_ratio(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            items = list(self._tokens.items())
        return [Observation(cached / total, {"worker": w, "tenant": t})
                for (w, t), (total, cached) in items if total]

    def _observe_store(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                stores = list(self._stores.items())
            return [Observation(getattr(gauges(), field), {"worker": worker})
                    for worker, gauges in stores]
        return observe

    def _observe_queues(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sources = list(self._queues)
        depths: dict[str, int] = {}
        for source in sources:
            for tenant, depth in source().items():
                depths[tenant] = depths.get(tenant, 0) + depth
        with self._lock:  # a tenant whose queue emptied reads 0, not nothing
            self._queue_tenants.update(depths)
            tenants = sorted(self._queue_tenants)
        return [Observation(depths.get(t, 0), {"tenant": t}) for t in tenants]
