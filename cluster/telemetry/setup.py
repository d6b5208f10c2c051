"""orchard's OpenTelemetry: tracer and meter setup, attribute names, context propagation, spans.

This is the one module that sets OpenTelemetry up (from the cluster config's ``[telemetry]``
table) and names attributes. Every process (frontend, worker actors) calls ``setup_telemetry``
once, with its own ``TelemetrySettings`` narrowed from the cluster config (service
``orchard-frontend`` or ``orchard-worker``; a worker adds its id and node as resource
attributes), and passes the returned ``Telemetry`` to whoever emits spans.

One request is one trace, each span drawn by the process that did the work::

    chat <model>                 frontend: gen_ai.* usage, tenant, job, cost, miss cause
    ├── orchard.route            frontend (where routing runs): candidates, choice, reason
    └── orchard.worker.generate  worker actor, child of the context carried in the request
        ├── orchard.cache.lookup     hit / partial / near_miss / miss, divergence, age, TTL
        ├── orchard.prefill          computed tokens
        └── orchard.decode           output tokens
    orchard.job                  one per job at submission (forecast); request spans link to it

Context crosses gRPC as W3C ``traceparent`` metadata (``inject_metadata`` /
``extract_metadata``) and Ray calls inside ``GenerateRequest.trace_context``
(``request_context`` / ``context_of``). The routing span is drawn where the decision is made:
in the frontend, which routes in its own process on Ray too (``cluster.backend.routing``); its
duration is the decision itself, and a rerouted request shows each decision. The worker draws
its spans from the engine's ``Timings`` when a request finishes (``workers`` never imports
OpenTelemetry). ``cluster.backend.protocol.GenerateOutcome`` says whether the worker drew them
in its own process, so the frontend draws only what no other process did: the routing span
always, the worker's spans on the in-process ``LocalBackend`` (one process).

Exporters (``cluster.telemetry.exporters``): ``exporter = "file"`` (default) writes OTLP/JSON
lines under ``RUN_DIR/traces/`` and ``RUN_DIR/metrics/``, one file per process
(``<service>-<host>-<pid>.jsonl``; a worker on another machine writes under the same path on
its own disk); ``"otlp"`` sends to ``endpoint`` over ``protocol`` ``"http"`` (OTLP/HTTP
protobuf, e.g. ``http://127.0.0.1:4318``) or ``"grpc"`` (e.g. ``127.0.0.1:4317``);
``"file,otlp"`` does both at once; ``"none"`` records nothing. ``metrics`` picks the metric
exporter on its own (``"file"``, ``"otlp"`` or ``"none"``). A tracing failure is logged once
per call site and never fails a request, in every process; a failing exporter once a minute.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanProcessor
from opentelemetry.trace import Link, Span, SpanKind

from cluster.telemetry import exporters
from cluster.telemetry.exporters import EXPORTERS, PROTOCOLS  # noqa: F401  (re-exported)
from cluster.telemetry.attrs import *  # noqa: F401,F403  (the names, re-exported)
from cluster.telemetry.attrs import HOST_NAME, NODE_ADDRESS, NODE_ID, SPAN_KIND
from cluster.telemetry.metrics import Instruments

log = logging.getLogger("orchard.telemetry")
T = TypeVar("T")

SERVICE_FRONTEND = "orchard-frontend"
SERVICE_WORKER = "orchard-worker"


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """What ``setup_telemetry`` needs, narrowed from the cluster config."""

    service: str                 # "orchard-frontend" or "orchard-worker"
    run_dir: Path
    exporter: str = "file"       # one or more of file / otlp, comma-separated; or "none"
    endpoint: str = ""
    protocol: str = "http"
    metric_interval_s: float = 10.0
    resource: tuple[tuple[str, str], ...] = ()   # extra resource attributes (worker id, node)
    metrics: str = ""            # "file", "otlp", "none"; "" follows the span exporters

    def __post_init__(self) -> None:
        spans = exporters.parse_exporters(self.exporter)
        if self.metrics not in ("", *EXPORTERS):
            raise ValueError(f"[telemetry] metrics must be \"file\", \"otlp\" or \"none\", "
                             f"got {self.metrics!r}")
        if "otlp" in (*spans, self.metrics) and not self.endpoint:
            raise ValueError("[telemetry] exporting to \"otlp\" needs an endpoint, e.g. "
                             "endpoint = \"http://127.0.0.1:4318\"")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"[telemetry] protocol must be \"http\" or \"grpc\", got {self.protocol!r}")


_failed: set[str] = set()


def guarded(default: Any = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a telemetry call; on any error log it once per call site and return ``default``."""

    def wrap(func: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> T:
            try:
                return func(*args, **kwargs)
            except Exception:  # a tracing failure must never fail a request
                if func.__qualname__ not in _failed:
                    _failed.add(func.__qualname__)
                    log.exception("telemetry call %s failed; requests continue, this call "
                                  "site will not log again", func.__qualname__)
                return default
        return call
    return wrap


class Telemetry:
    """A process's tracer, meter and instruments. Build with ``setup_telemetry``."""

    def __init__(self, tracer_provider: TracerProvider | None,
                 meter_provider: MeterProvider | None) -> None:
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self.tracer = (tracer_provider.get_tracer("orchard") if tracer_provider
                       else trace.NoOpTracer())
        self.instruments = Instruments(meter_provider.get_meter("orchard")
                                       if meter_provider else None)

    @classmethod
    def disabled(cls) -> Telemetry:
        return cls(None, None)

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded (an exporter is set up)."""
        return self._tracer_provider is not None

    @guarded()
    def flush(self) -> None:
        if self._tracer_provider:
            self._tracer_provider.force_flush()
        if self._meter_provider:
            self._meter_provider.force_flush()

    @guarded()
    def shutdown(self) -> None:
        if self._tracer_provider:
            self._tracer_provider.shutdown()
        if self._meter_provider:
            self._meter_provider.shutdown()


def setup_telemetry(
    settings: TelemetrySettings,
    span_processor: SpanProcessor | None = None,
    metric_reader: MetricReader | None = None,
) -> Telemetry:
    """Build the process's ``Telemetry``; ``span_processor``/``metric_reader`` replace the
    configured exporters (tests pass the SDK's in-memory ones)."""
    if settings.exporter == "none" and span_processor is None:
        return Telemetry.disabled()
    resource = Resource.create({"service.name": settings.service, "service.namespace": "orchard",
                                **dict(settings.resource)})
    args = (settings.run_dir, settings.service, settings.endpoint, settings.protocol)
    processors = [span_processor] if span_processor else [
        BatchSpanProcessor(exporters.span_exporter(kind, *args))
        for kind in exporters.parse_exporters(settings.exporter)]
    metrics = settings.metrics or exporters.default_metrics(
        exporters.parse_exporters(settings.exporter))
    readers = [metric_reader] if metric_reader else [] if metrics == "none" else [
        PeriodicExportingMetricReader(exporters.metric_exporter(metrics, *args),
                                      export_interval_millis=settings.metric_interval_s * 1000)]
    exporters.quiet_export_failures()
    tracer_provider = TracerProvider(resource=resource)
    for processor in processors:
        tracer_provider.add_span_processor(processor)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    return Telemetry(tracer_provider, meter_provider)


def process_settings(settings: TelemetrySettings | None, service: str,
                     resource: Sequence[tuple[str, str]], node_address: str,
                     node_id: str) -> TelemetrySettings | None:
    """The cluster's settings as one actor process's: its service name, and its own resource
    attributes plus the node it runs on."""
    if settings is None:
        return None
    resource = (*settings.resource, *resource, (NODE_ADDRESS, node_address),
                (NODE_ID, node_id), (HOST_NAME, socket.gethostname()))
    return dataclasses.replace(settings, service=service, resource=resource)


def process_telemetry(settings: TelemetrySettings | None) -> Telemetry:
    """``setup_telemetry`` for a process that must serve whatever happens (a Ray actor): a
    failure is logged and the process runs untraced; ``None`` settings: untraced."""
    if settings is None:
        return Telemetry.disabled()
    try:
        return setup_telemetry(settings)
    except Exception:  # a tracing failure must never stop a worker or the router
        log.exception("telemetry setup for %s failed; it runs without tracing",
                      settings.service)
        return Telemetry.disabled()


def settings_from_config(config: Any, service: str) -> TelemetrySettings:
    """Narrow ``cluster.config.Config`` to what telemetry needs."""
    tel = config.telemetry
    return TelemetrySettings(service=service, run_dir=Path(config.run_dir),
                             exporter=tel.exporter, endpoint=tel.endpoint,
                             protocol=tel.protocol, metrics=tel.metrics)


# --- W3C trace context -------------------------------------------------------------------

@guarded(default=())
def request_context(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...]:
    """The current (or given) context as ``GenerateRequest.trace_context``."""
    carrier: dict[str, str] = {}
    inject(carrier, context=ctx)
    return tuple(sorted(carrier.items()))


def inject_metadata(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current (or given) context: ``[("traceparent", ...)]``."""
    return list(request_context(ctx))


@guarded(default=None)
def extract_metadata(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context | None:
    """The context a gRPC peer sent in its metadata (keys are lower-case in gRPC)."""
    carrier = {k.lower(): v for k, v in metadata or () if isinstance(v, str)}
    return extract(carrier) if "traceparent" in carrier else None


def context_of(trace_context: Sequence[tuple[str, str]]) -> otel_context.Context | None:
    """The context carried in a ``GenerateRequest`` (None when it carries none)."""
    return extract_metadata(trace_context)


def span_context_link(trace_context: Sequence[tuple[str, str]]) -> Link | None:
    """A link to the span whose context was serialised (a job's span, stored in its record)."""
    ctx = context_of(trace_context)
    if ctx is None:
        return None
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return Link(span_ctx) if span_ctx.is_valid else None


@contextmanager
def start_span(tel: Telemetry, name: str, kind: str, parent: otel_context.Context | None = None,
               links: Sequence[Link] = (), span_kind: SpanKind = SpanKind.INTERNAL,
               start_ns: int | None = None) -> Iterator[Span]:
    """A span that is current inside the block; a failure to start it yields a no-op span."""
    try:
        span = tel.tracer.start_span(name, context=parent, links=list(links), kind=span_kind,
                                     start_time=start_ns, attributes={SPAN_KIND: kind})
    except Exception:
        log.exception("could not start span %s; continuing without it", name)
        span = trace.INVALID_SPAN
    with trace.use_span(span, end_on_exit=True, record_exception=True):
        yield span


@contextmanager
def attached(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make ``ctx`` (e.g. from ``extract_metadata``) current inside the block; None: no-op."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)
