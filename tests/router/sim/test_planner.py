"""``orchard plan``: a grid whose answer is known, priced exactly, and bad input.

The workload: two prompts A and B of 4 full 512-token blocks plus a 100-token tail
(2,148 tokens), alternating A B A B ... 100 s apart, so nothing ever queues. At 6,000
prefill tokens/s a miss takes 2148/6000 = 0.358 s and a hit (100 new tokens, plus the disk
load of 2048 x 46,080 bytes at 2 GB/s = 0.047 s when read from disk) under 0.07 s; the TTFT
target is 0.2 s, so goodput is the share of hits. The first A and B always miss: at most 6 of
8 requests hit (goodput 0.75).

- one worker, 2,048 memory tokens (one prompt), no disk: A and B evict each other, nothing hits;
- 2,048 memory + 4,096 disk: the evicted prompt waits on disk, every later request hits;
- 4,096 memory: both prompts stay in memory;
- TTL 50 s (< the 100 s between requests): everything expires, nothing hits.
"""
import json

import pytest

from cluster.cli import main
from router.cost import Rates
from router.sim.planner import (Bound, Grid, Point, RecordedRequest, ideal_goodput, plan,
                                trace_from_spans)
from router.sim.simulator import SimConfig
from router.sim.trace import TraceRequest

A = (0, 1, 2, 3, 4)
B = (5, 6, 7, 8, 9)
INPUT = 4 * 512 + 100
SLO = 0.2
RATES = Rates()  # uncached 1, read 0.1, write 1.25 (5 min) / 2.0 (1 h)


def workload() -> list[TraceRequest]:
    return [TraceRequest(100.0 * i, INPUT, 10, A if i % 2 == 0 else B) for i in range(8)]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "ab.jsonl"
    path.write_text("".join(json.dumps({"timestamp": int(t.arrival_s * 1000),
                                        "input_length": t.input_length,
                                        "output_length": t.output_length,
                                        "hash_ids": list(t.hash_ids)}) + "\n"
                            for t in workload()))
    return path


GRID = Grid(workers=(1,), memory_tokens=(2048, 4096), disk_tokens=(0, 4096), ttls_s=(50, 3600))


def test_the_known_grid_answer_with_exact_prices():
    result = plan(workload(), GRID, SimConfig(ttft_slo_s=SLO), RATES, goodput=0.75, jobs=1)
    by_point = {o.point: o for o in result.outcomes}
    assert len(by_point) == 8
    # every expiring (TTL 50 s) or too small configuration misses everything: each request
    # writes its 4 blocks, priced at the TTL's rate
    for point, outcome in by_point.items():
        if point.ttl_s == 50 or point == Point(1, 2048, 0, 3600):
            assert (outcome.goodput, outcome.hit_ratio, outcome.meets) == (0.0, 0.0, False)
            write = 1.25 if point.ttl_s == 50 else 2.0
            assert outcome.multiplier == pytest.approx((100 + 2048 * write) / INPUT)
    # the hits: 6 of 8 requests read 2,048 tokens; only the first A and B wrote theirs
    hit = (100 * 8 + 2 * 2048 * 2.0 + 6 * 2048 * 0.1) / (8 * INPUT)
    for point in (Point(1, 2048, 4096, 3600), Point(1, 4096, 0, 3600), Point(1, 4096, 4096, 3600)):
        outcome = by_point[point]
        assert outcome.goodput == 0.75 and outcome.meets
        assert outcome.hit_ratio == pytest.approx(6 * 2048 / (8 * INPUT))
        assert outcome.multiplier == pytest.approx(hit)
    smallest = [o.point for o in result.feasible()]
    assert smallest == [Point(1, 2048, 4096, 3600), Point(1, 4096, 0, 3600),
                        Point(1, 4096, 4096, 3600)]
    # asking for more than 6 of 8 requests within the target: nothing in this grid meets it
    assert plan(workload(), GRID, SimConfig(ttft_slo_s=SLO), RATES, 0.8, jobs=1).feasible() == []


MISS_S, HIT_S = INPUT / 6000, 100 / 6000  # the prefill of a whole prompt, of its tail


def test_the_ideal_cluster_bounds_every_grid():
    # The first A and B are never seen before (a whole prompt each); every later request
    # knows its 4 blocks and prefills its 100-token tail: 6 of 8 within the target.
    assert ideal_goodput(workload(), SimConfig(ttft_slo_s=SLO), 0.75) == Bound(0.75, HIT_S)
    # 7 of 8 (nearest rank) needs the TTFT of a whole prompt
    assert ideal_goodput(workload(), SimConfig(ttft_slo_s=SLO), 0.8) == Bound(0.75, MISS_S)


def test_nothing_meets_the_target_the_nearest_points_and_what_they_miss_by():
    result = plan(workload(), GRID, SimConfig(ttft_slo_s=SLO), RATES, 0.8, jobs=1)
    nearest = result.nearest()
    # the three that reach 6 of 8, smallest first
    assert [o.point for o in nearest] == [Point(1, 2048, 4096, 3600), Point(1, 4096, 0, 3600),
                                          Point(1, 4096, 4096, 3600)]
    # each meets 7 of 8 requests only at a whole prompt's prefill
    assert [o.ttft_at_target_s for o in nearest] == [pytest.approx(MISS_S)] * 3
    out = result.as_json()
    assert out["ideal"] == {"goodput": 0.75, "ttft_at_target_s": round(MISS_S, 3)}
    assert [n["misses_by"] for n in out["nearest"]] == [0.05] * 3


def test_the_grid_replayed_in_processes_is_the_grid_replayed_here():
    here = plan(workload(), GRID, SimConfig(ttft_slo_s=SLO), RATES, 0.75, jobs=1)
    spread = plan(workload(), GRID, SimConfig(ttft_slo_s=SLO), RATES, 0.75, jobs=2)
    assert spread.outcomes == here.outcomes


def test_a_second_worker_is_not_smaller_than_a_disk_tier():
    grid = Grid(workers=(1, 2), memory_tokens=(2048,), disk_tokens=(0, 4096), ttls_s=(3600,))
    result = plan(workload(), grid, SimConfig(ttft_slo_s=SLO), RATES, goodput=0.75, jobs=1)
    assert result.feasible()[0].point == Point(1, 2048, 4096, 3600)


def test_cli_json_and_table_and_plot(trace_file, tmp_path, capsys):
    args = ["plan", "--trace", str(trace_file), "--ttft-slo-s", str(SLO), "--goodput", "0.75",
            "--workers", "1", "--memory-tokens", "2048,4096", "--disk-tokens", "0,4096",
            "--ttls-s", "50,3600", "--jobs", "1"]
    assert main([*args, "--json", "--plot", str(tmp_path / "plan.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 8 and out["source_requests"] == 8
    assert [(r["memory_tokens"], r["disk_tokens"], r["ttl_s"]) for r in out["smallest"]] == [
        (2048, 4096, 3600), (4096, 0, 3600), (4096, 4096, 3600)]
    assert out["smallest"][0]["goodput"] == 0.75 and len(out["grid"]) == 8
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*args, "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "all 8 requests; 8 configurations replayed" in text
    assert "(2 more meet the target: --top N or --json)" in text
    assert main([*args, "--requests", "4"]) == 0
    text = capsys.readouterr().out
    assert "the first 4 of 8 requests" in text
    # 4 requests: the two that hit are half; 0.75 is out of reach, even for an ideal cluster
    assert "no configuration meets" in text and "the best reaches 50.0%" in text
    assert ("an ideal cluster (every token seen before cached, no queue) meets TTFT <= 0.2 s "
            "for 50.0% of requests") in text
    assert f"75% is reachable from TTFT <= {MISS_S:.2f} s" in text
    assert "the nearest configurations" in text and "25.0%" in text  # short by


def test_the_two_ttls_compared_on_the_planned_workload(trace_file, capsys):
    # A and B each come back 200 s after their last use: every re-read is within 5 minutes,
    # so the hour's dearer writes buy nothing
    args = ["plan", "--trace", str(trace_file), "--ttft-slo-s", str(SLO), "--goodput", "0.75",
            "--workers", "1", "--memory-tokens", "4096", "--disk-tokens", "0",
            "--ttls-s", "3600", "--jobs", "1"]
    assert main([*args, "--json"]) == 0
    ttls = json.loads(capsys.readouterr().out)["ttl_comparison"]
    m = {ttl: (800 + 2 * 2048 * write + 6 * 2048 * 0.1) / (8 * INPUT)
         for ttl, write in (("5m", 1.25), ("1h", 2.0))}
    assert ttls == {"ttls_s": [300.0, 3600.0], "m_5m": round(m["5m"], 4),
                    "m_1h": round(m["1h"], 4),
                    "cost_per_request_5m": round(m["5m"] * INPUT, 2),
                    "cost_per_request_1h": round(m["1h"] * INPUT, 2),
                    "reread_tokens": 6 * 2048, "late_reread_tokens": 0,
                    "late_reread_share": 0.0, "late_rereads_per_1h_write": 0.0,
                    "break_even_rereads_per_1h_write": 0.6522, "recommended_ttl_s": 300.0}
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "5-minute against 1-hour writes on this workload" in text
    assert "0.0% of re-reads arrive after 5 minutes" in text
    assert "recommended TTL 5 min" in text


@pytest.mark.parametrize("extra, message", [
    (["--workers", ""], "--workers is empty"),
    (["--ttls-s", ","], "--ttls-s is empty"),
    (["--goodput", "0"], "--goodput is a share of requests in (0, 1]"),
    (["--goodput", "1.5"], "--goodput is a share of requests in (0, 1]"),
    (["--disk-tokens", "-1"], "--disk-tokens must all be >= 0"),
    (["--requests", "-3"], "--requests must be >= 0"),
    (["--policy", "nope"], "unknown --policy nope"),
    (["--jobs", "-1"], "--jobs must be >= 0"),
])
def test_bad_grid_and_targets_are_clear_errors(trace_file, capsys, extra, message):
    assert main(["plan", "--trace", str(trace_file), *extra]) == 2
    assert message in capsys.readouterr().err


def test_unknown_trace_and_empty_run_are_clear_errors(tmp_path, capsys):
    assert main(["plan", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl' not found" in capsys.readouterr().err
    assert main(["plan", "--run-dir", str(tmp_path / "norun")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "run" / "traces").mkdir(parents=True)
    assert main(["plan", "--run-dir", str(tmp_path / "run")]) == 2
    assert "record no finished requests" in capsys.readouterr().err


def test_recorded_requests_become_a_trace():
    rows = [RecordedRequest(3_500_000_000, 40, 4, ("aa", "bb"), 16),
            RecordedRequest(1_000_000_000, 20, 2, ("aa",), 16),
            RecordedRequest(2_000_000_000, 0, 0, (), 16)]  # failed before prefill: left out
    trace, block = trace_from_spans(rows)
    assert block == 16
    assert trace == [TraceRequest(0.0, 20, 2, (0,)), TraceRequest(2.5, 40, 4, (0, 1))]
    with pytest.raises(ValueError, match="several block sizes"):
        trace_from_spans([*rows, RecordedRequest(4, 40, 1, ("cc",), 32)])


def test_plan_for_the_requests_a_run_recorded(tmp_path, capsys):
    """Request spans written as a cluster writes them (OTLP JSON lines under RUN/traces), the
    same A B A B workload in 16-token blocks: 68-token prompts, a miss 11 ms, a hit under 1 ms."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from cluster.telemetry import attrs as attr
    from cluster.telemetry.otlp_json import JsonLinesSpanExporter

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(
        JsonLinesSpanExporter(tmp_path / "traces", "orchard-frontend")))
    tracer = provider.get_tracer("test")
    for i in range(8):
        prefix = "a" if i % 2 == 0 else "b"
        start = 1_000_000_000_000 + i * 100_000_000_000
        span = tracer.start_span("request", start_time=start, attributes={
            attr.SPAN_KIND: "request", attr.GEN_AI_INPUT_TOKENS: 68, attr.GEN_AI_OUTPUT_TOKENS: 3,
            attr.PROMPT_BLOCKS: [f"{prefix}{k:015x}" for k in range(4)], attr.BLOCK_SIZE: 16})
        span.end(end_time=start + 50_000_000)
    provider.shutdown()
    assert main(["plan", "--run-dir", str(tmp_path), "--ttft-slo-s", "0.005", "--goodput", "0.75",
                 "--workers", "1", "--memory-tokens", "64,128", "--disk-tokens", "0",
                 "--ttls-s", "3600", "--jobs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 8 and out["source"] == f"{tmp_path}/traces"
    assert [(r["memory_tokens"], r["goodput"], r["hit_ratio"]) for r in out["grid"]] == [
        (64, 0.0, 0.0), (128, 0.75, round(6 * 64 / (8 * 68), 4))]
    assert [r["memory_tokens"] for r in out["smallest"]] == [128]


def test_a_plan_with_pulls_against_one_without(tmp_path, capsys):
    # a 4,096-token document and a question each, 20 a second, on 2 workers: the second
    # worker pulls the document (0.15 s at 10 Gbit/s) instead of prefilling it (0.68 s)
    hot = [TraceRequest(i * 0.05, 9 * 512, 4, tuple(range(1, 9)) + (1000 + i,))
           for i in range(60)]
    path = tmp_path / "hot.jsonl"
    path.write_text("".join(json.dumps({"timestamp": int(round(t.arrival_s * 1000)),
                                        "input_length": t.input_length, "output_length": 4,
                                        "hash_ids": list(t.hash_ids)}) + "\n" for t in hot))
    args = ["plan", "--trace", str(path), "--workers", "2", "--memory-tokens", "1000000",
            "--disk-tokens", "0", "--ttls-s", "3600", "--ttft-slo-s", "0.5", "--json"]
    runs = {}
    for link in ("0", "10"):
        assert main([*args, "--link-gbps", link]) == 0
        out = json.loads(capsys.readouterr().out)
        runs[out["link_gbps"]] = out["grid"][0]["goodput"]
    assert runs == {0.0: 0.1667, 10.0: 0.8833}   # 10 of 60 within 0.5 s, then 53 of 60
