"""``open_store``: a prefix store with its memory tier and, when asked, its disk tier.

The one way an engine (and a tool) opens its ``workers.cache.store.PrefixStore``: the sizes
checked, the disk tier's directory opened (and released again when the store cannot be made).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from router.kv.key import Hasher, hash_blocks
from router.kv.ledger import DEFAULT_EVICTION, Eviction
from workers.cache.blocks import KVShape
from workers.cache.disk_tier import DiskTier
from workers.cache.kv_quant import KVCodec
from workers.cache.store import PrefixStore


def open_store(shape: KVShape, block_size: int, ttl_s: float, clock: Callable[[], float], *,
               memory_bytes: int, eviction: Eviction = DEFAULT_EVICTION, kv_bits: int = 0,
               disk_dir: Path | str | None = None, disk_bytes: int = 0, disk_kv_bits: int = 0,
               model: str = "", revision: str = "",
               wall_clock: Callable[[], float] = time.time,
               hasher: Hasher = hash_blocks) -> PrefixStore:
    """A store with a memory tier and, when ``disk_bytes > 0``, a disk tier in ``disk_dir``.

    ``model`` and ``revision`` mark the disk's blocks: another model's are never served.
    """
    disk = None
    if disk_bytes < 0:
        raise ValueError(f"disk_bytes must be >= 0 (0: no disk tier), got {disk_bytes}")
    if disk_bytes:
        if not disk_dir:
            raise ValueError("disk_bytes > 0 needs a disk_dir: set [cache] disk_dir")
        codec = KVCodec(disk_kv_bits, shape.dtype)
        codec.check(shape.head_dim)
        disk = DiskTier(disk_dir, disk_bytes, ttl_s, clock, codec,
                        shape.tier_bytes_per_token(codec), model, revision, eviction,
                        wall_clock)
    try:
        return PrefixStore(shape, block_size, memory_bytes, ttl_s, clock, eviction,
                           kv_bits=kv_bits, disk=disk, hasher=hasher)
    except ValueError:
        if disk is not None:
            disk.close()
        raise
