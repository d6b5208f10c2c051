"""Service models: the engine profile (read, checked, interpolated) and the replay's scaling."""
import json

import pytest

from cluster.bench.replay import ReplaySlice, prompt_tokens, scale_slice
from cluster.cli import main
from router.sim.service import EngineProfile, ProfileService
from router.sim.simulator import SimConfig, replay
from router.sim.trace import TraceRequest, write_trace


def profile(**changes) -> EngineProfile:
    fields = dict(model="tiny", revision="r1", block_size=16, max_batch=8, kv_bytes_per_token=4096,
                  new_tokens=(100, 200), cached_tokens=(0, 1000),
                  prefill_s=((1.0, 2.0), (1.5, 2.5)), batch_sizes=(1, 2), contexts=(100, 1000),
                  step_s=((0.5, 0.8), (0.5, 0.8)), load_s_per_block=(("memory", 0.001),))
    fields.update(changes)
    return EngineProfile(**fields)


def test_the_profile_interpolates_its_grids_and_adds_the_load_and_a_batch_step():
    service = ProfileService(profile())
    assert service.prefill_s(150, 0, 0, 150) == pytest.approx(1.5)
    # halfway in both directions, plus 500 / 16 blocks loaded at 1 ms each
    assert service.prefill_s(150, 500, 0, 650) == pytest.approx(1.75 + 0.03125)
    assert service.prefill_s(300, 0, 0, 300) == pytest.approx(3.0)  # the last segment extended
    assert service.prefill_s(100, 0, 2, 100) == pytest.approx(1.0 + 0.8)  # then one batch step
    assert service.step_s(1, 5000) == 0.5 and service.step_s(3, 100) == pytest.approx(1.1)


def test_a_profile_round_trips_and_refuses_another_model_or_block_size(tmp_path):
    path = tmp_path / "p.json"
    profile().write(path)
    read = EngineProfile.read(path)
    assert read == profile()
    read.check(16, "tiny")
    with pytest.raises(ValueError, match=r"measured with block size 16 \(the run uses 512\) and "
                                         r"model 'tiny' \(the run uses 'other'\)"):
        read.check(512, "other")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 9}))
    with pytest.raises(ValueError, match="expected version 1, got 9"):
        EngineProfile.read(path)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "step_s"}))
    with pytest.raises(ValueError, match="lacks or mistypes a field"):
        EngineProfile.read(path)
    with pytest.raises(ValueError, match="the decode grid is 2 x 2 but its values are not"):
        profile(step_s=((0.5,), (0.5,)))


def test_the_simulator_on_a_profile_waits_for_a_batch_slot_and_reports_itl():
    # max_batch 1: the second request is admitted when the first finishes decoding
    trace = [TraceRequest(0.0, 100, 3, (1,)), TraceRequest(0.0, 100, 3, (2,))]
    config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000,
                       profile=profile(max_batch=1))
    result = replay(trace, "round_robin", config)
    # first: TTFT 1.0 s, two more tokens at 0.5 s each (ends at 2.0); second: 2.0 + 1.0;
    # nearest-rank percentiles of (1.0, 3.0): p50 is the first, p99 the second
    assert (result.ttft_p50_s, result.ttft_p99_s) == (pytest.approx(1.0), pytest.approx(3.0))
    assert result.ttft_mean_s == pytest.approx(2.0) and result.goodput == 0.5
    assert result.itl_p99_s == 0.5


def test_the_simulator_on_a_profile_runs_the_engine_steps_chunked_under_the_decode_budget():
    # prefill 0.01 s per token on any context; a decode step 0.5 s; a stall of 2.0. B (300
    # tokens) arrives while A decodes: its first chunk beside decodes has no rate measured
    # beside decodes, 4 tokens (the floor); then what fits in one decode step at that rate,
    # (2.0 - 1) x 0.5 s x 4 / 0.04 tokens/s = 49 tokens (the rate comes out a hair under 100
    # in floating point), until A finishes, then 512.
    #   t=0     A prefills 100 tokens (1.0 s): first token at 1.0
    #   t=1.0   decode A (token at 1.5) + B's chunk of 4 (0.04 s)
    #   t=1.54  decode A (2.04) + chunk 49;  t=2.53 decode A (3.03, A's last) + chunk 49
    #   t=3.52  B's last 198 tokens (1.98 s): first token at 5.5;  t=5.5 decode B (6.0)
    trace = [TraceRequest(0.0, 100, 4, (1,)), TraceRequest(0.5, 300, 2, (2,))]
    config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, decode_stall=2.0,
                       profile=profile(prefill_s=((1.0, 2.0), (1.0, 2.0)), step_s=((0.5, 0.5),
                                                                                   (0.5, 0.5))))
    result = replay(trace, "round_robin", config)
    assert (result.ttft_p50_s, result.ttft_p99_s) == (pytest.approx(1.0), pytest.approx(5.0))
    # A's gaps 0.5, 0.54, 0.99 (a decode step and a chunk), B's 0.5: nearest-rank p99 0.99
    assert result.itl_p99_s == pytest.approx(0.99)
    assert result.prefill_tokens == 400 and result.hit_ratio == 0.0


def test_speculation_makes_each_decode_step_a_verify_pass_of_several_tokens():
    from router.sim.steps import Speculation

    # max_batch 1: the second request waits for the first's last token. A verify pass of 2
    # drafts costs 0.6 s against a plain step's 0.5 and yields 1 + 1.5 tokens: the first
    # request's 6 decoded tokens take 3 passes (2.5, 2.5, 1), ending at 1.0 + 1.8 s
    verified = profile(max_batch=1, draft_widths=(2,), verify_s=((0.6, 0.9),),
                       verify_context=100)
    trace = [TraceRequest(0.0, 100, 7, (1,)), TraceRequest(0.0, 100, 7, (2,))]
    plain = replay(trace, "round_robin", SimConfig(workers=1, block_size=16,
                                                   capacity_tokens=10_000, profile=verified))
    spec = replay(trace, "round_robin", SimConfig(
        workers=1, block_size=16, capacity_tokens=10_000, profile=verified,
        speculation=Speculation(2, 1.5)))
    assert plain.ttft_p99_s == pytest.approx(1.0 + 6 * 0.5 + 1.0)
    assert spec.ttft_p99_s == pytest.approx(1.0 + 3 * 0.6 + 1.0)
    assert (plain.itl_p99_s, spec.itl_p99_s) == (0.5, pytest.approx(0.6))
    with pytest.raises(ValueError, match="a profile with verify passes"):
        SimConfig(workers=1, block_size=16, capacity_tokens=10_000, profile=profile(),
                  speculation=Speculation(2, 1.5))
    with pytest.raises(ValueError, match="0 <= accepted <= width"):
        Speculation(2, 3.0)


def test_a_prompt_cut_into_chunks_costs_the_profiles_time_for_the_whole_prompt():
    # 0.5 s fixed + 0.01 s per token; a 100-token budget cuts 300 tokens into 3 chunks that
    # cost 1.5 + 1.0 + 1.0 s: the profile's 3.5 s for 300 tokens, the fixed cost once
    trace = [TraceRequest(0.0, 300, 1, (1,))]
    config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, prefill_budget=100,
                       profile=profile(prefill_s=((1.5, 2.5), (1.5, 2.5))))
    assert replay(trace, "round_robin", config).ttft_p50_s == pytest.approx(3.5)


def test_the_forecast_hook_is_refused_on_a_profile():
    config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, profile=profile())
    with pytest.raises(ValueError, match="on_served needs the linear service model"):
        replay([TraceRequest(0.0, 100, 1, (1,))], "round_robin", config,
               on_served=lambda *args: None)


def test_the_simulated_step_budget_defaults_are_the_engines():
    from workers.engine.engine import EngineConfig

    engine, sim = EngineConfig(), SimConfig()
    assert (sim.prefill_budget, sim.decode_stall) == (engine.prefill_budget, engine.decode_stall)


def test_the_simulator_on_a_profile_lets_a_shared_first_block_wait_for_the_older_job():
    # Two 64-token prompts with the same first 32 tokens (two trace blocks of 32) arrive
    # together: the younger waits while the older prefills, then reuses its 32 stored tokens.
    trace = [TraceRequest(0.0, 64, 1, (1, 2)), TraceRequest(0.0, 64, 1, (1, 3))]
    config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, trace_block=32,
                       profile=profile(prefill_s=((1.0, 2.0), (1.0, 2.0))))
    result = replay(trace, "round_robin", config)
    # older: 64 tokens (0.64 s); younger: 2 blocks loaded (1 ms each), 32 new (0.32 s) after
    assert (result.ttft_p50_s, result.ttft_p99_s) == (pytest.approx(0.64), pytest.approx(0.962))
    assert result.hit_ratio == pytest.approx(32 / 128) and result.prefill_tokens == 96


def test_simulate_refuses_a_profile_of_another_block_size(tmp_path, capsys):
    path, trace = tmp_path / "p.json", tmp_path / "t.jsonl"
    profile().write(path)
    write_trace([TraceRequest(0.0, 600, 5, (1, 2))], trace)
    assert main(["simulate", "--trace", str(trace), "--profile", str(path), "--quiet"]) == 2
    assert "measured with block size 16 (the run uses 512)" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace), "--profile", str(path), "--block-size",
                 "16", "--policies", "orchard", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["service"] == "profile" and out["policies"][0]["itl_p99_s"] == 0.5


def test_simulate_spec_takes_width_and_acceptance_on_a_profile_with_verify_passes(
        tmp_path, capsys):
    path, trace = tmp_path / "p.json", tmp_path / "t.jsonl"
    profile(draft_widths=(2,), verify_s=((0.6, 0.9),), verify_context=100).write(path)
    write_trace([TraceRequest(0.0, 100, 5, (1,))], trace)
    base = ["simulate", "--trace", str(trace), "--profile", str(path), "--block-size", "16",
            "--policies", "orchard", "--json", "--quiet"]
    assert main([*base, "--spec", "2:1.5"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"][0]["itl_p99_s"] == pytest.approx(0.6)
    assert main([*base, "--spec", "2"]) == 2
    assert "--spec must be WIDTH:ACCEPTED (e.g. 4:2.5), got '2'" in capsys.readouterr().err
    assert main([*base, "--spec", "2:3"]) == 2
    assert "--spec 2:3: speculation: need width >= 1" in capsys.readouterr().err


def test_scaling_a_slice_divides_tokens_keeps_proportions_and_refuses_empty_requests():
    trace = [TraceRequest(10.0, 1000, 90, (1, 2)), TraceRequest(12.5, 1600, 2, (1, 3, 4)),
             TraceRequest(20.0, 300, 40, (5,))]
    lines = scale_slice(trace, ReplaySlice(start=0, requests=3, scale=4, time_scale=2.0))
    assert [(t.arrival_s, t.input_length, t.output_length) for t in lines] == \
        [(0.0, 250, 22), (5.0, 400, 1), (20.0, 75, 10)]
    with pytest.raises(ValueError, match=r"--scale 512 leaves request 2 \(300 input tokens\) "
                                         r"empty: use a smaller --scale"):
        scale_slice(trace, ReplaySlice(requests=3, scale=512))
    with pytest.raises(ValueError, match="--scale must divide the trace's 512-token blocks"):
        ReplaySlice(scale=3)
    a, b = (prompt_tokens(t, 128, 1000, salt=i) for i, t in enumerate(lines[:2]))
    assert (len(a), len(b)) == (250, 400)
    assert a[:128] == b[:128] and a[128:250] != b[128:250]  # id 1 shared, then 2 against 3
