"""``router.sim.steps``: the engine's step loop as ``orchard simulate --profile`` times it, on
a measured profile with round numbers: admission up to ``max_batch``, chunked prefill under the
decode budget, speculation's verify passes, a prompt's chunks costing its whole prompt, and a
shared first block waiting for the older job."""
from __future__ import annotations

import pytest

from router.sim.simulator import SimConfig, replay
from router.sim.trace import TraceRequest
from tests.support.engine_profiles import profile


class TestTheStepLoop:
    def test_the_simulator_on_a_profile_waits_for_a_batch_slot_and_reports_itl(self):
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

    def test_the_simulator_on_a_profile_runs_the_engine_steps_chunked_under_the_decode_budget(self):
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

    def test_a_prompt_cut_into_chunks_costs_the_profiles_time_for_the_whole_prompt(self):
        # 0.5 s fixed + 0.01 s per token; a 100-token budget cuts 300 tokens into 3 chunks that
        # cost 1.5 + 1.0 + 1.0 s: the profile's 3.5 s for 300 tokens, the fixed cost once
        trace = [TraceRequest(0.0, 300, 1, (1,))]
        config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, prefill_budget=100,
                           profile=profile(prefill_s=((1.5, 2.5), (1.5, 2.5))))
        assert replay(trace, "round_robin", config).ttft_p50_s == pytest.approx(3.5)

    def test_the_simulator_on_a_profile_lets_a_shared_first_block_wait_for_the_older_job(self):
        # Two 64-token prompts with the same first 32 tokens (two trace blocks of 32) arrive
        # together: the younger waits while the older prefills, then reuses its 32 stored tokens.
        trace = [TraceRequest(0.0, 64, 1, (1, 2)), TraceRequest(0.0, 64, 1, (1, 3))]
        config = SimConfig(workers=1, block_size=16, capacity_tokens=10_000, trace_block=32,
                           profile=profile(prefill_s=((1.0, 2.0), (1.0, 2.0))))
        result = replay(trace, "round_robin", config)
        # older: 64 tokens (0.64 s); younger: 2 blocks loaded (1 ms each), 32 new (0.32 s) after
        assert (result.ttft_p50_s, result.ttft_p99_s) == (pytest.approx(0.64), pytest.approx(0.962))
        assert result.hit_ratio == pytest.approx(32 / 128) and result.prefill_tokens == 96

    def test_the_simulated_step_budget_defaults_are_the_engines(self):
        from workers.engine.engine import EngineConfig

        engine, sim = EngineConfig(), SimConfig()
        assert (sim.prefill_budget, sim.decode_stall) == (engine.prefill_budget, engine.decode_stall)


class TestSpeculation:
    def test_speculation_makes_each_decode_step_a_verify_pass_of_several_tokens(self):
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
