"""The analyst's report: from traces alone, what caching saved against the forecast, and why
requests missed.

Input is spans (``cluster.telemetry.otlp_json.read_spans``); each request span (``orchard.span =
request``) becomes a ``RequestRow``, joined with its trace's cache lookup span. Rows are
grouped per job, per tenant and per time window. Every group carries:

* requests, input / cached / written tokens, hit ratio (cached over input tokens);
* speculative decoding: drafted and accepted tokens, and the acceptance rate (accepted over
  drafted; none when nothing was drafted);
* measured ``M`` and forecast ``M``, both token-weighted over the group (``M`` is linear in
  its numerator, so the weighted mean of the requests' ``M`` is the group's ``M``); for a job,
  the forecast is the one made at submission (its ``orchard.job`` span) when the trace has it,
  else the routing-time forecasts of its requests; the error is forecast minus measured;
* miss causes: cause -> computed tokens of the requests attributed to it. The split between
  ``near_miss`` and ``first_sight`` follows routing order, which concurrency makes
  timing-dependent (``router.attribution.TIMING_DEPENDENT``); the report lists those causes
  and their sum, which does not depend on timing.

Requests whose client disconnected before the result (``orchard.request.client_disconnected``)
are counted apart: their prompts are load (admitted, and prefilled unless still queued), so
``input_tokens`` and ``disconnected_input_tokens`` include them, but with no result they carry
no cached count or ``M``, and the hit ratio and both ``M`` are over the finished requests.

Jobs are listed newest first by submission (the job span's start, else the first request's),
each with its span of time; the report names the price tables its figures were priced with.

Also: the worst near misses (the longest shared run that still missed, "common=5919 of 5923",
with the decoded text around the divergence when the worker recorded it) and template drift
(a conversation turn whose prompt does not extend the previous turn's full blocks).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import SpanRecord
from router.attribution import TIMING_DEPENDENT
from router.cost import FIVE_MINUTES_S


@dataclass(frozen=True, slots=True)
class RequestRow:
    trace_id: str
    request_id: str
    job_id: str
    tenant: str
    conversation: str
    turn: int
    worker: str
    start_ns: int
    input_tokens: int
    cached_tokens: int
    written_tokens: int
    forecast_m: float | None
    measured_m: float | None
    miss_cause: str
    miss_tokens: int
    holder: str
    outcome: str
    lookup: dict[str, Any] = field(default_factory=dict)
    block_hashes: tuple[str, ...] = ()
    block_size: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    disconnected: bool = False  # the caller left before the result (see the module doc)
    write_ttl_s: float = 0.0          # the TTL its writes keep (0: not recorded)
    bypass: tuple[str, ...] = ()      # "read", "write": what it asked the store not to do
    salted: bool = False


def _request_row(span: SpanRecord, lookup: dict[str, Any]) -> RequestRow:
    a = span.attributes
    return RequestRow(
        trace_id=span.trace_id, request_id=str(a.get(A.REQUEST_ID, "")),
        job_id=str(a.get(A.JOB_ID, "")), tenant=str(a.get(A.TENANT, "")),
        conversation=str(a.get(A.GEN_AI_CONVERSATION, "")), turn=int(a.get(A.TURN, 0)),
        worker=str(a.get(A.WORKER, "")), start_ns=span.start_ns,
        input_tokens=int(a.get(A.GEN_AI_INPUT_TOKENS, 0)),
        cached_tokens=int(a.get(A.GEN_AI_CACHE_READ, 0)),
        written_tokens=int(a.get(A.GEN_AI_CACHE_WRITE, a.get(A.GEN_AI_CACHE_CREATION, 0))),
        forecast_m=a.get(A.COST_FORECAST_M), measured_m=a.get(A.COST_MEASURED_M),
        miss_cause=str(a.get(A.MISS_CAUSE, "")), miss_tokens=int(a.get(A.MISS_TOKENS, 0)),
        holder=str(a.get(A.MISS_HOLDER, "")), outcome=str(a.get(A.CACHE_OUTCOME, "")),
        lookup=lookup, block_hashes=tuple(a.get(A.PROMPT_BLOCKS, ()) or ()),
        block_size=int(a.get(A.BLOCK_SIZE, 0)),
        drafted_tokens=int(a.get(A.SPEC_DRAFTED, 0)),
        accepted_tokens=int(a.get(A.SPEC_ACCEPTED, 0)),
        disconnected=bool(a.get(A.CLIENT_DISCONNECTED, False)),
        write_ttl_s=float(a.get(A.CACHE_WRITE_TTL_S, 0.0)),
        bypass=tuple(a.get(A.CACHE_BYPASS, ()) or ()), salted=bool(a.get(A.CACHE_SALTED)))


def request_rows(spans: Iterable[SpanRecord]) -> list[RequestRow]:
    """One row per request span with a prompt size (finished or disconnected), in start
    order."""
    spans = list(spans)
    lookups = {s.trace_id: s.attributes for s in spans
               if s.attributes.get(A.SPAN_KIND) == "lookup"}
    rows = [_request_row(s, lookups.get(s.trace_id, {})) for s in spans
            if s.attributes.get(A.SPAN_KIND) == "request" and A.GEN_AI_INPUT_TOKENS in s.attributes]
    return sorted(rows, key=lambda r: (r.start_ns, r.request_id))


def job_submissions(spans: Iterable[SpanRecord]) -> dict[str, int]:
    """When each job was submitted (its ``orchard.job`` span's start, ns since the epoch)."""
    return {str(s.attributes[A.JOB_ID]): s.start_ns for s in spans
            if s.attributes.get(A.SPAN_KIND) == "job" and A.JOB_ID in s.attributes}


def price_tables(spans: Iterable[SpanRecord]) -> list[str]:
    """The price table versions the traced costs were computed with."""
    return sorted({str(s.attributes[A.COST_PRICE_VERSION]) for s in spans
                   if A.COST_PRICE_VERSION in s.attributes})


def job_forecasts(spans: Iterable[SpanRecord]) -> dict[str, float]:
    """The forecast ``M`` made at each job's submission (its ``orchard.job`` span)."""
    return {str(s.attributes[A.JOB_ID]): float(s.attributes[A.COST_FORECAST_M]) for s in spans
            if s.attributes.get(A.SPAN_KIND) == "job" and A.COST_FORECAST_M in s.attributes}


def _weighted(rows: Sequence[RequestRow], attr: str) -> float | None:
    pairs = [(getattr(r, attr), r.input_tokens) for r in rows
             if getattr(r, attr) is not None and r.input_tokens]
    total = sum(n for _, n in pairs)
    return sum(m * n for m, n in pairs) / total if total else None


def summarize(key: str, rows: Sequence[RequestRow], forecast: float | None = None) -> dict:
    """One group's figures; ``forecast`` overrides the requests' routing-time forecasts."""
    left = [r for r in rows if r.disconnected]
    rows = [r for r in rows if not r.disconnected]
    input_tokens = sum(r.input_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    request_forecast = _weighted(rows, "forecast_m")
    measured = _weighted(rows, "measured_m")
    forecast_m = forecast if forecast is not None else request_forecast
    drafted = sum(r.drafted_tokens for r in rows)
    accepted = sum(r.accepted_tokens for r in rows)
    causes: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.miss_cause:
            causes[r.miss_cause] += r.miss_tokens
    return {
        "key": key, "requests": len(rows) + len(left),
        "input_tokens": input_tokens + sum(r.input_tokens for r in left),
        "disconnected_requests": len(left),
        "disconnected_input_tokens": sum(r.input_tokens for r in left),
        "cached_tokens": cached, "written_tokens": sum(r.written_tokens for r in rows),
        "hit_ratio": cached / input_tokens if input_tokens else None,
        "forecast_multiplier": forecast_m, "request_forecast_multiplier": request_forecast,
        "measured_multiplier": measured,
        "forecast_error": (forecast_m - measured
                           if forecast_m is not None and measured is not None else None),
        "miss_causes": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        **cache_controls(rows),
    }


def cache_controls(rows: Sequence[RequestRow]) -> dict:
    """What a group's requests asked of the cache: prompt tokens written by the TTL they
    keep, as priced (``router.cost``: up to 300 s is the 5-minute rate), the requests that
    bypassed reads or writes, and how many were salted (counted; a salt is never recorded)."""
    by_ttl = {"5m": 0, "1h": 0}
    for r in rows:
        if r.written_tokens:
            by_ttl["1h" if r.write_ttl_s > FIVE_MINUTES_S else "5m"] += r.written_tokens
    return {"written_by_ttl": by_ttl,
            "bypassed": {k: sum(k in r.bypass for r in rows) for k in ("read", "write")},
            "salted_requests": sum(r.salted for r in rows)}


def near_misses(rows: Sequence[RequestRow], limit: int = 5) -> list[dict]:
    """The near misses that shared the longest run with a stored sequence, worst first."""
    found = [r for r in rows if r.miss_cause == "near_miss" or r.outcome == "near_miss"]
    found.sort(key=lambda r: (-int(r.lookup.get(A.CACHE_COMMON_PREFIX, 0)),
                              r.input_tokens, r.request_id))
    out = []
    for r in found[:limit]:
        lk = r.lookup
        out.append({
            "request_id": r.request_id, "job_id": r.job_id, "tenant": r.tenant,
            "worker": r.worker, "line": lk.get(A.CACHE_LINE, ""),
            "common_prefix": lk.get(A.CACHE_COMMON_PREFIX), "prompt_tokens": r.input_tokens,
            "cached_tokens": r.cached_tokens,
            "next_prompt_token": lk.get(A.CACHE_NEXT_PROMPT_TOKEN),
            "next_stored_token": lk.get(A.CACHE_NEXT_STORED_TOKEN),
            "text_before": lk.get(A.DIVERGENCE_BEFORE), "prompt_next": lk.get(A.DIVERGENCE_PROMPT),
            "stored_next": lk.get(A.DIVERGENCE_STORED)})
    return out


def near_miss_positions(rows: Sequence[RequestRow], positions: int = 3) -> list[dict]:
    """Per prompt template (a tenant's prompts that open with the same first block), how many
    requests were near misses and the token positions where they most often diverged from
    what was stored (the shared run's length), most frequent first: a template whose misses
    pile up at one position has a volatile line there (a date, a request id)."""
    found: dict[tuple[str, str], Counter] = {}
    for r in rows:
        common = r.lookup.get(A.CACHE_COMMON_PREFIX)
        if (r.miss_cause == "near_miss" or r.outcome == "near_miss") and r.block_hashes \
                and common is not None:
            found.setdefault((r.tenant, r.block_hashes[0]), Counter())[int(common)] += 1
    out = [{"tenant": tenant, "template": first[:16], "near_misses": sum(at.values()),
            "positions": [{"token": token, "requests": n}
                          for token, n in sorted(at.items(), key=lambda kv: (-kv[1], kv[0]))
                          [:positions]]}
           for (tenant, first), at in found.items()]
    return sorted(out, key=lambda t: (-t["near_misses"], t["tenant"], t["template"]))


def template_drift(rows: Sequence[RequestRow]) -> list[dict]:
    """Consecutive turns of a conversation where the later prompt does not extend the earlier
    one's full blocks: the divergence block and token offset, per occurrence."""
    by_conversation: dict[tuple[str, str], list[RequestRow]] = defaultdict(list)
    for r in rows:
        if r.conversation and r.block_hashes:
            by_conversation[(r.tenant, r.conversation)].append(r)
    drift = []
    for (tenant, conversation), turns in sorted(by_conversation.items()):
        turns.sort(key=lambda r: (r.turn, r.start_ns))
        for before, after in zip(turns, turns[1:]):
            common = 0
            for a, b in zip(before.block_hashes, after.block_hashes):
                if a != b:
                    break
                common += 1
            if common < min(len(before.block_hashes), len(after.block_hashes)):
                drift.append({"tenant": tenant, "conversation": conversation,
                              "turn": after.turn, "request_id": after.request_id,
                              "previous_request_id": before.request_id,
                              "diverged_at_block": common,
                              "diverged_at_token": common * after.block_size,
                              "previous_prompt_blocks": len(before.block_hashes)})
    return drift


def build_report(spans: Sequence[SpanRecord], job: str | None = None,
                 window_s: float = 60.0) -> dict:
    """The whole report as one JSON-ready object (``jobs``, ``tenants``, ``windows``, ...)."""
    if window_s <= 0:
        raise ValueError(f"--window must be positive seconds, got {window_s}")
    rows = request_rows(spans)
    if job is not None:
        rows = [r for r in rows if r.job_id == job]
        if not rows and not any(s.attributes.get(A.JOB_ID) == job for s in spans):
            raise ValueError(f"no requests of job {job!r} in these traces; "
                             f"run `orchard report` without --job to list the jobs")
    forecasts = job_forecasts(spans)
    groups: dict[str, dict[str, list[RequestRow]]] = {
        "jobs": defaultdict(list), "tenants": defaultdict(list), "windows": defaultdict(list)}
    t0 = rows[0].start_ns if rows else 0
    for r in rows:
        groups["jobs"][r.job_id or "(no job)"].append(r)
        groups["tenants"][r.tenant or "(none)"].append(r)
        start = int((r.start_ns - t0) / 1e9 // window_s * window_s)
        groups["windows"][f"{start}s-{start + window_s:g}s"].append(r)
    report: dict[str, Any] = {"requests": len(rows), "window_s": window_s,
                              "total": summarize("total", rows)}
    failed: dict[str, int] = defaultdict(int)
    for s in spans:
        if (s.attributes.get(A.SPAN_KIND) == "request" and A.ERROR_TYPE in s.attributes
                and not s.attributes.get(A.CLIENT_DISCONNECTED)):
            failed[str(s.attributes.get(A.JOB_ID, "")) or "(no job)"] += 1
    submitted = job_submissions(spans)
    jobs = []
    for key in set(groups["jobs"]) | ({job} & set(failed) if job else set(failed)):
        members = groups["jobs"].get(key, [])
        summary = summarize(key, members, forecasts.get(key))
        summary["job_id"] = summary.pop("key")
        summary["failed_requests"] = failed.get(key, 0)
        first = min((r.start_ns for r in members), default=0)
        summary["submitted_ns"] = submitted.get(key, first)
        summary["first_s"] = (first - t0) / 1e9 if members else None
        summary["last_s"] = (max(r.start_ns for r in members) - t0) / 1e9 if members else None
        jobs.append(summary)
    report["jobs"] = sorted(jobs, key=lambda g: (-g["submitted_ns"], g["job_id"]))
    report["price_tables"] = price_tables(spans)
    report["timing_dependent_causes"] = sorted(c.value for c in TIMING_DEPENDENT)
    report["tenants"] = [summarize(k, v) for k, v in groups["tenants"].items()]
    report["windows"] = [summarize(k, v) for k, v in groups["windows"].items()]
    report["near_misses"] = near_misses(rows)
    report["near_miss_positions"] = near_miss_positions(rows)
    report["template_drift"] = template_drift(rows)
    report["series"] = [{"t_s": (r.start_ns - t0) / 1e9, "request_id": r.request_id,
                         "job_id": r.job_id or "(no job)",
                         "input_tokens": r.input_tokens,
                         "forecast_m": r.forecast_m, "measured_m": r.measured_m,
                         "miss_cause": r.miss_cause, "miss_tokens": r.miss_tokens,
                         "disconnected": r.disconnected}
                        for r in rows]
    return report
