"""The frontend's observer: turns each finished request into cost, a miss cause, and spans.

``RequestObserver`` owns the frontend's ``MissAttributor`` and prices with one price table;
the job runner calls it once per request and once per job::

    with observer.request(info) as span:                   # root span, current in the block
        request = GenerateRequest(..., trace_context=observer.context())
        outcome = await dispatch(backend, request, hashes, timeout)
        observer.routed(outcome.decision, started_ns, outcome.result.timings.received_ns)
        observer.worker_done(request, outcome.result, tokenizer.decode)
        observer.finish(span, request, hashes, outcome.result, outcome.decision, outcome.attempts)

    job_context = observer.submit_job(job_id, tenant, model, plans, held)   # at submission

Forecast per request: the router's ``expected_cached_tokens`` at routing time
(``router.cost.forecast_request``). Forecast per job: ``router.forecast.forecast_job`` over
the job's own chains, what the cluster holds (blocks the router's index matched), the TTL
and the cluster's capacity. Measured: the engine's cached / written counts.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry.trace import Span

from cluster import spans
from cluster.telemetry_metrics import StoreGauges
from cluster.telemetry import (Telemetry, extract_metadata, guarded, request_context,
                               settings_from_config, setup_telemetry)
from router.attribution import Attribution, MissAttributor, RequestSeen
from router.cost import (CostComparison, PriceTable, load_price_table, TokenUsage, compare, forecast_request,
                         measured_usage, total_usage)
from router.forecast import CacheModel, PlannedRequest, batch_arrivals, forecast_job
from router.key import BlockHash, hash_blocks, reusable_tokens
from workers.messages import GenerateRequest, GenerateResult, LookupOutcome

log = logging.getLogger("orchard.telemetry")


@dataclass(frozen=True, slots=True)
class Observed:
    """What the observer concluded about one request (also kept with the job's result)."""

    cost: CostComparison | None
    miss: Attribution | None


class RequestObserver:
    def __init__(self, tel: Telemetry, prices: PriceTable, model: str, block_size: int,
                 ttl_s: float, capacity_tokens: int, clock: Callable[[], float] = time.time,
                 max_history_blocks: int = 1_000_000,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.tel = tel
        self.prices = prices
        self.model = model
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.capacity_tokens = capacity_tokens
        self._clock = clock
        self.decode = decode  # token ids -> text, for the text around a near miss
        self._prefill_s = 0.05  # running mean of lookup + prefill time, for job forecasts
        self._modelled = self._realised = 0.0  # decayed sums: one-cache model vs realised reads
        self.attributor = MissAttributor(block_size, ttl_s, max_history_blocks)

    @contextmanager
    def request(self, info: spans.RequestInfo, parent: Any = None) -> Iterator[Span]:
        with spans.request_span(self.tel, info, parent) as span:
            yield span

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
               result: GenerateResult, decision: Any, attempts: int = 1) -> Observed:
        """Attribute, price and record one finished request; never raises."""
        observed = self._conclude(request, block_hashes, result, decision) or Observed(None, None)
        spans.record_outcome(self.tel, span, spans.OutcomeRecord(
            result=result, block_size=self.block_size, block_hashes=block_hashes,
            cost=observed.cost, miss=observed.miss, attempts=attempts))
        return observed

    def prefill_s(self) -> float:
        """The recent mean time from a request's lookup to its first token."""
        return self._prefill_s

    def realisation(self) -> float:
        """The share of the one-cache model's reuse that routing realised recently (1.0
        before any reuse was modelled): ``router.forecast.forecast_job``'s ``realisation``."""
        return min(1.0, self._realised / self._modelled) if self._modelled > 0 else 1.0

    @guarded()
    def _conclude(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                  result: GenerateResult, decision: Any) -> Observed:
        matches = {c.worker_id: c.matched_tokens for c in decision.candidates} if decision else {}
        seen = RequestSeen(
            namespace=request.namespace, prompt=request.prompt, worker=result.worker_id,
            cached_tokens=result.cached_tokens, written_tokens=result.written_tokens,
            candidate_matches=matches, block_hashes=block_hashes,
            engine_near_miss=result.lookup.outcome is LookupOutcome.NEAR_MISS)
        now = self._clock()
        # What the one-cache model would have read, before this request joins the history.
        modelled = reusable_tokens(result.input_tokens,
                                   len(self.attributor.held(block_hashes, now)), self.block_size)
        self._modelled = 0.99 * self._modelled + modelled
        self._realised = 0.99 * self._realised + min(result.cached_tokens, modelled)
        miss = self.attributor.observe(seen, now)
        took_s = (result.timings.first_token_ns - result.timings.lookup_start_ns) / 1e9
        self._prefill_s = 0.9 * self._prefill_s + 0.1 * max(took_s, 0.0)
        if result.input_tokens == 0:
            return Observed(None, miss)
        expected = decision.expected_cached_tokens if decision else 0
        expected = min(expected, max(0, result.input_tokens - 1))
        forecast = forecast_request(result.input_tokens, expected, self.block_size,
                                    request.sampling.max_tokens)
        measured = measured_usage(result.input_tokens, result.cached_tokens,
                                  result.written_tokens, self.block_size)
        cost = compare(forecast, measured, self.prices, self.model, self.ttl_s)
        return Observed(cost, miss)

    def plan_job(self, chains: Sequence[Sequence[BlockHash]], input_tokens: Sequence[int],
                 output_tokens: Sequence[int], concurrency: int,
                 request_s: float) -> tuple[list[PlannedRequest], dict[BlockHash, float]]:
        """A batch job's plan (run ``concurrency`` at a time, ``request_s`` each) and what the
        cluster holds of its chains now, by the observer's history of block use."""
        arrivals = batch_arrivals(len(chains), concurrency, request_s)
        plans = [PlannedRequest(tuple(c), n, t, request_s, out)
                 for c, n, out, t in zip(chains, input_tokens, output_tokens, arrivals)]
        now = self._clock()
        held: dict[BlockHash, float] = {}
        for chain in chains:
            held.update(self.attributor.held(chain, now))
        return plans, held

    def forecast_job(self, plans: Sequence[PlannedRequest],
                     held: Mapping[BlockHash, float]) -> list[TokenUsage]:
        model = CacheModel(self.block_size, self.capacity_tokens, self.ttl_s)
        return forecast_job(plans, held, model, self.realisation())

    @guarded(default=())
    def submit_job(self, job_id: str, tenant: str, plans: Sequence[PlannedRequest],
                   held: Mapping[BlockHash, float]) -> tuple[tuple[str, str], ...]:
        """Forecast the job, record its span; returns the span's context to store with it."""
        usage = total_usage(self.forecast_job(plans, held))
        rates = self.prices.rates(self.model)
        m = usage.multiplier(rates, self.ttl_s) if usage.input_tokens else None
        return spans.record_job(self.tel, spans.JobInfo(
            job_id, tenant, self.model, len(plans), self.prices.version, usage, m))


class RequestTrace:
    """One request's tracing as the job runner holds it (see ``JobTracing.request``)."""

    def __init__(self, observer: RequestObserver | None, span: Span | None,
                 context: tuple[tuple[str, str], ...]) -> None:
        self._observer = observer
        self._span = span
        self.context = context
        self.started_ns = time.time_ns()

    def failed(self, code: str, message: str) -> None:
        """The request ended without a result: mark its span as an error."""
        if self._span is not None:
            spans.record_failure(self._span, code, message)

    def done(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
             outcome: Any) -> Observed | None:
        """Record a finished ``cluster.backend.GenerateOutcome``; never raises."""
        if self._observer is None or self._span is None:
            return None
        result = outcome.result
        self._observer.routed(outcome.decision, self.started_ns, result.timings.received_ns)
        self._observer.worker_done(request, result, self._observer.decode)
        return self._observer.finish(self._span, request, block_hashes, result,
                                     outcome.decision, outcome.attempts)


def with_cost(result: Any, observed: Observed | None) -> Any:
    """``result`` (a ``cluster.jobstore.StoredResult``) with the observed forecast and
    measured M and miss cause, for the job record."""
    if observed is None:
        return result
    cost, miss = observed.cost, observed.miss
    return dataclasses.replace(
        result, forecast_multiplier=cost.forecast_multiplier if cost else None,
        measured_multiplier=cost.measured_multiplier if cost else None,
        miss_cause=miss.cause.value if miss else "")


def conversation_of(custom_id: str) -> tuple[str, int]:
    """A batch request's conversation and turn from its ``custom_id``, when it says so:
    ``NAME-turn-3``, ``NAME-turn3``, ``NAME-t3`` or ``NAME:3``; else ``("", 0)``."""
    match = re.fullmatch(r"(.+?)(?:[-_:]turn[-_]?|[-_]t|:)(\d+)", custom_id)
    return (match.group(1), int(match.group(2))) if match else ("", 0)


class JobTracing:
    """What ``cluster.runner.JobRunner`` calls: a no-op when built without an observer."""

    def __init__(self, observer: RequestObserver | None = None) -> None:
        self.observer = observer
        self._job_context: dict[str, tuple[tuple[str, str], ...]] = {}
        self._poller: asyncio.Task | None = None
        self._backend: Any = None
        self._stores: dict[str, StoreGauges] = {}

    @contextmanager
    def request(self, tenant: str, request_id: str, job_id: str, custom_id: str,
                sampling: Any, metadata: Sequence[tuple[str, Any]] | None = None
                ) -> Iterator[RequestTrace]:
        """Around one request's run: its root span (a child of the caller's context when
        gRPC ``metadata`` carries one, else the root of a new trace linked to its job)."""
        if self.observer is None:
            yield RequestTrace(None, None, ())
            return
        conversation, turn = conversation_of(custom_id)
        info = spans.RequestInfo(
            request_id, tenant, self.observer.model, job_id, conversation, turn,
            "text_completion", sampling.max_tokens, sampling.temperature,
            self._job_context.get(job_id, ()))
        with self.observer.request(info, extract_metadata(metadata)) as span:
            yield RequestTrace(self.observer, span, self.observer.context())

    def watch(self, backend: Any, queue_depths: Callable[[], Mapping[str, int]],
              interval_s: float = 5.0) -> None:
        """Feed the store and queue gauges: poll ``backend.workers()`` every ``interval_s``
        on the running event loop (metric callbacks run on the exporter's thread and read
        the last snapshot); ``queue_depths`` gives the pending requests per tenant."""
        if self.observer is None:
            return
        self.observer.tel.instruments.watch_queue(queue_depths)
        self._backend = backend

        async def poll() -> None:
            while True:
                await self._poll_workers()
                await asyncio.sleep(interval_s)

        self._poller = asyncio.get_running_loop().create_task(poll(), name="store-metrics")

    async def _poll_workers(self) -> None:
        try:
            infos = await self._backend.workers()
        except Exception:  # one failed poll must not stop the metrics
            log.exception("polling the workers for store metrics failed")
            return
        instruments = self.observer.tel.instruments
        for info in infos:
            if info.worker_id not in self._stores:
                instruments.watch_store(info.worker_id,
                                        functools.partial(self._stores.get, info.worker_id))
            self._stores[info.worker_id] = StoreGauges(info.cache_bytes, info.evictions,
                                                       info.expirations)

    async def aclose(self) -> None:
        """Take a last store snapshot, then flush and stop telemetry."""
        if self._poller is not None:
            self._poller.cancel()
            await self._poll_workers()
        if self.observer is not None:
            self.observer.tel.shutdown()

    @guarded()
    def job_launched(self, job_id: str, tenant: str, namespace: Any,
                     pending: Sequence[Any]) -> None:
        """Forecast a job about to run (its pending requests) and record its span.

        A worker admits one request at a time (lookup, prefill, store its blocks, then the
        next), and the router sends a prefix's requests to the worker that holds or was just
        sent it, so the job is modelled in admission order: each request sees the blocks of
        those before it once their prefill is done.
        """
        if self.observer is None or not pending:
            return
        obs = self.observer
        chains = [hash_blocks(p.prompt, obs.block_size, namespace) for p in pending]
        plans, held = obs.plan_job(chains, [len(p.prompt) for p in pending],
                                   [p.sampling.max_tokens for p in pending], 1, obs.prefill_s())
        self._job_context[job_id] = obs.submit_job(job_id, tenant, plans, held)


def kv_bytes_per_token(model_dir: str | Path) -> int:
    """K/V bytes one token takes in the store: 2 x layers x kv_heads x head_dim x 4 (float32)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads", heads))
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * 4


def frontend_tracing(config: Any, model: Any, workers: int,
                     decode: Callable[[Sequence[int]], str] | None) -> JobTracing:
    """The frontend's ``JobTracing`` from ``cluster.config.Config`` and the served
    ``cluster.backend.ModelInfo``; telemetry ``exporter = "none"`` still attributes and prices."""
    tel = setup_telemetry(settings_from_config(config, "orchard-frontend"))
    prices = load_price_table(getattr(config.telemetry, "prices", "") or None)
    capacity = max(1, workers) * config.cache.capacity_bytes // kv_bytes_per_token(model.model_dir)
    return JobTracing(RequestObserver(tel, prices, model.model_id, model.block_size,
                                      config.cache.ttl_s, capacity, decode=decode))
