"""``engine_config``: the ``workers`` engine settings a cluster ``Config`` narrows to, one per
worker, whichever backend opens the engines (in-process or Ray actors)."""
from __future__ import annotations

from cluster.config import Config
from router.kv.key import CacheSecret
from workers.engine.config import EngineConfig


def engine_config(config: Config) -> EngineConfig:
    """The engine settings of ``config``'s workers; creates the run directory (it holds the
    cluster's cache-key secret)."""
    cache = config.cache
    config.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return EngineConfig(cache_secret=CacheSecret.load_or_create(config.run_dir),
                        block_size=cache.block_size, ttl_s=cache.ttl_s,
                        store_bytes=cache.capacity_bytes, eviction=cache.eviction,
                        kv_bits=cache.kv_bits, disk_bytes=cache.disk_bytes,
                        disk_dir=str(config.run_dir / cache.disk_dir),
                        disk_kv_bits=cache.disk_kv_bits, speculate=config.engine.speculate,
                        speculate_max_k=config.engine.speculate_max_k,
                        max_batch=config.engine.max_batch,
                        draft_model=config.engine.draft_model)
