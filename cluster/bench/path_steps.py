"""``orchard bench api --steps``: where a request's path overhead goes, read from its trace.

Every request of the bench is stamped at the client (``Sent``: the call and the result, on the
wall clock the spans use) and found again in the traces its cluster wrote (``exporter =
"file"``) by its request id: the frontend's request span and the worker's span, whose start is
the engine taking the request. Three steps, which add up to the request's overhead (wall time
less ``worker_s``)::

    edge        the call -> the request span: gRPC in, auth, validation, tokenization,
                admission, a slot (a job: SubmitJob, its fsynced store, the runner's task,
                the forecast)
    to_engine   the request span -> the engine has it: the trace, hashing, routing, the
                worker's stream (Ray) or the engine thread's queue (in-process), the worker's
                loop -> its engine thread
    back        the engine's end (its start + ``worker_s``) -> the result at the client: the
                engine thread -> the worker's loop, the stream back, the frontend, gRPC out
                (a job: its result stored, the follower woken, ``StreamResults`` to its end)

Medians per step; each step's median is taken on its own, so they add up to about the
overhead's median, not exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import SpanRecord, read_spans
from router.kv.stats import percentile

WORKER_SPAN = "orchard.worker.generate"


@dataclass(frozen=True, slots=True)
class Sent:
    """One request as the client saw it: wall-clock nanoseconds (``time.time_ns``)."""

    request_id: str
    start_ns: int      # the call
    result_ns: int     # its result received (a job: its results stream ended)
    worker_s: float    # the worker's own time on it, from the result


@dataclass(frozen=True, slots=True)
class PathSteps:
    path: str
    requests: int          # the requests found in the traces
    edge_p50_ms: float
    to_engine_p50_ms: float
    back_p50_ms: float


def path_steps(path: str, sent: Sequence[Sent], spans: Sequence[SpanRecord]) -> PathSteps:
    """The steps of ``sent`` requests, from the ``spans`` of their cluster."""
    requests = {s.attributes.get(A.REQUEST_ID): s for s in spans
                if s.attributes.get(A.SPAN_KIND) == "request"}
    engines = {s.attributes.get(A.REQUEST_ID): s for s in spans if s.name == WORKER_SPAN}
    edge, to_engine, back = [], [], []
    for s in sent:
        request, engine = requests.get(s.request_id), engines.get(s.request_id)
        if request is None or engine is None:
            continue
        edge.append((request.start_ns - s.start_ns) / 1e6)
        to_engine.append((engine.start_ns - request.start_ns) / 1e6)
        back.append((s.result_ns - engine.start_ns) / 1e6 - s.worker_s * 1e3)
    if not edge:
        raise RuntimeError(f"{path}: none of its {len(sent)} requests is in the traces "
                           "(--steps needs the file exporter: --telemetry file)")
    return PathSteps(path, len(edge), percentile(edge, 0.5), percentile(to_engine, 0.5),
                     percentile(back, 0.5))


def steps_of_run(run_dir: Path, sent: dict[str, list[Sent]]) -> list[PathSteps]:
    """Each path's steps, from the traces under ``run_dir`` (its cluster stopped: flushed)."""
    spans = read_spans(run_dir / "traces").spans
    return [path_steps(path, requests, spans) for path, requests in sent.items()]
