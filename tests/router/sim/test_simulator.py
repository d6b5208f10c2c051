"""Trace replay: trace parsing, the ideal figure, side-by-side policies, the CLI.

The simulator's disk tier: evicted blocks served from disk, at their load time.

The figures a replay reports, and the settings it refuses.
"""
from __future__ import annotations

import json
from dataclasses import replace
import pytest
from cluster.cli import main
from router.sim.simulator import SimConfig, ideal_hit_ratio, replay, simulate, to_requests
from router.sim.policies import POLICY_NAMES
from router.sim.trace import SynthShape, TraceRequest, load_trace, synthesize, write_trace
from router.sim.simulator import SimConfig, replay
from router.sim.trace import TraceRequest
from tests.support.engine_profiles import profile


SMALL = SynthShape(requests=400, rate_per_s=4.0, system_prompts=2, system_blocks=(1,),
                   new_conversation=0.3, turn_blocks=(2, 6), think_s=(5.0, 60.0))

def line(ts: int, n_in: int, ids: list[int], n_out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": ids})

@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "small.jsonl"
    write_trace(synthesize(SMALL, seed=3), path)
    return path


class TestBehaviour:
    def test_a_bad_line_is_named_and_stops_the_load(self, tmp_path):
        path = tmp_path / "bad.jsonl"
        path.write_text(line(0, 600, [1, 2]) + "\n{not json\n")
        with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
            load_trace(path)
        path.write_text(line(0, 600, [1, 2]) + "\n" + json.dumps({"timestamp": 5}) + "\n")
        with pytest.raises(ValueError, match=r":2: missing field\(s\) input_length"):
            load_trace(path)
        path.write_text(line(5, 600, [1]) + "\n" + line(1, 600, [1]) + "\n")
        with pytest.raises(ValueError, match=":2: timestamps must not go backwards"):
            load_trace(path)
        with pytest.raises(FileNotFoundError):
            load_trace(tmp_path / "missing.jsonl")

    def test_ideal_counts_every_listed_block_and_never_the_whole_prompt(self):
        trace = [TraceRequest(0.0, 1024, 1, (1, 2)),         # cold
                 TraceRequest(1.0, 1500, 1, (1, 2, 3)),      # 1024 of 1500
                 TraceRequest(2.0, 1024, 1, (1, 2))]         # exact repeat: 1023 of 1024
        assert ideal_hit_ratio(trace) == pytest.approx((1024 + 1023) / (1024 + 1500 + 1024))

    def test_only_full_blocks_reach_the_workers_and_bigger_blocks_group_ids(self):
        reqs = to_requests([TraceRequest(0.0, 1300, 1, (7, 8, 9))], 512)
        assert len(reqs[0].hashes) == 2  # the 276-token tail is never stored
        assert len(to_requests([TraceRequest(0.0, 2100, 1, (1, 2, 3, 4, 5))], 1024)[0].hashes) == 2
        # a smaller block splits each trace block: 1300 tokens hold 5 full blocks of 256
        small = to_requests([TraceRequest(0.0, 1300, 1, (7, 8, 9))], 256)[0].hashes
        assert small == (16, 17, 18, 19, 20)  # (id + 1) x 2 + place: ids 7, 7, 8, 8, 9
        with pytest.raises(ValueError, match="multiple or a divisor of the trace's 512"):
            to_requests([], 384)

    def test_policies_side_by_side_on_a_small_trace(self, small_trace):
        trace = load_trace(small_trace)
        config = SimConfig(workers=4, capacity_tokens=100_000, prefill_tps=4000.0)
        summary = simulate(trace, POLICY_NAMES, config, quiet=True)
        assert set(summary) >= {"ideal_hit_ratio", "policies"}
        rows = {r["name"]: r for r in summary["policies"]}
        assert list(rows) == list(POLICY_NAMES)
        for r in rows.values():
            assert set(r) >= {"name", "goodput", "hit_ratio", "prefill_tokens", "imbalance",
                              "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "decision_p50_us",
                              "decision_p99_us"}
            assert 0.0 <= r["goodput"] <= 1.0
            assert 0.0 <= r["hit_ratio"] <= summary["ideal_hit_ratio"]
            assert r["imbalance"] >= 1.0 and r["ttft_p99_s"] >= r["ttft_p50_s"] >= 0.0
        assert rows["orchard"]["hit_ratio"] > rows["round_robin"]["hit_ratio"] + 0.2
        assert rows["orchard"]["goodput"] > rows["round_robin"]["goodput"]

    def test_replay_is_deterministic_for_a_seed(self, small_trace):
        trace = load_trace(small_trace, limit=150)
        config = SimConfig(workers=3, capacity_tokens=50_000)
        a, b = replay(trace, "orchard", config), replay(trace, "orchard", config)
        assert (a.hit_ratio, a.imbalance, a.ttft_p99_s, a.reasons) == \
               (b.hit_ratio, b.imbalance, b.ttft_p99_s, b.reasons)

    def test_a_small_index_budget_forgets_and_costs_hits_never_more(self, small_trace):
        from router.index import PrefixIndex

        trace = load_trace(small_trace, limit=300)
        config = SimConfig(workers=3, capacity_tokens=50_000, block_size=256)
        full = replay(trace, "orchard", config)
        small = replay(trace, "orchard", replace(config, index_bytes=PrefixIndex.bytes_for(40, 3)))
        assert full.index_dropped == 0 and small.index_dropped > 0
        assert small.hit_ratio < full.hit_ratio
        assert replay(trace, "round_robin", config).index_dropped is None

    def test_cli_prints_one_json_object(self, small_trace, capsys):
        code = main(["simulate", "--trace", str(small_trace), "--workers", "3", "--limit", "120",
                     "--policies", "orchard,round_robin", "--json", "--quiet"])
        assert code == 0
        out = json.loads(capsys.readouterr().out)
        assert [p["name"] for p in out["policies"]] == ["orchard", "round_robin"]

    def test_cli_bad_input_is_an_error_message_not_a_traceback(self, tmp_path, capsys):
        path = tmp_path / "t.jsonl"
        path.write_text(line(0, 600, [1]) + "\n" + "[1, 2]\n")
        assert main(["simulate", "--trace", str(path), "--quiet"]) == 2
        assert "t.jsonl:2: expected a JSON object" in capsys.readouterr().err
        assert main(["simulate", "--trace", str(path), "--policies", "nope"]) == 2
        assert "unknown policy nope" in capsys.readouterr().err
        assert main(["simulate", "--trace", str(path), "--decision-bench"]) == 2
        assert "at most one of" in capsys.readouterr().err
        assert main(["simulate", "--trace", str(path), "--ttft-slo-s", "0", "--quiet"]) == 2
        assert "--ttft-slo-s must be positive" in capsys.readouterr().err


TRACE = [TraceRequest(0.0, 1025, 1, (1, 2)),     # cold: stores blocks 1, 2
         TraceRequest(100.0, 1025, 1, (3, 4)),   # cold: evicts 1, 2 from a 2-block memory
         TraceRequest(200.0, 1025, 1, (1, 2))]   # 1, 2 again: on disk, or gone

def config(disk_tokens: int) -> SimConfig:
    return SimConfig(workers=1, capacity_tokens=1024, block_size=512,
                     disk_capacity_tokens=disk_tokens, disk_read_gbps=2.0,
                     kv_bytes_per_token=46_080)


class TestSimDisk:
    def test_a_block_evicted_from_memory_is_served_from_disk_at_its_load_time(self):
        memory_only = replay(TRACE, "orchard", config(0))
        tiered = replay(TRACE, "orchard", config(100 * 512))
        assert memory_only.hit_ratio == 0.0
        assert tiered.hit_ratio == 1024 / (3 * 1025)
        service = config(0).service()
        cold = service.prefill_s(1025, 0, 0, 1025)
        from_disk = 1024 * 46_080 / 2e9 + service.prefill_s(1, 1024, 0, 1025)
        assert tiered.ttft_mean_s == pytest.approx((2 * cold + from_disk) / 3, rel=1e-12)
        assert memory_only.ttft_mean_s == pytest.approx(cold, rel=1e-12)

    def test_disk_flags_are_checked(self):
        with pytest.raises(ValueError, match="--disk-read-gbps"):
            SimConfig(disk_read_gbps=0)


class TestBreakpointsAndSessions:
    A = (0, 1, 2, 3, 4)  # 4 full blocks and a tail

    def test_a_breakpoint_writes_only_the_blocks_before_it(self):
        trace = [TraceRequest(0.0, 4 * 512 + 100, 10, self.A, write_blocks=2),
                 TraceRequest(100.0, 4 * 512 + 100, 10, self.A)]
        served = []
        result = replay(trace, "orchard", SimConfig(workers=1),
                        on_served=lambda i, w, cached, written: served.append((cached, written)))
        assert served == [(0, 2 * 512), (2 * 512, 2 * 512)]
        assert result.hit_ratio == 1024 / (2 * 2148)

    def test_a_session_key_keeps_cold_prompts_on_the_session_worker(self):
        def workers(session: str) -> set[str]:
            trace = [TraceRequest(100.0 * i, 4 * 512, 10, (10 * i, 10 * i + 1, 10 * i + 2,
                                                           10 * i + 3), session=session)
                     for i in range(10)]
            seen = set()
            replay(trace, "orchard", SimConfig(workers=2),
                   on_served=lambda i, w, cached, written: seen.add(w))
            return seen

        assert workers("") == {"w0", "w1"}  # each cold prompt at its hash home
        assert len(workers("agent-session-1")) == 1


class TestTheFigures:
    def test_goodput_counts_requests_within_the_ttft_target_and_prefill_is_summed(self):
        # One worker at 1000 tokens/s: the first prompt's TTFT is 1.0 s; the second waits for it,
        # then prefills 2000 tokens slowed 1% by the first one's running decode: 3.02 s.
        trace = [TraceRequest(0.0, 1000, 50, (1, 2)), TraceRequest(0.0, 2000, 50, (3, 4, 5, 6))]
        config = SimConfig(workers=1, capacity_tokens=10_000, prefill_tps=1000.0, ttft_slo_s=2.0)
        result = replay(trace, "round_robin", config)
        assert result.goodput == 0.5
        assert result.prefill_tokens == 3000
        assert result.ttft_mean_s == pytest.approx((1.0 + 3.02) / 2)
        relaxed = replay(trace, "round_robin", SimConfig(workers=1, capacity_tokens=10_000,
                                                         prefill_tps=1000.0, ttft_slo_s=3.1))
        assert relaxed.goodput == 1.0


class TestWhatReplayRefuses:
    def test_the_forecast_hook_is_refused_on_a_profile(self):
        config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, profile=profile())
        with pytest.raises(ValueError, match="on_served needs the linear service model"):
            replay([TraceRequest(0.0, 100, 1, (1,))], "round_robin", config,
                   on_served=lambda *args: None)

    def test_a_negative_link_is_refused_naming_the_flags(self):
        with pytest.raises(ValueError, match="--link-gbps and --link-fixed-ms must be >= 0"):
            SimConfig(link_gbps=-1.0)
