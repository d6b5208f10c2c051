"""The report's groups from spans written by hand: requests whose client disconnected count
as load, apart from the finished requests' hit ratio and M."""
from __future__ import annotations

from cluster.report.build import build_report
from cluster.report.plot import gap_label_levels
from cluster.report.render import render_text
from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import SpanRecord


def _span(i: int, **attributes) -> SpanRecord:
    return SpanRecord(f"{i:032x}", f"{i:016x}", "", "request", 1_000_000_000 * i,
                      1_000_000_000 * i + 1, {A.SPAN_KIND: "request", A.JOB_ID: "job-1",
                                              A.TENANT: "acme", **attributes}, (), (), "frontend")


SPANS = [
    _span(1, **{A.GEN_AI_INPUT_TOKENS: 100, A.GEN_AI_CACHE_READ: 0, A.COST_MEASURED_M: 1.0}),
    _span(2, **{A.GEN_AI_INPUT_TOKENS: 100, A.GEN_AI_CACHE_READ: 80, A.COST_MEASURED_M: 0.28}),
    # the caller left: 300 prompt tokens admitted, no result
    _span(3, **{A.GEN_AI_INPUT_TOKENS: 300, A.CLIENT_DISCONNECTED: True,
                A.ERROR_TYPE: "CANCELLED"}),
    _span(4, **{A.ERROR_TYPE: "UNAVAILABLE"}),  # failed before a prompt size was known
]


def test_disconnected_requests_are_load_but_not_in_hit_ratio_or_m():
    report = build_report(SPANS)
    [job] = report["jobs"]
    assert (job["requests"], job["disconnected_requests"], job["failed_requests"]) == (3, 1, 1)
    assert (job["input_tokens"], job["disconnected_input_tokens"]) == (500, 300)
    assert job["cached_tokens"] == 80
    assert job["hit_ratio"] == 80 / 200            # over the two finished requests
    assert job["measured_multiplier"] == (1.0 * 100 + 0.28 * 100) / 200
    assert [p["disconnected"] for p in report["series"]] == [False, False, True]
    text = render_text(report)
    assert "job-1 (1 failed, 1 disconnected)" in text
    assert ("1 requests' clients disconnected before their result: their 300 prompt tokens "
            "are counted in input (load), not in hit ratio or M.") in text


def test_idle_gap_labels_close_together_step_up():
    # an axis 100 wide: gaps 1 apart (under 3%) step up, cycling through 3 heights
    assert gap_label_levels([10, 11, 12, 13, 50, 51], 100.0) == [0, 1, 2, 0, 0, 1]
    assert gap_label_levels([], 100.0) == []
