"""The spans of a request and a job, emitted from typed data (names in ``cluster.telemetry.attrs``).

Call sites are one line each::

    # frontend, per request
    with spans.request_span(tel, RequestInfo(...)) as span:          # the trace's root
        ...decision = router.route(...)...
        spans.record_routing(tel, decision, started_ns)               # child: orchard.route
        req = GenerateRequest(..., trace_context=telemetry.request_context())
        ...result = worker.generate(req)...
        spans.record_outcome(tel, span, outcome_record)               # usage, cost, miss cause

    # worker actor (or the frontend, for a backend that does not), from the result's Timings
    spans.record_engine(tel, request, result, decode)                 # lookup / prefill / decode

    # frontend, per job at submission
    job_context = spans.record_job(tel, JobInfo(...))                 # store it with the job

Every helper is guarded: a failure is logged once and the request goes on.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from cluster.telemetry import attrs as A
from cluster.telemetry.metrics import RequestUsage
from cluster.telemetry.setup import (Telemetry, context_of, guarded, request_context,
                               span_context_link, start_span)
from router.attribution import Attribution, served_from
from router.cost import CostComparison, TokenUsage
from workers.messages import CacheControls, GenerateRequest, GenerateResult, LookupReport

if TYPE_CHECKING:
    from router.policy import RoutingDecision

MAX_PROMPT_BLOCKS = 512     # block hashes recorded per request for drift detection
DIVERGENCE_WINDOW = 24      # tokens of decoded context on each side of a divergence


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the frontend knows about a request before it runs."""

    request_id: str
    tenant: str
    model: str
    job_id: str = ""
    conversation_id: str = ""
    turn: int = 0
    operation: str = A.OPERATION_CHAT   # "chat" (messages) or "text_completion" (token ids)
    max_tokens: int = 0
    temperature: float = 0.0
    job_context: tuple[tuple[str, str], ...] = ()  # the job span's context: linked


@dataclass(frozen=True, slots=True)
class PulledPrefix:
    """A request's prefix pulled from a peer before it ran (``cluster.backend.wire.
    PullOutcome``'s figures): ``tokens`` of it, read from the store as cached tokens."""

    peer: str
    tokens: int
    refused: str = ""   # why the pull ended early ("": it brought what it was asked for)


@dataclass(frozen=True, slots=True)
class OutcomeRecord:
    """What the frontend knows after the request ran."""

    result: GenerateResult
    block_size: int
    block_hashes: Sequence[int] = ()
    cost: CostComparison | None = None
    miss: Attribution | None = None
    attempts: int = 1
    model: str = ""       # the model that answered: gen_ai.response.model
    pulled: PulledPrefix | None = None   # its prefix pulled from a peer first
    cache: CacheControls = CacheControls()  # what the request asked of the store
    salted: bool = False  # its namespace had a cache_salt (the salt itself is never recorded)


@dataclass(frozen=True, slots=True)
class JobInfo:
    job_id: str
    tenant: str
    model: str
    requests: int
    price_version: str = ""
    forecast: TokenUsage | None = None        # summed over the job's requests
    forecast_multiplier: float | None = None


@contextmanager
def request_span(tel: Telemetry, info: RequestInfo, parent=None) -> Iterator[Span]:
    """The request's root span (or a child of ``parent``, e.g. a gRPC caller's context)."""
    link = span_context_link(info.job_context) if info.job_context else None
    # No parent: a new trace (one request, one trace), even inside a job's context.
    parent = parent if parent is not None else otel_context.Context()
    with start_span(tel, f"{info.operation} {info.model}", "request", parent,
                    links=[link] if link else [], span_kind=SpanKind.SERVER) as span:
        _set_request_info(span, info)
        yield span


@guarded()
def _set_request_info(span: Span, info: RequestInfo) -> None:
    span.set_attributes({
        A.GEN_AI_OPERATION: info.operation, A.GEN_AI_SYSTEM: A.PROVIDER,
        A.GEN_AI_REQUEST_MODEL: info.model, A.REQUEST_ID: info.request_id,
        A.TENANT: info.tenant, A.JOB_ID: info.job_id,
        A.GEN_AI_CONVERSATION: info.conversation_id, A.TURN: info.turn,
        A.GEN_AI_REQUEST_MAX_TOKENS: info.max_tokens,
        A.GEN_AI_REQUEST_TEMPERATURE: info.temperature})


def _text(value: object) -> str:
    return str(value.value) if isinstance(value, Enum) else str(value)


@guarded()
def record_routing(tel: Telemetry, decision: RoutingDecision, start_ns: int,
                   end_ns: int | None = None,
                   trace_context: Sequence[tuple[str, str]] | None = None) -> None:
    """The routing span, a child of the current span (or of the context carried in
    ``trace_context``); one event per candidate."""
    parent = context_of(trace_context) if trace_context is not None else None
    span = tel.tracer.start_span("orchard.route", context=parent, start_time=start_ns,
                                 attributes={A.SPAN_KIND: "route"})
    span.set_attributes({
        A.ROUTE_WORKER: decision.worker_id, A.ROUTE_REASON: _text(decision.reason),
        A.ROUTE_EXPECTED_CACHED: decision.expected_cached_tokens,
        A.ROUTE_CANDIDATES: len(decision.candidates)})
    if decision.pull is not None:
        span.set_attributes({A.ROUTE_PULL_FROM: decision.pull.source,
                             A.ROUTE_PULL_TOKENS: decision.pull.tokens,
                             A.ROUTE_PULL_PREDICTED_S: decision.pull.predicted_s})
    for c in decision.candidates:
        span.add_event(A.ROUTE_CANDIDATE_EVENT, {
            A.CANDIDATE_WORKER: c.worker_id, A.CANDIDATE_MATCHED: c.matched_tokens,
            A.CANDIDATE_LOAD: c.load_tokens, A.CANDIDATE_SCORE: c.score}, timestamp=start_ns)
    span.end(end_time=end_ns or time.time_ns())


@guarded()
def record_outcome(tel: Telemetry, span: Span, record: OutcomeRecord) -> None:
    """Usage (``gen_ai.*``), latency, cost and miss cause on the request span; metrics."""
    r = record.result
    # Input tokens written (output tokens the engine also stored are not input).
    written = record.cost.measured.written_tokens if record.cost else r.written_tokens
    span.set_attributes({
        A.GEN_AI_RESPONSE_ID: r.request_id, A.GEN_AI_FINISH_REASONS: [r.finish_reason],
        A.GEN_AI_RESPONSE_MODEL: record.model,
        A.GEN_AI_INPUT_TOKENS: r.input_tokens, A.GEN_AI_OUTPUT_TOKENS: len(r.output_tokens),
        A.GEN_AI_CACHE_READ: r.cached_tokens, A.GEN_AI_CACHE_WRITE: written,
        A.GEN_AI_CACHE_CREATION: written, A.COMPUTED_TOKENS: r.computed_tokens,
        A.TTFT_S: r.ttft_s, A.TPOT_S: r.tpot_s, A.WORKER: r.worker_id,
        A.SPEC_DRAFTED: r.drafted_tokens, A.SPEC_ACCEPTED: r.accepted_tokens,
        A.ATTEMPTS: record.attempts, A.CACHE_OUTCOME: r.lookup.outcome.value,
        **_tier_attributes(r.cached_tokens, r.lookup.disk_tokens),
        A.CACHE_PULLED_TOKENS: record.pulled.tokens if record.pulled else 0,
        A.BLOCK_SIZE: record.block_size,
        A.PROMPT_BLOCKS: [f"{h & 0xFFFFFFFFFFFFFFFF:016x}"
                          for h in record.block_hashes[:MAX_PROMPT_BLOCKS]],
        A.CACHE_WRITE_TTL_S: r.lookup.ttl_s if record.cache.ttl_s is None
        else record.cache.ttl_s,
        A.CACHE_BYPASS: [k for k, on in (("read", record.cache.read),
                                         ("write", record.cache.write)) if not on],
        A.CACHE_SALTED: record.salted})
    if record.pulled is not None and record.pulled.refused:
        span.set_attribute(A.PULL_REFUSED, record.pulled.refused)
    if record.cost is not None:
        _set_cost(span, record.cost)
    if record.miss is not None:
        span.set_attributes({A.MISS_CAUSE: record.miss.cause.value,
                             A.MISS_TOKENS: record.miss.tokens, A.MISS_HOLDER: record.miss.holder,
                             A.MISS_SERVED: record.miss.served.value})
    known = getattr(span, "attributes", None) or {}
    tel.instruments.record_request(RequestUsage(
        r.worker_id, str(known.get(A.TENANT, "")), r.lookup.outcome.value,
        str(known.get(A.GEN_AI_OPERATION, A.OPERATION_CHAT)), record.model, r.input_tokens,
        r.cached_tokens, written, len(r.output_tokens), r.ttft_s, r.tpot_s))


@guarded()
def record_failure(span: Span, code: str, message: str) -> None:
    """A request that failed (``code`` is its gRPC status name, e.g. UNAVAILABLE)."""
    span.set_attribute(A.ERROR_TYPE, code)
    span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))


@guarded()
def record_disconnect(span: Span, input_tokens: int) -> None:
    """A request whose caller went away before its result: its prompt was admitted (and
    prefilled, unless it was still queued), so its tokens are load the report must count."""
    span.set_attributes({A.GEN_AI_INPUT_TOKENS: input_tokens, A.CLIENT_DISCONNECTED: True,
                         A.ERROR_TYPE: "CANCELLED"})
    span.set_status(Status(StatusCode.ERROR, "CANCELLED: the client disconnected"))


def _set_cost(span: Span, cost: CostComparison) -> None:
    span.set_attributes({
        A.COST_PRICE_VERSION: cost.price_version,
        A.COST_FORECAST_M: cost.forecast_multiplier, A.COST_MEASURED_M: cost.measured_multiplier,
        A.COST_FORECAST_ERROR: cost.error,
        A.COST_FORECAST_CACHED: cost.forecast.cached_tokens,
        A.COST_FORECAST_WRITTEN: cost.forecast.written_tokens})


@guarded(default=())
def record_job(tel: Telemetry, job: JobInfo) -> tuple[tuple[str, str], ...]:
    """The job's span at submission, with its forecast; returns its context to store."""
    span = tel.tracer.start_span("orchard.job", attributes={A.SPAN_KIND: "job"})
    span.set_attributes({A.JOB_ID: job.job_id, A.TENANT: job.tenant,
                         A.GEN_AI_REQUEST_MODEL: job.model, A.JOB_REQUESTS: job.requests})
    if job.forecast is not None and job.forecast_multiplier is not None:
        span.set_attributes({A.COST_PRICE_VERSION: job.price_version,
                             A.COST_FORECAST_M: job.forecast_multiplier,
                             A.JOB_FORECAST_INPUT: job.forecast.input_tokens,
                             A.COST_FORECAST_CACHED: job.forecast.cached_tokens,
                             A.COST_FORECAST_WRITTEN: job.forecast.written_tokens})
    span.end()
    return request_context(trace.set_span_in_context(span))


def _tier_attributes(cached_tokens: int, disk_tokens: int) -> dict:
    """Which tier served the cached tokens, and how many from each."""
    return {A.CACHE_TIER: served_from(cached_tokens, disk_tokens).value,
            A.CACHE_MEMORY_TOKENS: cached_tokens - disk_tokens, A.CACHE_DISK_TOKENS: disk_tokens}


def _divergence_text(request: GenerateRequest, lookup: LookupReport,
                     decode: Callable[[Sequence[int]], str]) -> dict[str, str]:
    at = lookup.common_prefix
    before = decode(request.prompt[max(0, at - DIVERGENCE_WINDOW):at])
    prompt_next = decode(request.prompt[at:at + DIVERGENCE_WINDOW])
    stored_next = (decode([lookup.next_stored_token])
                   if lookup.next_stored_token is not None else "")
    return {A.DIVERGENCE_BEFORE: before, A.DIVERGENCE_PROMPT: prompt_next,
            A.DIVERGENCE_STORED: stored_next}


def _lookup_attributes(request: GenerateRequest, lookup: LookupReport,
                       decode: Callable[[Sequence[int]], str] | None) -> dict:
    attrs = {A.CACHE_OUTCOME: lookup.outcome.value, A.CACHE_PROMPT_TOKENS: lookup.prompt_tokens,
             A.CACHE_MATCHED: lookup.matched_tokens, A.CACHE_KEPT_TOKENS: lookup.kept_tokens,
             A.CACHE_IDENTITY_MISMATCH: lookup.identity_mismatches,
             A.CACHE_COMMON_PREFIX: lookup.common_prefix,
             A.CACHE_TTL_S: lookup.ttl_s, A.CACHE_LINE: lookup.line(),
             **_tier_attributes(lookup.matched_tokens, lookup.disk_tokens)}
    if lookup.next_prompt_token is not None:
        attrs[A.CACHE_NEXT_PROMPT_TOKEN] = lookup.next_prompt_token
    if lookup.next_stored_token is not None:
        attrs[A.CACHE_NEXT_STORED_TOKEN] = lookup.next_stored_token
    if lookup.entry_age_s is not None:
        attrs[A.CACHE_ENTRY_AGE_S] = lookup.entry_age_s
    if decode is not None and lookup.common_prefix < lookup.prompt_tokens \
            and lookup.common_prefix > lookup.matched_tokens:
        attrs.update(_divergence_text(request, lookup, decode))
    return attrs


@guarded(default=False)
def record_engine(tel: Telemetry, request: GenerateRequest, result: GenerateResult,
                  decode: Callable[[Sequence[int]], str] | None = None) -> bool:
    """The worker's spans, placed from the engine's ``Timings``, under the request's context;
    True once drawn (False when drawing them failed).

    ``decode`` (token ids -> text) adds the decoded text around a near miss's divergence.
    """
    t = result.timings
    parent = context_of(request.trace_context)
    worker = tel.tracer.start_span("orchard.worker.generate", context=parent,
                                   start_time=t.received_ns, kind=SpanKind.SERVER,
                                   attributes={A.SPAN_KIND: "worker", A.WORKER: result.worker_id,
                                               A.REQUEST_ID: request.request_id})
    inner = trace.set_span_in_context(worker)
    phases = (
        ("orchard.cache.lookup", "lookup", t.lookup_start_ns, t.lookup_end_ns,
         _lookup_attributes(request, result.lookup, decode)),
        ("orchard.prefill", "prefill", t.prefill_start_ns, t.first_token_ns,
         {A.PREFILL_TOKENS: result.computed_tokens, A.GEN_AI_CACHE_READ: result.cached_tokens}),
        ("orchard.decode", "decode", t.first_token_ns, t.finished_ns,
         {A.DECODE_TOKENS: len(result.output_tokens), A.TPOT_S: result.tpot_s,
          A.SPEC_DRAFTED: result.drafted_tokens, A.SPEC_ACCEPTED: result.accepted_tokens}),
    )
    for name, kind, start, end, attrs in phases:
        span = tel.tracer.start_span(name, context=inner, start_time=start,
                                     attributes={A.SPAN_KIND: kind, **attrs})
        span.end(end_time=max(start, end))
    worker.end(end_time=max(t.received_ns, t.finished_ns))
    return True
