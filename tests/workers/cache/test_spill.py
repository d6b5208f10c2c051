"""Blocks leaving memory for the disk tier (``workers.cache.spill``), with real files.

``spill``: a block evicted from memory is re-encoded to the disk's precision when the tiers
differ. ``overflow``: a prompt larger than the memory tier is cached whole, the blocks memory
had no room for written straight to disk.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from router.kv.key import ChainIdentities, hash_blocks
from router.kv.ledger import BlockLedger, Eviction
from workers.cache.blocks import BlockSlices
from workers.cache.disk_files import SUFFIX, block_path
from workers.cache.disk_tier import DiskTier
from workers.cache.kv_quant import KVCodec
from workers.cache.open_store import open_store
from workers.cache.spill import overflow
from workers.cache.store import PrefixStore
from tests.conftest import Clock
from tests.support.prefix_stores import WIDE, WIDE_BS, WIDE_NS, WIDE_TOKENS as TOKENS, random_cache
from tests.support.prefix_stores import BS, NS, SHAPE, kv_for, put

pytestmark = pytest.mark.usefixtures("bounded")  # the disk tier waits on its threads

TTL = 60.0

BLOCK_BYTES = BS * SHAPE.bytes_per_token


def tiered(directory: Path, eviction: Eviction, mem_blocks: int, disk_blocks: int = 100
           ) -> PrefixStore:
    return open_store(SHAPE, BS, TTL, Clock(), memory_bytes=mem_blocks * BLOCK_BYTES,
                      eviction=eviction, disk_dir=directory, disk_bytes=disk_blocks * BLOCK_BYTES,
                      model="m", revision="r1", wall_clock=Clock(1_000_000.0))


class TestSpill:
    def test_a_disk_tier_at_other_precision_re_encodes_on_spill(self, tmp_path):
        block = WIDE_BS * WIDE.bytes_per_token
        store = open_store(WIDE, WIDE_BS, 60.0, lambda: 0.0, memory_bytes=2 * block,
                           eviction="lru", disk_dir=tmp_path / "w", disk_bytes=1 << 20,
                           disk_kv_bits=4, model="m", revision="r1")
        cache = random_cache(32)
        store.write(WIDE_NS, TOKENS, cache)
        store.write(WIDE_NS, list(range(100, 132)), random_cache(32))  # TOKENS spilled, as 4-bit
        store.flush()
        disk = store.stats().disk
        assert disk.ledger.bytes == 32 * 288
        found = store.lookup(WIDE_NS, TOKENS + [99])
        assert (found.report.matched_tokens, found.report.disk_tokens) == (32, 32)
        err = mx.abs(found.cache[0].values[:, :, :32] - cache[0].values[:, :, :32]).max().item()
        assert 0 < err < 0.5
        store.close()


def _five_blocks_and_tiers(tmp_path, disk_blocks: int):
    """A five-block prompt, its hashes, a disk tier of ``disk_blocks`` blocks and a memory
    ledger of 100."""
    prompt = list(range(1, 1 + 5 * BS))
    disk = DiskTier(tmp_path / "w0", disk_blocks * BLOCK_BYTES, TTL, Clock(),
                    KVCodec(0, mx.float32), SHAPE.bytes_per_token, "m", "r1")
    memory = BlockLedger(100 * BLOCK_BYTES, TTL, Clock(), SHAPE.bytes_per_token)
    return prompt, hash_blocks(prompt, BS, NS), disk, memory


class TestOverflow:
    def test_a_prompt_larger_than_memory_is_cached_whole_on_disk(self, tmp_path, eviction):
        store = tiered(tmp_path / "w0", eviction, mem_blocks=2)
        prompt = list(range(1, 1 + 5 * BS))  # five blocks, memory holds two
        assert put(store, prompt) == 5 * BS
        store.flush()
        hashes = hash_blocks(prompt, BS, NS)
        on_disk = sorted(p.name for p in (tmp_path / "w0").glob(f"*/*{SUFFIX}"))
        assert on_disk == sorted(block_path(tmp_path / "w0", h).name for h in hashes[2:])
        report = store.lookup(NS, prompt + [99]).report
        assert (report.matched_tokens, report.disk_tokens) == (5 * BS, 3 * BS)
        store.close()

    def test_overflow_stops_at_a_block_held_in_either_tier(self, tmp_path):
        prompt, hashes, disk, memory = _five_blocks_and_tiers(tmp_path, disk_blocks=100)
        memory.insert([hashes[3]], BS, NS.label(), hashes[2])
        args = (hashes, ChainIdentities(NS, hashes, prompt, BS))
        slices = BlockSlices(kv_for(prompt), BS)
        assert overflow(disk, memory, *args, 1, slices) == 2   # 1 and 2; 3 is in memory
        assert overflow(disk, memory, *args, 0, slices) == 1   # 0; 1 is on disk now
        assert sorted(h.block for h in disk.ledger.holdings()) == sorted(hashes[:3])
        disk.close()

    def test_overflow_stops_at_the_first_block_the_disk_cannot_take(self, tmp_path):
        prompt, hashes, disk, memory = _five_blocks_and_tiers(tmp_path, disk_blocks=2)
        written = overflow(disk, memory, hashes, ChainIdentities(NS, hashes, prompt, BS), 0,
                           BlockSlices(kv_for(prompt), BS))
        assert written == 2  # the third needs its two ancestors kept beside it: no room
        assert sorted(h.block for h in disk.ledger.holdings()) == sorted(hashes[:2])
        disk.close()
