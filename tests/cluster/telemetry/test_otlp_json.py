"""OTLP/JSON lines on disk (``cluster.telemetry.otlp_json``): the default exporter writes
them under the run directory, ``read_spans`` reads them back (a torn line counted, never
fatal), and the direct encoding matches protobuf's JSON mapping.
"""
import json

import pytest

from cluster.telemetry import attrs as A
from cluster.telemetry import spans
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry
from tests.support.request_traces import emit_one


class TestLinesOnDisk:
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


class TestEncoding:
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
