"""OTLP JSON lines on disk: the default trace and metric exporters, and the reader for reports.

Each export call appends one line to ``DIR/<service>-<host>-<pid>.jsonl``: an OTLP
``ExportTraceServiceRequest`` (or ``ExportMetricsServiceRequest``) in the OTLP/JSON encoding
(lowerCamelCase keys, trace and span ids as hex). One file per process, so processes never
interleave writes, and files from several machines copied into one directory never clash;
any OTLP/JSON tool reads the lines, and ``read_spans`` reads them back as flat
``SpanRecord``s for ``orchard report``.

A line that does not parse (a process killed mid-write) is skipped and counted, never fatal.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node: Any) -> Any:
    """OTLP/JSON writes ids as hex, protobuf's JSON mapping as base64: convert in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids(item)
    return node


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "orchard"


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class _JsonLines:
    def __init__(self, directory: Path, service: str) -> None:
        # Owner only, whatever the writing process's umask (a worker on a joined Ray node
        # inherits its raylet's): the lines carry text of tenants' prompts.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        host = _safe(socket.gethostname())
        self.path = directory / f"{_safe(service)}-{host}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()

    def append(self, message: Any) -> None:
        """A protobuf OTLP request, converted to OTLP/JSON."""
        self.write(_hex_ids(MessageToDict(message)))

    def write(self, request: dict[str, Any]) -> None:
        line = json.dumps(request, separators=(",", ":"))
        with self._lock, open(self.path, "a", encoding="utf-8", opener=_private) as out:
            out.write(line + "\n")


def _any(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_any(v) for v in value]}}
    return {"stringValue": str(value)}


def _attrs(attributes: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": _any(v)} for k, v in (attributes or {}).items()]


def _span(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"), "spanId": format(ctx.span_id, "016x"),
        "name": span.name, "kind": span.kind.value + 1,  # OTLP numbers kinds from 1
        "startTimeUnixNano": str(span.start_time), "endTimeUnixNano": str(span.end_time),
        "attributes": _attrs(span.attributes),
        "status": {"code": span.status.status_code.value}}
    if span.parent is not None:
        out["parentSpanId"] = format(span.parent.span_id, "016x")
    if span.status.description:
        out["status"]["message"] = span.status.description
    if span.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name,
                          "attributes": _attrs(e.attributes)} for e in span.events]
    if span.links:
        out["links"] = [{"traceId": format(ln.context.trace_id, "032x"),
                         "spanId": format(ln.context.span_id, "016x"),
                         "attributes": _attrs(ln.attributes)} for ln in span.links]
    return out


def encode_spans_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` in OTLP/JSON, built directly (several times faster
    than encoding protobuf and converting it)."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list]]] = {}
    for span in spans:
        resource, scopes = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        key = (scope.name, scope.version or "") if scope else ("", "")
        scopes.setdefault(key, []).append(_span(span))
    return {"resourceSpans": [
        {"resource": {"attributes": _attrs(resource.attributes if resource else {})},
         "scopeSpans": [{"scope": {"name": name, "version": version}, "spans": rows}
                        for (name, version), rows in scopes.items()]}
        for resource, scopes in by_resource.values()]}


class JsonLinesSpanExporter(SpanExporter):
    """Writes finished spans as OTLP/JSON lines under ``directory``."""

    def __init__(self, directory: str | Path, service: str) -> None:
        self._out = _JsonLines(Path(directory), service)

    @property
    def path(self) -> Path:
        return self._out.path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._out.write(encode_spans_json(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class JsonLinesMetricExporter(MetricExporter):
    """Writes metric snapshots as OTLP/JSON lines under ``directory``."""

    def __init__(self, directory: str | Path, service: str) -> None:
        super().__init__()
        self._out = _JsonLines(Path(directory), service)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        self._out.append(encode_metrics(metrics_data))
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One span as read back from OTLP/JSON: ids in hex, attributes as plain values."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[SpanEvent, ...]
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id) of linked spans
    service: str


def any_value(value: dict[str, Any]) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {item["key"]: any_value(item.get("value", {})) for item in items or ()}


def _spans_of(request: dict[str, Any]) -> Iterator[SpanRecord]:
    for resource_spans in request.get("resourceSpans", ()):
        resource = attributes(resource_spans.get("resource", {}).get("attributes"))
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                yield SpanRecord(
                    trace_id=span.get("traceId", ""), span_id=span.get("spanId", ""),
                    parent_span_id=span.get("parentSpanId", ""), name=span.get("name", ""),
                    start_ns=int(span.get("startTimeUnixNano", 0)),
                    end_ns=int(span.get("endTimeUnixNano", 0)),
                    attributes=attributes(span.get("attributes")),
                    events=tuple(SpanEvent(e.get("name", ""), int(e.get("timeUnixNano", 0)),
                                           attributes(e.get("attributes")))
                                 for e in span.get("events", ())),
                    links=tuple((ln.get("traceId", ""), ln.get("spanId", ""))
                                for ln in span.get("links", ())),
                    service=service)


@dataclass(frozen=True, slots=True)
class SpanFile:
    spans: tuple[SpanRecord, ...]
    bad_lines: int


def read_spans(directory: str | Path) -> SpanFile:
    """Every span in ``directory``'s ``*.jsonl`` files; unreadable lines are counted."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"trace directory {directory} does not exist; pass --traces DIR "
                                f"or the --run-dir of a cluster that has run")
    spans: list[SpanRecord] = []
    bad = 0
    for path in sorted(directory.glob("*.jsonl")):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                if not line.strip():
                    continue
                try:
                    spans.extend(_spans_of(json.loads(line)))
                except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                    bad += 1
    return SpanFile(tuple(spans), bad)
