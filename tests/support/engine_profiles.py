"""A small measured engine profile (``router.sim.service.EngineProfile``) with round numbers,
for the simulator's profile service and step loop and for ``orchard simulate --profile``."""
from __future__ import annotations

from router.sim.service import EngineProfile


def profile(**changes) -> EngineProfile:
    fields = dict(model="tiny", revision="r1", block_size=16, max_batch=8, kv_bytes_per_token=4096,
                  new_tokens=(100, 200), cached_tokens=(0, 1000),
                  prefill_s=((1.0, 2.0), (1.5, 2.5)), batch_sizes=(1, 2), contexts=(100, 1000),
                  step_s=((0.5, 0.8), (0.5, 0.8)), load_s_per_block=(("memory", 0.001),))
    fields.update(changes)
    return EngineProfile(**fields)
