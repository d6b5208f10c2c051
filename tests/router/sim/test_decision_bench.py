"""``router.sim.decision_bench``: the routing-decision micro-benchmark reports the setup it ran
and timings that order as percentiles do, and refuses a setup it cannot run."""
from __future__ import annotations

import pytest

from router.sim.decision_bench import run_decision_bench


class TestWhatTheBenchReports:
    def test_decision_bench_reports_its_setup(self):
        result = run_decision_bench(workers=4, indexed_blocks=2048, block_size=16,
                                    prompt_tokens=512, iterations=50)
        assert result.indexed_blocks >= 2048 and result.workers == 4
        assert 0 < result.route_p50_us <= result.route_p99_us
        assert result.bytes_per_block >= 0 and result.fill_s >= 0 and result.index_bytes == 2 << 30

    def test_the_setup_is_echoed_and_an_empty_index_costs_no_bytes_a_block(self):
        result = run_decision_bench(workers=2, indexed_blocks=0, block_size=16,
                                    prompt_tokens=17, iterations=3, index_bytes=1 << 20)
        assert (result.workers, result.indexed_blocks, result.block_size, result.prompt_tokens,
                result.iterations, result.index_bytes) == (2, 0, 16, 17, 3, 1 << 20)
        assert result.bytes_per_block == 0.0
        pairs = [(result.hash_p50_us, result.hash_p99_us), (result.route_p50_us, result.route_p99_us),
                 (result.total_p50_us, result.total_p99_us),
                 (result.route_cpu_p50_us, result.route_cpu_p99_us),
                 (result.total_cpu_p50_us, result.total_cpu_p99_us)]
        assert all(0 <= p50 <= p99 for p50, p99 in pairs)

    @pytest.mark.parametrize("setup", [dict(workers=0), dict(indexed_blocks=-1),
                                       dict(iterations=0), dict(prompt_tokens=16)])
    def test_a_setup_it_cannot_run_is_refused_saying_what_it_needs(self, setup):
        with pytest.raises(ValueError) as refused:
            run_decision_bench(**{"workers": 1, "indexed_blocks": 0, "block_size": 16,
                                  "prompt_tokens": 32, "iterations": 1, **setup})
        assert str(refused.value) == ("need workers >= 1, indexed blocks >= 0, iterations >= 1 "
                                      "and a prompt longer than one block")
