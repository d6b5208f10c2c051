"""The summary ``orchard submit --wait`` ends with (``cluster.report.summary``): a job's
measured usage, cost and ``M`` from results made by hand, its line, and the forecast read from
a trace directory written here."""
from __future__ import annotations

import json
from types import SimpleNamespace

from cluster.report.summary import forecast_of, summarize_job
from cluster.telemetry import attrs as A
from router.cost import PriceTable, Rates, TokenUsage


def _result(ok: bool, prompt: int = 0, cached: int = 0, written: int = 0) -> SimpleNamespace:
    usage = SimpleNamespace(prompt_tokens=prompt, cached_tokens=cached, written_tokens=written)
    return SimpleNamespace(ok=ok, usage=usage)


# block size 4: 8 prompt tokens, 3 read (the first unread block starts at 4), 8 written, 4 of
# them input; 6 read none and 8 written, 6 of them input; a failed result's usage is left out
RESULTS = [_result(True, 8, 3, 8), _result(True, 6, 0, 8), _result(False, 5, 0, 0)]


def _span_line(job_id: str, **extra) -> str:
    attributes = {A.SPAN_KIND: "job", A.JOB_ID: job_id, **extra}
    span = {"traceId": "t", "spanId": "s", "name": "orchard.job",
            "attributes": [{"key": k, "value": {"doubleValue": v} if isinstance(v, float)
                            else {"stringValue": v}} for k, v in attributes.items()]}
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}) + "\n"


class TestSummarize:
    def test_usage_cost_and_m_of_the_ok_results_with_the_failed_counted(self):
        summary = summarize_job("job-1", RESULTS, PriceTable(), "m", 300.0, 4, 0.9)
        assert (summary.requests, summary.failed) == (3, 1)
        assert summary.usage == TokenUsage(14, 3, 10)
        assert summary.cost == 1.0 * 1 + 1.25 * 10 + 0.1 * 3
        assert summary.measured_m == (1.0 * 1 + 1.25 * 10 + 0.1 * 3) / 14
        assert summary.line() == (
            "job-1: 3 requests (1 failed), 3 cached + 11 computed input tokens; M forecast "
            "0.900, measured 0.986; cost 13.8 uncached-token units (price table builtin)")

    def test_the_models_own_rates_and_the_tables_version_price_it(self):
        prices = PriceTable("2026-11-01", models={"big": Rates(cache_write_5m=2.0, cache_write_1h=3.0)})
        summary = summarize_job("job-1", RESULTS, prices, "big", 300.0, 4, None)
        assert (summary.cost, summary.price_version) == (1.0 * 1 + 2.0 * 10 + 0.1 * 3, "2026-11-01")
        assert summarize_job("job-1", RESULTS, prices, "big", 3600.0, 4, None).cost == 1.0 * 1 + 3.0 * 10 + 0.1 * 3

    def test_a_job_with_no_input_has_no_measured_m(self):
        summary = summarize_job("job-2", [_result(False)], PriceTable(), "m", 300.0, 4, None)
        assert (summary.measured_m, summary.cost) == (None, 0.0)
        assert summary.line() == (
            "job-2: 1 requests (1 failed), 0 cached + 0 computed input tokens; M forecast -, "
            "measured -; cost 0.0 uncached-token units (price table builtin)")


class TestForecast:
    def test_the_forecast_and_model_come_from_the_jobs_span(self, tmp_path):
        (tmp_path / "a.jsonl").write_text(
            _span_line("job-0", **{A.COST_FORECAST_M: 0.3})
            + _span_line("job-1")  # no forecast recorded: passed over
            + _span_line("job-1", **{A.COST_FORECAST_M: 0.525, A.GEN_AI_REQUEST_MODEL: "llama"}))
        assert forecast_of("job-1", tmp_path) == (0.525, "llama")
        assert forecast_of("job-9", tmp_path) == (None, "")

    def test_no_trace_directory_means_no_forecast(self, tmp_path):
        assert forecast_of("job-1", tmp_path / "absent") == (None, "")
