"""The frontend's observer: turns each finished request into cost, a miss cause, and spans.

``RequestObserver`` owns the frontend's ``MissAttributor`` and prices with one price table.
The job runner reaches it through ``cluster.telemetry.job_tracing.JobTracing``; a request goes::

    with observer.request(info) as span:                   # root span, current in the block
        request = GenerateRequest(..., trace_context=observer.context())
        outcome = await dispatch(backend, request, hashes, timeout)
        observer.routed(outcome.decision, started_ns, outcome.result.timings.received_ns)
        observer.worker_done(request, outcome.result, tokenizer.decode)
        observer.finish(span, request, hashes, outcome.result, outcome.decision, outcome.attempts)

    job_context = observer.submit_job(job_id, tenant, plans, held)   # at submission

The routing span is always drawn here (routing runs in the frontend); the worker-side spans
(lookup, prefill, decode) only when no other process drew them
(``GenerateOutcome.worker_traced``): on the in-process ``LocalBackend`` (on Ray the worker
actors draw their own).

Forecast per request: the router's ``expected_cached_tokens`` at routing time
(``router.cost.forecast_request``). Forecast per job: ``router.forecast.forecast_job`` over
the job's own chains, what the cluster holds (``router.forecast.ClusterHoldings``: a mirror
of each serving worker's store, its memory and disk tiers, fed by every finished request and
told of invalidations and of workers leaving or joining), the TTL and the serving workers'
capacity in both tiers. Measured: the engine's cached / written counts, and which tier the
cached tokens came from (``Observed.served``, on the request span as ``orchard.cache.tier``).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry.trace import Span

from cluster.telemetry import spans
from cluster.telemetry.setup import Telemetry, guarded, request_context
from router.attribution import Attribution, MissAttributor, RequestSeen, ServedTier, served_from
from router.cost import (CostComparison, PriceTable, TokenUsage, compare, forecast_request,
                         measured_usage, total_usage)
from router.forecast import (CacheModel, ClusterHoldings, PlannedRequest, batch_arrivals,
                             forecast_job)
from router.kv.key import BlockHash, reusable_tokens
from workers.messages import CacheControls, GenerateRequest, GenerateResult, LookupOutcome


@dataclass(frozen=True, slots=True)
class Observed:
    """What the observer concluded about one request (also kept with the job's result)."""

    cost: CostComparison | None
    miss: Attribution | None
    served: ServedTier = ServedTier.NONE  # the store tier(s) its cached tokens came from


@dataclass(frozen=True, slots=True)
class ServedCache:
    """The served model and the cluster's cache, as the observer models them."""

    model: str
    block_size: int
    ttl_s: float
    worker_capacity_tokens: int  # one worker's store bytes / the engine's K/V bytes per token
    workers: int = 1
    worker_disk_tokens: int = 0  # one worker's disk_bytes / its disk tier's bytes per token


class RequestObserver:
    def __init__(self, tel: Telemetry, prices: PriceTable, cache: ServedCache, *,
                 clock: Callable[[], float] = time.time, max_history_blocks: int = 1_000_000,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.tel = tel
        self.prices = prices
        self.model = cache.model
        self.block_size = cache.block_size
        self.ttl_s = cache.ttl_s
        self._clock = clock
        self.decode = decode  # token ids -> text, for the text around a near miss
        self._prefill_s = 0.05  # running mean of lookup + prefill time, for job forecasts
        self._modelled = self._realised = 0.0  # decayed sums: one-cache model vs realised reads
        self.attributor = MissAttributor(cache.block_size, cache.ttl_s, max_history_blocks)
        self._sent: dict[str, float] = {}  # request id -> when its span began (in flight)
        self.holdings = ClusterHoldings(cache.block_size, cache.worker_capacity_tokens,
                                        cache.ttl_s, clock, cache.workers,
                                        worker_disk_tokens=cache.worker_disk_tokens)

    def invalidated(self, tenant: str) -> None:
        """Every worker dropped ``tenant``'s cached blocks just now."""
        self.attributor.invalidated(tenant, self._clock())
        self.holdings.invalidated(tenant)

    def serving(self, workers: Sequence[str]) -> None:
        """The workers requests are routed to now (after a scale, drain or worker loss)."""
        self.holdings.serving(workers)

    @contextmanager
    def request(self, info: spans.RequestInfo, parent: Any = None) -> Iterator[Span]:
        self._sent[info.request_id] = self._clock()
        try:
            with spans.request_span(self.tel, info, parent) as span:
                yield span
        finally:
            self._sent.pop(info.request_id, None)

    def context(self) -> tuple[tuple[str, str], ...]:
        """The current span's context, for ``GenerateRequest.trace_context``."""
        return request_context()

    def routed(self, decision: Any, start_ns: int, end_ns: int | None = None) -> None:
        """The routing span, a child of the current request span."""
        spans.record_routing(self.tel, decision, start_ns, end_ns)

    def worker_done(self, request: GenerateRequest, result: GenerateResult,
                    decode: Callable[[Sequence[int]], str] | None = None) -> None:
        """The worker's spans from the engine's timings, under the request's context."""
        spans.record_engine(self.tel, request, result, decode)

    def finish(self, span: Span, request: GenerateRequest, block_hashes: Sequence[BlockHash],
               result: GenerateResult, decision: Any, attempts: int = 1,
               pulled: spans.PulledPrefix | None = None) -> Observed:
        """Attribute, price and record one finished request; never raises. ``pulled``: its
        prefix was pulled from a peer before it ran."""
        if pulled is not None:   # of what it pulled, what it then read
            pulled = dataclasses.replace(pulled, tokens=min(pulled.tokens, result.cached_tokens))
        observed = self._conclude(request, block_hashes, result, decision,
                                  pulled) or Observed(None, None)
        spans.record_outcome(self.tel, span, spans.OutcomeRecord(
            result=result, block_size=self.block_size, block_hashes=block_hashes,
            cost=observed.cost, miss=observed.miss, attempts=attempts, model=self.model,
            pulled=pulled, cache=request.cache, salted=bool(request.namespace.salt)))
        return observed

    def prefill_s(self) -> float:
        """The recent mean time from a request's lookup to its first token."""
        return self._prefill_s

    def now(self) -> float:
        return self._clock()

    def realisation(self) -> float:
        """The share of the one-cache model's reuse that routing realised recently (1.0
        before any reuse was modelled): ``router.forecast.forecast_job``'s ``realisation``."""
        return min(1.0, self._realised / self._modelled) if self._modelled > 0 else 1.0

    @guarded()
    def _conclude(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                  result: GenerateResult, decision: Any,
                  pulled: spans.PulledPrefix | None = None) -> Observed:
        matches = {c.worker_id: c.matched_tokens for c in decision.candidates} if decision else {}
        seen = RequestSeen(
            namespace=request.namespace, prompt=request.prompt, worker=result.worker_id,
            cached_tokens=result.cached_tokens, written_tokens=result.written_tokens,
            candidate_matches=matches, block_hashes=block_hashes,
            engine_near_miss=result.lookup.outcome is LookupOutcome.NEAR_MISS,
            sent=self._sent.get(request.request_id), disk_tokens=result.lookup.disk_tokens,
            pulled_tokens=pulled.tokens if pulled else 0,
            pulled_from=pulled.peer if pulled else "")
        now = self._clock()
        # What the one-cache model would have read when the request was sent: blocks its
        # concurrent siblings stored later were not there to read, and do not count against
        # routing's realisation.
        modelled = reusable_tokens(result.input_tokens,
                                   len(self.holdings.held(block_hashes, seen.sent)),
                                   self.block_size)
        self._modelled = 0.99 * self._modelled + modelled
        self._realised = 0.99 * self._realised + min(result.cached_tokens, modelled)
        miss = self.attributor.observe(seen, now)
        # the blocks the store matched (a kept cache's tail is not a block of the store)
        kept = (-(-result.lookup.matched_tokens // self.block_size)
                + result.written_tokens // self.block_size)
        self.holdings.stored(result.worker_id, request.namespace, block_hashes, kept)
        took_s = (result.timings.first_token_ns - result.timings.lookup_start_ns) / 1e9
        self._prefill_s = 0.9 * self._prefill_s + 0.1 * max(took_s, 0.0)
        served = served_from(result.cached_tokens, result.lookup.disk_tokens)
        if result.input_tokens == 0:
            return Observed(None, miss, served)
        expected = decision.expected_cached_tokens if decision else 0
        expected = min(expected, max(0, result.input_tokens - 1))
        controls = request.cache  # what the request let the store read and write
        expected = expected if controls.read else 0
        forecast = forecast_request(result.input_tokens, expected, self.block_size,
                                    request.sampling.max_tokens,
                                    controls.writable(result.input_tokens
                                                      + request.sampling.max_tokens))
        measured = measured_usage(result.input_tokens, result.cached_tokens,
                                  result.written_tokens, self.block_size)
        ttl_s = self.ttl_s if controls.ttl_s is None else controls.ttl_s
        cost = compare(forecast, measured, self.prices, self.model, ttl_s)
        return Observed(cost, miss, served)

    def plan_job(self, chains: Sequence[Sequence[BlockHash]], input_tokens: Sequence[int],
                 output_tokens: Sequence[int], concurrency: int, request_s: float,
                 caches: Sequence[CacheControls] | None = None
                 ) -> tuple[list[PlannedRequest], dict[BlockHash, float]]:
        """A batch job's plan (run ``concurrency`` at a time, ``request_s`` each; ``caches``:
        each request's cache controls) and what the cluster holds of its chains now, by the
        observer's history of block use."""
        arrivals = batch_arrivals(len(chains), concurrency, request_s)
        controls = caches or [CacheControls()] * len(chains)
        plans = [PlannedRequest(tuple(c), n, t, request_s, out, read=k.read,
                                write_limit=None if k.keeps else k.writable(n), ttl_s=k.ttl_s)
                 for c, n, out, t, k in zip(chains, input_tokens, output_tokens, arrivals,
                                            controls)]
        held: dict[BlockHash, float] = {}
        for chain in chains:
            held.update(self.holdings.held(chain))
        return plans, held

    def forecast_job(self, plans: Sequence[PlannedRequest],
                     held: Mapping[BlockHash, float]) -> list[TokenUsage]:
        model = CacheModel(self.block_size, self.holdings.capacity_tokens(), self.ttl_s)
        return forecast_job(plans, held, model, self.realisation())

    @guarded(default=())
    def submit_job(self, job_id: str, tenant: str, plans: Sequence[PlannedRequest],
                   held: Mapping[BlockHash, float]) -> tuple[tuple[str, str], ...]:
        """Forecast the job, record its span; returns the span's context to store with it."""
        usages = self.forecast_job(plans, held)
        usage, rates = total_usage(usages), self.prices.rates(self.model)
        # each request's writes at its own TTL's rate
        cost = sum(u.cost(rates, self.ttl_s if p.ttl_s is None else p.ttl_s)
                   for u, p in zip(usages, plans))
        m = cost / usage.input_tokens if usage.input_tokens else None
        return spans.record_job(self.tel, spans.JobInfo(
            job_id, tenant, self.model, len(plans), self.prices.version, usage, m))
