"""``cluster.bench.path_steps``: a request's overhead split at its trace's spans, exactly."""
import pytest

from cluster.bench.path_steps import Sent, path_steps
from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import SpanRecord

MS = 1_000_000


def _span(name: str, kind: str, request_id: str, start_ms: float, end_ms: float) -> SpanRecord:
    return SpanRecord("t" * 32, "s" * 16, "", name, int(start_ms * MS), int(end_ms * MS),
                      {A.SPAN_KIND: kind, A.REQUEST_ID: request_id}, (), (), "orchard")


def _request(rid: str, at_ms: float, edge: float, to_engine: float, worker: float,
             back: float) -> tuple[Sent, list[SpanRecord]]:
    """A request sent at ``at_ms`` whose steps take the given milliseconds."""
    start = at_ms + edge
    engine = start + to_engine
    end = engine + worker + back
    sent = Sent(rid, int(at_ms * MS), int(end * MS), worker / 1e3)
    return sent, [_span("chat M", "request", rid, start, end + 1.0),
                  _span("orchard.route", "route", "", start, engine),
                  _span("orchard.worker.generate", "worker", rid, engine, engine + worker)]


def test_each_step_is_the_median_of_its_own_gaps():
    a, spans_a = _request("a", 0.0, 1.0, 0.5, 40.0, 2.0)
    b, spans_b = _request("b", 100.0, 3.0, 0.25, 30.0, 1.0)
    c, spans_c = _request("c", 200.0, 2.0, 1.5, 35.0, 4.0)
    steps = path_steps("generate", [a, b, c], spans_a + spans_b + spans_c)
    assert (steps.path, steps.requests) == ("generate", 3)
    assert steps.edge_p50_ms == pytest.approx(2.0)
    assert steps.to_engine_p50_ms == pytest.approx(0.5)
    assert steps.back_p50_ms == pytest.approx(2.0)


def test_a_request_missing_from_the_traces_is_left_out_and_none_found_is_an_error():
    a, spans_a = _request("a", 0.0, 1.0, 0.5, 40.0, 2.0)
    b, _ = _request("b", 100.0, 3.0, 0.25, 30.0, 1.0)   # its spans were never written
    assert path_steps("job_single", [a, b], spans_a).requests == 1
    with pytest.raises(RuntimeError, match="none of its 1 requests is in the traces"):
        path_steps("job_single", [b], spans_a)
