"""Where a process's spans and metrics go: the exporters, and the quiet log of a failing one.

``[telemetry] exporter`` names one or more span exporters, comma-separated, all used at
once; ``metrics`` names the one metric exporter (``""``: ``file`` when spans go to a file,
else ``otlp`` when they go to a collector)::

    exporter = "file,otlp"      spans as OTLP/JSON lines under RUN_DIR/traces (what
                                ``orchard report`` reads) and to the collector at endpoint
    metrics  = "none"           a traces-only collector (Phoenix, say) gets no metrics

A collector that is down or refuses a signal (405, UNIMPLEMENTED) makes the OpenTelemetry
exporters log every batch; ``OncePerInterval`` lets one such record through per logger per
minute and counts the ones it held back, so ``cluster.log`` keeps saying what is wrong
without filling up.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter

from cluster.telemetry.otlp_json import JsonLinesMetricExporter, JsonLinesSpanExporter

EXPORTERS = ("file", "otlp", "none")
PROTOCOLS = ("http", "grpc")
# The loggers the OpenTelemetry SDK and OTLP exporters report export failures on.
EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk.metrics._internal.export",
    "opentelemetry.sdk._shared_internal",
)
FAILURE_LOG_INTERVAL_S = 60.0


def parse_exporters(value: str) -> tuple[str, ...]:
    """``"file,otlp"`` -> ``("file", "otlp")``; ``"none"`` -> ``()``."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    bad = [n for n in names if n not in EXPORTERS]
    if bad or not names or ("none" in names and len(names) > 1):
        raise ValueError(f"[telemetry] exporter must be \"file\", \"otlp\", \"file,otlp\" or "
                         f"\"none\", got {value!r}")
    return tuple(n for n in names if n != "none")


def default_metrics(exporters: tuple[str, ...]) -> str:
    return "file" if "file" in exporters else "otlp" if "otlp" in exporters else "none"


def span_exporter(kind: str, run_dir: Path, service: str, endpoint: str,
                  protocol: str) -> SpanExporter:
    if kind == "file":
        return JsonLinesSpanExporter(run_dir / "traces", service)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint.removeprefix("http://"), insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    return Http(endpoint=f"{endpoint.rstrip('/')}/v1/traces")


def metric_exporter(kind: str, run_dir: Path, service: str, endpoint: str,
                    protocol: str) -> MetricExporter:
    if kind == "file":
        return JsonLinesMetricExporter(run_dir / "metrics", service)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        return OTLPMetricExporter(endpoint=endpoint.removeprefix("http://"), insecure=True)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http
    return Http(endpoint=f"{endpoint.rstrip('/')}/v1/metrics")


class OncePerInterval(logging.Filter):
    """Pass one warning-or-worse record per logger per ``interval_s``; the next one passed
    says how many were held back. Lower levels pass untouched."""

    def __init__(self, interval_s: float = FAILURE_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = self._clock()
        with self._lock:
            last = self._last.get(record.name)
            if last is not None and now - last < self.interval_s:
                self._held[record.name] = self._held.get(record.name, 0) + 1
                return False
            self._last[record.name] = now
            held = self._held.pop(record.name, 0)
        if held:
            record.msg = f"{record.msg} ({held} similar export failures not logged in the " \
                         f"last {self.interval_s:.0f} s)"
        return True


_installed: list[OncePerInterval] = []


def quiet_export_failures() -> None:
    """Install ``OncePerInterval`` on the export loggers (once per process)."""
    if _installed:
        return
    _installed.append(OncePerInterval())
    for name in EXPORT_LOGGERS:
        logging.getLogger(name).addFilter(_installed[0])
