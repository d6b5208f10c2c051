"""The disk tier benchmark runs end to end on a tiny model and reads the prefix from disk."""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)

from tests.support.forged_models import tiny_model
from workers.lab.disk_bench import bench_disk


def test_the_disk_trials_read_the_whole_prefix_from_disk():
    lines: list[str] = []
    r = bench_disk(tiny_model(), prefix_tokens=64, trials=2, decode_tokens=8, spill_tokens=128,
                   progress=lines.append)
    assert r.disk_tokens_per_trial == (64, 64)
    trials = [line for line in lines if line.startswith("trial ")]
    assert [t.split(":")[0] for t in trials] == ["trial 1/2", "trial 2/2"]
    assert all("(64 tokens from disk)" in t for t in trials)
    assert len([line for line in lines if line.startswith("pair ")]) == 3
    assert r.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert r.read_mb > 0 and r.write_mb_s > 0 and r.spill_mb > 0
    assert r.ttft_disk_s > 0 and r.tpot_alone_s > 0 and r.tpot_with_spill_s > 0
    # what the router would charge per disk token on this engine, from its measured rates
    assert r.tier_read_mb_s > 0 and r.prefill_tokens_s > 0
    assert r.disk_token_cost == pytest.approx(
        r.bytes_per_token / (r.tier_read_mb_s * 1e6) * r.prefill_tokens_s, rel=1e-12)
