"""Blocks leaving a ``workers.cache.store.PrefixStore``'s memory for its disk tier.

Two ways down, both written behind by the disk tier (``workers.cache.disk_tier``), each
block re-encoded to the disk's precision first when the tiers hold K/V differently:

- ``spill``: a block the memory ledger evicts (or that ``close`` keeps for a restart);
- ``overflow``: a write's blocks that memory had no room for, straight from the request's
  cache, so that a prompt larger than the memory tier is still cached whole.
"""
from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from router.kv.key import BlockHash, ChainIdentities
from router.kv.ledger import BlockLedger
from workers.cache.blocks import BlockSlices, StoredBlock
from workers.cache.disk_files import BlockRecord
from workers.cache.disk_tier import DiskTier
from workers.cache.kv_quant import KVCodec


def spill(disk: DiskTier, h: BlockHash, block: StoredBlock, codec: KVCodec) -> None:
    """Hand ``block`` (held in ``codec``) to ``disk``."""
    keys, values = disk.codec.recode(block.keys, codec), disk.codec.recode(block.values, codec)
    if disk.codec != codec:  # re-encoded: computed here, not on the writer thread
        mx.eval(keys, values)
    record = BlockRecord(h, block.identity, disk.model, disk.revision, disk.codec.bits)
    disk.spill(record, keys, values)


def overflow(disk: DiskTier, memory: BlockLedger, hashes: Sequence[BlockHash],
             want: ChainIdentities, start: int, slices: BlockSlices) -> int:
    """Write blocks ``start`` on, which ``memory`` had no room for, to ``disk``; how many."""
    written = 0
    for i in range(start, len(hashes)):
        h = hashes[i]
        if h in memory or h in disk:
            break  # held already (here or as another block): not written twice
        keys, values = slices.block(i)
        keys, values = disk.codec.encode(keys), disk.codec.encode(values)
        mx.eval(keys, values)
        record = BlockRecord(h, want[i], disk.model, disk.revision, disk.codec.bits)
        if not disk.spill(record, keys, values):
            break
        written += 1
    return written
