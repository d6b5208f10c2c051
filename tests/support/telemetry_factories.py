"""Small factories for telemetry tests: typed engine results and routing decisions."""
from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from cluster.telemetry.setup import Telemetry, TelemetrySettings, setup_telemetry
from router.policy import Candidate, Reason, RoutingDecision
from workers.messages import GenerateResult, LookupOutcome, LookupReport, Timings

T0 = 1_700_000_000_000_000_000


def in_memory(tmp_path) -> tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader]:
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tel = setup_telemetry(TelemetrySettings("orchard-test", tmp_path),
                          SimpleSpanProcessor(exporter), reader)
    return tel, exporter, reader


def decision(worker: str, reason: Reason, expected: int, prompt_tokens: int,
             matches: dict[str, int]) -> RoutingDecision:
    return RoutingDecision(worker, reason, expected, prompt_tokens, tuple(
        Candidate(w, m, 10 * i, prompt_tokens - m + 10 * i)
        for i, (w, m) in enumerate(sorted(matches.items()))))


def result(request_id: str, prompt_tokens: int, cached: int, written: int, worker: str,
           outcome: LookupOutcome, common: int | None = None, next_prompt: int | None = None,
           next_stored: int | None = None, age: float | None = None, ttl: float = 300.0,
           start_ns: int = T0, outputs: int = 4) -> GenerateResult:
    lookup = LookupReport(outcome, prompt_tokens, cached, cached if common is None else common,
                          next_prompt, next_stored, age, ttl)
    ms = 1_000_000
    timings = Timings(start_ns, start_ns + ms, start_ns + 2 * ms, start_ns + 2 * ms,
                      start_ns + 20 * ms, start_ns + 40 * ms)
    return GenerateResult(request_id, tuple(range(outputs)), "abcd", "length", 0.02,
                          0.005, prompt_tokens, cached, prompt_tokens - cached, written,
                          lookup, timings, worker)
