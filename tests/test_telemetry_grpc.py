"""Trace context across the gRPC edge, with a real frontend over LocalBackend: a job's span
joins the caller's trace, each of its requests is a trace of its own linked to the job, a
Generate call's request span is the caller's child; then ``orchard report`` reads the run."""
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.api.client import Client, chat_request
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry
from forged_models import tiny_model
from frontend_harness import running_frontend
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

CONFIG = """
[[tenants]]
name = "acme"
api_keys = ["sk-acme"]
[admin]
api_keys = ["sk-admin"]
"""
SYSTEM = "You are a careful assistant who answers briefly and cites the manual. " * 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    exporter = InMemorySpanExporter()
    caller = setup_telemetry(TelemetrySettings("caller", run_dir, "none"),
                             SimpleSpanProcessor(exporter))
    with running_frontend(run_dir, tiny_model(), workers=2) as harness:
        with Client(harness.address, "sk-acme") as client:
            history = [{"role": "system", "content": SYSTEM}]
            requests = []
            for turn in range(3):
                history.append({"role": "user", "content": f"question {turn}: when to prune?"})
                requests.append(chat_request(f"conv-a-turn-{turn}", list(history), 4))
                history.append({"role": "assistant", "content": f"answer {turn}"})
            with caller.tracer.start_as_current_span("submit") as submit:
                job = client.submit(requests)
            client.wait(job.job_id, poll_s=0.05, timeout_s=120)
            cached = sum(r.usage.cached_tokens for r in client.results(job.job_id))
            with caller.tracer.start_as_current_span("generate") as generate:
                list(client.generate(chat_request("one", [{"role": "user", "content": "hi"}], 3)))
        store_bytes = {w.worker_id: w.cache_bytes for w in harness.run(harness.backend.workers())}
    return Run(run_dir, job.job_id, submit.get_span_context(), generate.get_span_context(),
               cached, store_bytes)


@dataclass(frozen=True)
class Run:
    run_dir: Path
    job_id: str
    submit: object
    generate: object
    cached_tokens: int              # the job's results, as the client read them
    store_bytes: dict[str, int]     # each worker's store at the end, as the backend says


def test_context_crosses_the_grpc_edge(traced_run):
    run_dir, job_id, submit, generate = (traced_run.run_dir, traced_run.job_id,
                                         traced_run.submit, traced_run.generate)
    spans = read_spans(run_dir / "traces").spans
    job_span = next(s for s in spans if s.name == "orchard.job")
    assert job_span.trace_id == format(submit.trace_id, "032x")
    assert job_span.parent_span_id == format(submit.span_id, "016x")
    requests = [s for s in spans if s.attributes.get("orchard.span") == "request"
                and s.attributes.get("orchard.job.id") == job_id]
    assert len(requests) == 3 and len({s.trace_id for s in requests}) == 3
    assert all(s.links == ((job_span.trace_id, job_span.span_id),) for s in requests)
    one = next(s for s in spans if s.attributes.get("orchard.span") == "request"
               and not s.attributes.get("orchard.job.id"))
    assert one.trace_id == format(generate.trace_id, "032x")
    assert one.parent_span_id == format(generate.span_id, "016x")
    kinds = {s.attributes.get("orchard.span") for s in spans if s.trace_id == one.trace_id}
    assert {"request", "route", "worker", "lookup", "prefill", "decode"} <= kinds


def test_report_on_the_served_run(traced_run, capsys):
    run_dir, job_id = traced_run.run_dir, traced_run.job_id
    assert main(["report", "--run-dir", str(run_dir), "--job", job_id, "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert job["requests"] == 3 and job["cached_tokens"] == traced_run.cached_tokens
    assert job["forecast_multiplier"] is not None and job["measured_multiplier"] is not None
    assert abs(job["forecast_multiplier"] - job["measured_multiplier"]) <= 0.05


def test_metrics_are_exported_under_the_run_dir(traced_run):
    run_dir = traced_run.run_dir
    points = {}
    for path in (run_dir / "metrics").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            for rm in json.loads(line)["resourceMetrics"]:
                for sm in rm["scopeMetrics"]:
                    for m in sm["metrics"]:
                        kind = next(k for k in ("sum", "gauge", "histogram") if k in m)
                        points.setdefault(m["name"], []).extend(m[kind]["dataPoints"])
    for name in ("orchard.cache.hit_ratio", "orchard.cache.cached_tokens",
                 "gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
                 "orchard.store.bytes", "orchard.store.evictions", "orchard.store.expirations",
                 "orchard.queue.depth"):
        assert points.get(name), f"{name} was not exported"
    last = {}  # each worker's store bytes at the last export (lines are in export order)
    for p in points["orchard.store.bytes"]:
        worker = next(a["value"]["stringValue"] for a in p["attributes"] if a["key"] == "worker")
        last[worker] = int(p.get("asInt", 0))
    assert last == traced_run.store_bytes


def test_the_job_record_carries_forecast_and_measured_multipliers(traced_run):
    from cluster.jobs.store import JobStore

    run_dir, job_id = traced_run.run_dir, traced_run.job_id
    store = JobStore(run_dir / "jobs.sqlite3", lambda: 0)
    try:
        results = store.results(job_id, 0, 10)
    finally:
        store.close()
    assert len(results) == 3
    assert all(r.forecast_multiplier is not None and r.measured_multiplier is not None
               for r in results)
    assert "first_sight" in {r.miss_cause for r in results}
