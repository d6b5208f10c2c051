"""Exporters: OTLP/JSON lines under the run directory (read back by the report), and OTLP to a
collector, over HTTP and gRPC, against small real receivers on loopback."""
import json
import logging
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from cluster.telemetry import spans
from cluster.telemetry import attrs as A
from cluster.telemetry.exporters import OncePerInterval
from cluster.telemetry.metrics import RequestUsage
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry


USAGE = RequestUsage("w0", "acme", "hit", "chat", "tiny", 10, 8, 0, 3, 0.01, 0.001)


def emit_one(tel):
    tel.instruments.record_request(USAGE)
    with spans.request_span(tel, spans.RequestInfo("r1", "acme", "tiny", job_id="j1")) as span:
        with tel.tracer.start_as_current_span("child"):
            pass
    tel.flush()
    return span


def test_default_exporter_writes_otlp_json_lines_under_the_run_dir(tmp_path):
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


def test_a_torn_line_is_counted_not_fatal(tmp_path):
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


def test_settings_refuse_bad_config(tmp_path):
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


def test_otlp_http_exporter_sends_to_a_collector(tmp_path):
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


def _serve(status: int = 200):
    _Receiver.received, _Receiver.metric_posts, _Receiver.metrics_status = [], [], status
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def test_file_and_otlp_at_once_with_metrics_off(tmp_path):
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


def test_metrics_follow_their_own_setting(tmp_path):
    server, endpoint = _serve()
    try:
        tel = setup_telemetry(TelemetrySettings("svc", tmp_path, "file", endpoint, metrics="otlp"))
        emit_one(tel)
        tel.shutdown()
    finally:
        server.shutdown()
    assert len(_Receiver.metric_posts) >= 1 and _Receiver.received == []
    assert (tmp_path / "traces").exists() and not (tmp_path / "metrics").exists()


def test_a_failing_exporter_logs_once_a_minute():
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


def test_a_traces_only_collector_does_not_flood_the_log(tmp_path, caplog):
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


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.received = []

    def Export(self, request, context):
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_grpc_exporter_sends_to_a_collector(tmp_path):
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


def test_direct_json_encoding_matches_the_protobuf_mapping(tmp_path):
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


def test_telemetry_settings_come_from_the_cluster_config(tmp_path):
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


class _MetricsRefused(metrics_service_pb2_grpc.MetricsServiceServicer):
    """A collector without metrics (like Phoenix): every export is UNIMPLEMENTED."""

    def __init__(self):
        self.calls = 0

    def Export(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "metrics are not collected here")


def test_a_traces_only_grpc_collector_does_not_flood_the_log(tmp_path, caplog):
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
