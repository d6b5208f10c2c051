"""``orchard bench telemetry`` on the tiny model: the production frontends it compares trace
(or not) every request, and the in-place timing draws every span of every request."""
import pytest

from cluster.bench.telemetry import bench_overhead, bench_tracing_work
from tests.support.forged_models import tiny_model

pytestmark = pytest.mark.slow

SPANS_PER_REQUEST = 6   # request, route, worker, lookup, prefill, decode (in-process worker)


def test_the_paired_frontends_trace_only_on_the_traced_side():
    r = bench_overhead(tiny_model(), conversations=2, turns=2, max_tokens=2, repeats=1)
    assert r["requests"] == 3   # 4 requests, the first one the warm-up
    assert r["spans_written"] == 4 * SPANS_PER_REQUEST   # the untraced frontend wrote none
    assert r["traced_cpu_s_per_request"] > 0 and r["untraced_cpu_s_per_request"] > 0


def test_the_tracing_calls_draw_every_span_once():
    r = bench_tracing_work(tiny_model(), conversations=2, turns=2, max_tokens=2, rounds=2)
    assert r["tracing_requests"] == 2 * 4
    assert r["tracing_spans"] == 2 * 4 * SPANS_PER_REQUEST
