"""The simulator's disk tier: evicted blocks served from disk, at their load time."""
from __future__ import annotations

import pytest

from router.sim.simulator import SimConfig, replay
from router.sim.trace import TraceRequest

TRACE = [TraceRequest(0.0, 1025, 1, (1, 2)),     # cold: stores blocks 1, 2
         TraceRequest(100.0, 1025, 1, (3, 4)),   # cold: evicts 1, 2 from a 2-block memory
         TraceRequest(200.0, 1025, 1, (1, 2))]   # 1, 2 again: on disk, or gone


def config(disk_tokens: int) -> SimConfig:
    return SimConfig(workers=1, capacity_tokens=1024, block_size=512,
                     disk_capacity_tokens=disk_tokens, disk_read_gbps=2.0,
                     kv_bytes_per_token=46_080)


def test_a_block_evicted_from_memory_is_served_from_disk_at_its_load_time():
    memory_only = replay(TRACE, "orchard", config(0))
    tiered = replay(TRACE, "orchard", config(100 * 512))
    assert memory_only.hit_ratio == 0.0
    assert tiered.hit_ratio == 1024 / (3 * 1025)
    service = config(0).service()
    cold = service.prefill_s(1025, 0, 0, 1025)
    from_disk = 1024 * 46_080 / 2e9 + service.prefill_s(1, 1024, 0, 1025)
    assert tiered.ttft_mean_s == pytest.approx((2 * cold + from_disk) / 3, rel=1e-12)
    assert memory_only.ttft_mean_s == pytest.approx(cold, rel=1e-12)


def test_disk_flags_are_checked():
    with pytest.raises(ValueError, match="--disk-read-gbps"):
        SimConfig(disk_read_gbps=0)
