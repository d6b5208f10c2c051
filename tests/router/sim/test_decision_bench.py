"""``router.sim.decision_bench``: the routing-decision micro-benchmark reports the setup it ran
and timings that order as percentiles do."""
from __future__ import annotations

from router.sim.decision_bench import run_decision_bench


class TestWhatTheBenchReports:
    def test_decision_bench_reports_its_setup(self):
        result = run_decision_bench(workers=4, indexed_blocks=2048, block_size=16,
                                    prompt_tokens=512, iterations=50)
        assert result.indexed_blocks >= 2048 and result.workers == 4
        assert 0 < result.route_p50_us <= result.route_p99_us
        assert result.bytes_per_block >= 0 and result.fill_s >= 0 and result.index_bytes == 2 << 30
