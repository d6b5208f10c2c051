"""How ``orchard report`` shows a report (``cluster.report.render``): fixed-width tables, the
job rows with their notes, submission time and acceptance, and the sections under them, from
report dicts written by hand (the shape ``cluster.report.build.build_report`` returns).
"""
from __future__ import annotations

from cluster.report.render import render_text

NS_PER_S = 1_000_000_000
JOBS = ("Per job (newest first; submitted in UTC; requests' start times in seconds since the "
        "first request)")


def group(**fields) -> dict:
    """One group's figures (a job, tenant or window): two requests, 40 of 100 tokens cached."""
    return {"requests": 2, "input_tokens": 100, "cached_tokens": 40, "written_tokens": 48,
            "hit_ratio": 0.4, "forecast_multiplier": None, "measured_multiplier": 0.7184,
            "forecast_error": None, "miss_causes": {}, "drafted_tokens": 0,
            "accepted_tokens": 0, "acceptance": None, **fields}


def job(job_id: str = "job-1", **fields) -> dict:
    return group(**{"job_id": job_id, "failed_requests": 0, "disconnected_requests": 0,
                    "submitted_ns": 1_767_225_600 * NS_PER_S,   # 2026-01-01 00:00:00 UTC
                    "first_s": 3.0, "last_s": 125.4, **fields})


def report(**fields) -> dict:
    total = group(disconnected_requests=0, disconnected_input_tokens=0,
                  written_by_ttl={"5m": 48, "1h": 0}, bypassed={"read": 0, "write": 0},
                  salted_requests=0)
    return {"requests": 2, "window_s": 60.0, "total": total, "jobs": [job()],
            "tenants": [group(key="acme")], "windows": [group(key="0s-60s")],
            "price_tables": [], "timing_dependent_causes": [], "near_misses": [],
            "near_miss_positions": [], "template_drift": [], **fields}


def section(text: str, title: str) -> list[str]:
    """The lines of the section that starts with ``title``, up to the blank line after it."""
    lines = text.splitlines()
    start = lines.index(title)
    end = lines.index("", start)
    return lines[start:end]


class TestTables:
    def test_numbers_right_aligned_first_and_last_columns_left_aligned(self):
        causes = {"evicted": 8, "first_sight": 52}
        text = render_text(report(tenants=[group(key="acme", miss_causes=causes),
                                           group(key="b", requests=12, input_tokens=3000)]))
        assert section(text, "Per tenant") == [
            "Per tenant",
            "tenant  requests  input  cached  written    hit  forecast M  measured M  error  "
            "miss causes (computed tokens)",
            "acme           2    100      40       48  0.400           -       0.718      -  "
            "evicted=8, first_sight=52",
            "b             12   3000      40       48  0.400           -       0.718      -  -"]

    def test_timing_dependent_causes_are_starred_and_explained(self):
        causes = {"evicted": 8, "first_sight": 52, "near_miss": 4}
        text = render_text(report(tenants=[group(key="acme", miss_causes=causes)],
                                  timing_dependent_causes=["near_miss", "first_sight"]))
        assert section(text, "Per tenant")[2].endswith(
            "evicted=8, first_sight=52*, near_miss=4*")
        assert ("* timing-dependent: the split between first_sight and near_miss follows the "
                "order in which concurrent requests were routed; their sum does not.") in text
        assert "timing-dependent" not in render_text(report())

    def test_the_window_table_is_titled_by_its_width(self):
        text = render_text(report(window_s=30.0, windows=[group(key="0s-30s"),
                                                          group(key="30s-60s")]))
        assert [line.split()[0] for line in section(text, "Per 30 s window")[1:]] == [
            "window", "0s-30s", "30s-60s"]


class TestJobRows:
    def test_a_job_row_has_its_notes_submission_span_and_acceptance(self):
        busy = job("job-2", failed_requests=1, disconnected_requests=2, drafted_tokens=500,
                   accepted_tokens=310, acceptance=0.62, forecast_multiplier=0.7,
                   forecast_error=-0.01875)
        rows = section(render_text(report(jobs=[busy, job()])), JOBS)[2:]
        assert rows[0].split("  ")[0] == "job-2 (1 failed, 2 disconnected)"
        assert "2026-01-01 00:00:00" in rows[0] and "3-125 s" in rows[0]
        assert "0.700       0.718  -0.019" in rows[0]
        assert rows[0].endswith("0.62 (310/500)  -")
        assert rows[1].startswith("job-1 ") and rows[1].endswith("  -  -")

    def test_a_job_with_no_requests_started_has_no_span(self):
        rows = section(render_text(report(jobs=[job(first_s=None, last_s=None)])),
                       JOBS)
        assert rows[2].split()[3] == "-"   # job-1, the date, the time, then the span


class TestSections:
    def test_an_empty_report_says_so_and_every_section_says_none(self):
        text = render_text(report(requests=0, jobs=[], tenants=[], windows=[]))
        assert text.startswith("orchard report: 0 requests (no finished request spans in "
                               "these traces)\nPriced with price table none recorded.")
        assert text.count("\n  none\n") == 3 and text.endswith("  none\n")
        assert render_text(report()).splitlines()[0] == "orchard report: 2 requests"

    def test_the_price_tables_and_cache_controls_are_named(self):
        total = dict(report()["total"], written_by_ttl={"5m": 64, "1h": 32},
                     bypassed={"read": 1, "write": 2}, salted_requests=3)
        text = render_text(report(price_tables=["v1", "2026-11-01"], total=total))
        assert text.splitlines()[1].startswith("Priced with price table v1, 2026-11-01. ")
        assert section(text, "Cache controls (all requests)")[1:] == [
            "  prompt tokens written: 64 at 5 minutes, 32 at 1 hour",
            "  bypassed: 1 read nothing, 2 wrote nothing; salted: 3 requests"]

    def test_disconnected_requests_are_explained_only_when_there_are_some(self):
        total = dict(report()["total"], disconnected_requests=2, disconnected_input_tokens=700)
        assert ("2 requests' clients disconnected before their result: their 700 prompt "
                "tokens are counted in input (load), not in hit ratio or M.\n") in \
            render_text(report(total=total))
        assert "disconnected before" not in render_text(report())

    def test_near_misses_positions_and_drift_each_get_a_line(self):
        near = {"request_id": "r7", "job_id": "job-1", "worker": "w1",
                "line": "common=40 of 70", "cached_tokens": 32, "next_prompt_token": 9,
                "next_stored_token": 11, "text_before": "the manual", "prompt_next": " says",
                "stored_next": " said"}
        untold = dict(near, request_id="r8", text_before=None)
        positions = {"tenant": "acme", "template": "aaaa", "near_misses": 3,
                     "positions": [{"token": 19, "requests": 2}, {"token": 3, "requests": 1}]}
        drift = {"tenant": "acme", "conversation": "c2", "turn": 2, "request_id": "c2-2",
                 "diverged_at_block": 1, "diverged_at_token": 16, "previous_prompt_blocks": 5}
        text = render_text(report(near_misses=[near, untold], near_miss_positions=[positions],
                                  template_drift=[drift]))
        assert section(text, "Worst near misses")[1:] == [
            "  r7 (job job-1, w1): common=40 of 70, cached 32; next token prompt=9 stored=11",
            "    ...'the manual' | prompt: ' says' | stored: ' said'",
            "  r8 (job job-1, w1): common=40 of 70, cached 32; next token prompt=9 stored=11"]
        assert section(text, "Near-miss positions by prompt template (where the misses "
                             "diverged)")[1:] == [
            "  acme template aaaa: 3 near misses; token 19 (2), token 3 (1)"]
        assert text.endswith(
            "Template drift (a turn that does not extend the previous turn's prompt)\n"
            "  acme/c2 turn 2 (c2-2): diverged at block 1 (token 16) of the previous 5 "
            "blocks\n")
