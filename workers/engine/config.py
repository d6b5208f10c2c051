"""``EngineConfig``: what one engine is opened with, narrowed from the cluster's ``Config``
(``cluster.config.engine_config``) or given by a tool. Frozen; the runtime sets ``worker_id``
to the id it opens the engine under."""
from __future__ import annotations

from dataclasses import dataclass, field

from router.kv.ledger import DEFAULT_EVICTION, Eviction


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    store_bytes: int = 1 << 30
    ttl_s: float = 300.0
    eviction: Eviction = DEFAULT_EVICTION   # the store's eviction policy
    kv_bits: int = 0           # memory tier K/V: 0 (model dtype), 8 or 4 bits
    disk_bytes: int = 0        # disk tier budget; 0: no disk tier
    disk_dir: str = ""         # the disk tier lives in disk_dir/<worker_id>
    disk_kv_bits: int = 0      # disk tier K/V: 0, 8 or 4 bits
    use_store: bool = True     # False: every request computes its whole prompt
    kept_bytes: int = 256 << 20  # finished requests' whole caches (workers.engine.kept); 0: none
    max_batch: int = 32        # requests in prefill or decoding at once
    prefill_budget: int = 512  # prompt tokens prefilled per step (workers.engine.scheduler)
    decode_stall: float = 1.8  # while requests decode, a step takes about this many decode steps
    speculate: bool = False    # prompt-lookup drafts verified in the decode batch
    speculate_max_k: int = 8   # the widest verify pass (1 to 8); each step picks its width
    draft_model: str = ""      # a draft model directory (workers.engine.draft_model); "": lookup
    worker_id: str = ""
    # The cluster's cache-key secret (router.kv.key.CacheSecret): it enters every namespace's
    # root, so only the cluster computes block hashes. Empty: unkeyed (a lone engine, tools).
    cache_secret: bytes = field(default=b"", repr=False)

