"""The one-line summary ``orchard submit --wait`` ends with: what a finished job cost.

::

    job-1a2b: 32 requests (0 failed), 3040 cached + 1312 computed input tokens; M forecast
    0.525, measured 0.525; cost 2284.8 uncached-token units (price table builtin)

Measured figures come from the job's results (each result's usage, priced by
``router.cost.measured_usage``); the forecast made at submission is read from the run
directory's traces (the job's ``orchard.job`` span), when this machine has them; the cost is
the numerator of ``M`` (input tokens priced in units of one uncached input token).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import read_spans
from router.cost import PriceTable, TokenUsage, measured_usage, total_usage


@dataclass(frozen=True, slots=True)
class JobSummary:
    job_id: str
    requests: int
    failed: int
    usage: TokenUsage
    forecast_m: float | None
    measured_m: float | None
    cost: float
    price_version: str

    def line(self) -> str:
        forecast = "-" if self.forecast_m is None else f"{self.forecast_m:.3f}"
        measured = "-" if self.measured_m is None else f"{self.measured_m:.3f}"
        return (f"{self.job_id}: {self.requests} requests ({self.failed} failed), "
                f"{self.usage.cached_tokens} cached + {self.usage.computed_tokens} computed input "
                f"tokens; M forecast {forecast}, measured {measured}; cost {self.cost:.1f} "
                f"uncached-token units (price table {self.price_version})")


def forecast_of(job_id: str, traces: Path) -> tuple[float | None, str]:
    """The forecast ``M`` recorded when ``job_id`` was submitted and the model it was priced
    for, if ``traces`` hold the job's span; else ``(None, "")``."""
    try:
        spans = read_spans(traces).spans
    except FileNotFoundError:
        return None, ""
    for span in spans:
        a = span.attributes
        if a.get(A.SPAN_KIND) == "job" and a.get(A.JOB_ID) == job_id and A.COST_FORECAST_M in a:
            return float(a[A.COST_FORECAST_M]), str(a.get(A.GEN_AI_REQUEST_MODEL, ""))
    return None, ""


def summarize_job(job_id: str, results: Iterable[Any], prices: PriceTable, model: str,
                  ttl_s: float, block_size: int, forecast_m: float | None) -> JobSummary:
    """``results`` are the job's ``pb.Result`` messages (ok or failed)."""
    usages, requests, failed = [], 0, 0
    for r in results:
        requests += 1
        if not r.ok:
            failed += 1
            continue
        u = r.usage
        usages.append(measured_usage(u.prompt_tokens, u.cached_tokens, u.written_tokens,
                                     block_size))
    usage = total_usage(usages)
    rates = prices.rates(model)
    measured = usage.multiplier(rates, ttl_s) if usage.input_tokens else None
    return JobSummary(job_id, requests, failed, usage, forecast_m, measured,
                      usage.cost(rates, ttl_s), prices.version)
