"""Where spans and metrics go (``cluster.telemetry.exporters``): OTLP to a collector, over
HTTP and gRPC, against small real receivers on loopback; files and a collector at once;
metrics on their own setting; a failing exporter logged once a minute, so a traces-only
collector does not flood the log.
"""
import logging
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from cluster.telemetry.exporters import OncePerInterval, default_metrics, parse_exporters
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry
from tests.support.request_traces import emit_one


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


class TestCollectors:
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


class TestQuietFailures:
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


class TestTheExporterSetting:
    def test_names_are_split_trimmed_and_deduplicated_and_none_is_nothing(self):
        assert parse_exporters(" otlp , file,otlp") == ("otlp", "file")
        assert parse_exporters("none") == ()
        assert [default_metrics(e) for e in (("otlp", "file"), ("otlp",), ())] == [
            "file", "otlp", "none"]

    @pytest.mark.parametrize("value", ["", " , ", "none,file", "file,jaeger"])
    def test_anything_else_is_refused_naming_what_may_be_given(self, value):
        with pytest.raises(ValueError, match=r'exporter must be "file", "otlp", "file,otlp" or '
                                             r'"none", got'):
            parse_exporters(value)
