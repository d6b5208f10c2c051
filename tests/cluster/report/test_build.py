"""The report's groups (``cluster.report.build``) from spans and rows written by hand:
requests whose client disconnected count as load, apart from the finished requests' hit
ratio and M; speculative decoding's acceptance per job; near-miss positions per prompt
template, most frequent first."""
from __future__ import annotations

from cluster.report.build import build_report
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


def test_acceptance_per_job_from_the_spans_counts():
    from cluster.report.build import RequestRow, summarize
    from cluster.report.render import _acceptance

    def row(rid, drafted, accepted):
        return RequestRow("t", rid, "job-9", "acme", "", 0, "w0", 0, 10, 0, 0, None, None, "",
                          0, "", "miss", drafted_tokens=drafted, accepted_tokens=accepted)

    g = summarize("job-9", [row("a", 300, 250), row("b", 200, 60), row("c", 0, 0)])
    assert (g["drafted_tokens"], g["accepted_tokens"], g["acceptance"]) == (500, 310, 0.62)
    assert _acceptance(g) == "0.62 (310/500)"


def test_near_miss_positions_per_prompt_template_most_frequent_first():
    from cluster.report.build import RequestRow, near_miss_positions
    from cluster.telemetry import attrs as A

    def row(rid, tenant, first_block, common, cause="near_miss"):
        return RequestRow("t", rid, "job-1", tenant, "", 0, "w0", 0, 64, 0, 0, None, None,
                          cause, 0, "", "miss", lookup={A.CACHE_COMMON_PREFIX: common},
                          block_hashes=(first_block, "b2"))

    rows = [row("a", "acme", "aaaa" * 8, 19), row("b", "acme", "aaaa" * 8, 19),
            row("c", "acme", "aaaa" * 8, 40), row("d", "acme", "aaaa" * 8, 7),
            row("e", "acme", "aaaa" * 8, 3), row("f", "acme", "bbbb" * 8, 19),
            row("g", "beta", "aaaa" * 8, 19), row("h", "acme", "aaaa" * 8, 19, "evicted")]
    assert near_miss_positions(rows) == [
        {"tenant": "acme", "template": "aaaa" * 4, "near_misses": 5,
         "positions": [{"token": 19, "requests": 2}, {"token": 3, "requests": 1},
                       {"token": 7, "requests": 1}]},
        {"tenant": "acme", "template": "bbbb" * 4, "near_misses": 1,
         "positions": [{"token": 19, "requests": 1}]},
        {"tenant": "beta", "template": "aaaa" * 4, "near_misses": 1,
         "positions": [{"token": 19, "requests": 1}]}]
