"""The prefix store with a disk tier, exactly: prefetch, promotion back into memory (events,
counts, what a later spill and restart keep), precision changes between tiers, the closest
stored block across tiers, ages and invalidation over both, ``open_store``'s refusals, and a
directory whose blocks' parents loop."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from router.kv.events import BlockStored, Tier
from router.kv.key import BlockIdentity, Namespace, hash_blocks
from router.kv.ledger import Eviction
from workers.cache.disk_files import BlockRecord, block_path, encode_block
from workers.messages import LookupOutcome
from workers.cache.store import open_store

from test_disk_tier import A, B, BLOCK_BYTES, TTL, WALL_START, ha, put, spilled_a, tiered
from test_store import BS, NS, SHAPE, kv_for
from tests.conftest import Clock

pytestmark = pytest.mark.usefixtures("bounded")  # the disk tier waits on its threads

OTHER = Namespace("tenant-b", "m", "r1")


def test_prefetch_starts_the_reads_of_the_blocks_only_the_disk_holds(tmp_path):
    store = spilled_a(tmp_path)
    assert store.stats().disk.prefetched == 0
    assert store.prefetch(NS, A + [9]) == 2
    assert store.stats().disk.prefetched == 2
    assert store.prefetch(NS, A + [9]) == 2  # still on disk, already being read
    assert store.stats().disk.prefetched == 2
    assert store.lookup(NS, A + [9]).report.disk_tokens == 8
    assert store.stats().disk.prefetched == 2  # the lookup started no read of its own
    store.close()


def test_promoted_blocks_are_announced_counted_and_kept_by_a_restart(tmp_path):
    store = tiered(tmp_path / "w0", mem_blocks=2, disk_blocks=2)
    put(store, A)
    put(store, B)  # A to disk
    store.flush()
    store.drain_events()
    a0, a1 = ha()
    b0, b1 = hash_blocks(B, BS, NS)
    assert store.lookup(NS, A + [9]).report.disk_tokens == 8  # A back in memory, B to disk
    stored = [e for e in store.drain_events() if isinstance(e, BlockStored)]
    assert stored == [BlockStored(a0, NS.root(), BS, NS.label()), BlockStored(a1, a0, BS, NS.label()),
                      BlockStored(b1, b0, BS, NS.label(), Tier.DISK),
                      BlockStored(b0, NS.root(), BS, NS.label(), Tier.DISK)]
    assert store.lookup(NS, B + [9]).report.disk_tokens == 8  # and back again
    assert store.written_blocks() == 4  # computed here: A and B once; 4 more were promoted
    assert store.stats().ledger.stored_blocks == 8
    store.close()  # B, promoted, is written from memory: its parent and namespace as read
    again = tiered(tmp_path / "w0", mem_blocks=2, disk_blocks=2)
    assert again.drain_events() == [BlockStored(b1, b0, BS, NS.label(), Tier.DISK),
                                    BlockStored(b0, NS.root(), BS, NS.label(), Tier.DISK)]
    again.close()


def test_a_block_promoted_from_a_4_bit_disk_is_held_at_memory_precision(tmp_path):
    from test_kv_quant import SHAPE as WIDE, BS as WIDE_BS, TOKENS, random_cache

    store = open_store(WIDE, WIDE_BS, 60.0, lambda: 0.0, memory_bytes=2 * WIDE_BS * 2048,
                       disk_dir=tmp_path / "w", disk_bytes=1 << 20, disk_kv_bits=4,
                       model="m", revision="r1")
    cache = random_cache(32)
    store.write(NS, TOKENS, cache)
    store.write(NS, list(range(100, 132)), random_cache(32))  # TOKENS spilled, as 4-bit
    store.flush()
    assert store.lookup(NS, TOKENS + [99]).report.disk_tokens == 32  # promoted
    assert store.stats().tensor_bytes == 32 * 2048  # float32 again: 2 x 2 x 2 x 64 x 4 bytes
    found = store.lookup(NS, TOKENS + [99])  # from memory now
    assert (found.report.matched_tokens, found.report.disk_tokens) == (32, 0)
    for layer in range(WIDE.layers):
        for got, want in ((found.cache[layer].keys, cache[layer].keys),
                          (found.cache[layer].values, cache[layer].values)):
            err = mx.abs(got[:, :, :32] - want[:, :, :32]).max().item()
            assert 0 < err < 0.5  # within 4-bit steps of the original
    store.close()


def test_the_closest_stored_block_is_looked_for_in_both_tiers_memory_first(tmp_path):
    store = tiered(tmp_path / "w0", mem_blocks=2)
    put(store, A)
    put(store, B)  # A's two blocks to disk
    report = store.lookup(NS, [1, 2, 3, 4, 5, 6, 0, 0, 9]).report  # a0 read back; a1 on disk
    assert (report.outcome, report.common_prefix, report.next_stored_token) == (
        LookupOutcome.NEAR_MISS, 6, 7)
    put(store, [1, 2, 3, 4, 5, 6, 9, 9])  # a sibling of a1, in memory
    report = store.lookup(NS, [1, 2, 3, 4, 5, 6, 0, 0, 9]).report  # a tie: 2 tokens each
    assert (report.common_prefix, report.next_stored_token) == (6, 9)
    store.close()


def test_a_hit_ending_in_a_block_memory_could_not_take_is_aged_on_disk(tmp_path):
    c = list(range(1, 13))  # three blocks
    first = tiered(tmp_path / "w0", mem_blocks=10)
    put(first, c)
    first.close()
    for h in hash_blocks(c, BS, NS):  # last used 10 s before the restart
        os.utime(block_path(tmp_path / "w0", h), (WALL_START - 10, WALL_START - 10))
    store = tiered(tmp_path / "w0", mem_blocks=2)
    report = store.lookup(NS, c + [13]).report
    assert (report.matched_tokens, report.disk_tokens, report.entry_age_s) == (12, 12, 10.0)
    assert [h.block for h in store.ledger.holdings()] == hash_blocks(c, BS, NS)[:2]
    store.close()


def test_namespaces_and_invalidation_cover_both_tiers(tmp_path):
    store = tiered(tmp_path / "w0", mem_blocks=2)
    put(store, A, OTHER)
    put(store, B)  # OTHER's blocks to disk
    assert store.namespaces() == sorted([NS.label(), OTHER.label()])
    assert store.invalidate_namespace(OTHER.label()) == 2  # held on disk only
    assert store.namespaces() == [NS.label()]
    put(store, A)  # B to disk as well
    assert store.lookup(NS, A + [9]).report.disk_tokens == 0
    assert store.lookup(NS, B + [9]).report.disk_tokens == 8  # B in both tiers now
    assert store.invalidate_prefix(NS, B) == 2  # b1 in memory and b1 on disk
    store.close()


def test_open_store_refuses_bad_sizes_word_for_word_and_releases_the_directory(tmp_path):
    def refused(**kw) -> str:
        with pytest.raises(ValueError) as info:
            open_store(SHAPE, kw.pop("block_size", BS), TTL, Clock(), memory_bytes=BLOCK_BYTES,
                       **kw)
        return str(info.value)

    assert refused(disk_bytes=-1) == "disk_bytes must be >= 0 (0: no disk tier), got -1"
    assert refused(disk_bytes=1) == "disk_bytes > 0 needs a disk_dir: set [cache] disk_dir"
    assert refused(disk_bytes=1, disk_dir=tmp_path, disk_kv_bits=8) == (
        "8-bit K/V needs head_dim divisible by 64, this model has head_dim 8: set the tier's "
        "kv bits to 0")
    assert refused(block_size=0, disk_bytes=1, disk_dir=tmp_path) == (
        "block_size must be positive, got 0")
    store = open_store(SHAPE, BS, TTL, Clock(), memory_bytes=BLOCK_BYTES, disk_dir=tmp_path,
                       disk_bytes=BLOCK_BYTES, eviction=Eviction.LRU)  # the lock was let go
    assert (store.ledger.policy, store.disk.ledger.policy) == (Eviction.LRU, Eviction.LRU)
    store.close()


def test_open_store_hands_the_memory_tier_its_precision():
    from test_kv_quant import SHAPE as WIDE

    store = open_store(WIDE, 16, TTL, Clock(), memory_bytes=1 << 20, kv_bits=8)
    assert store.stats().bytes_per_token == 544  # 8-bit: 64 + 2 x 2 bytes per head and token


def test_a_store_opened_without_a_model_name_keeps_its_blocks_for_the_same(tmp_path):
    def unnamed(**kw):
        return open_store(SHAPE, BS, TTL, Clock(), memory_bytes=10 * BLOCK_BYTES,
                          disk_dir=tmp_path, disk_bytes=10 * BLOCK_BYTES, **kw)

    store = unnamed()  # model and revision default to ""
    put(store, A)
    store.close()
    again = unnamed(model="", revision="")
    assert (again.stats().disk.start.restored, again.stats().disk.start.foreign) == (2, 0)
    again.close()


def test_blocks_whose_parents_loop_are_dropped_at_restart_as_torn(tmp_path):
    directory = tmp_path / "w0"
    tiered(directory).close()  # the directory, empty
    kv = kv_for([1, 2, 3, 4])
    keys = (mx.stack([c.keys[0, :, :4] for c in kv]),)
    values = (mx.stack([c.values[0, :, :4] for c in kv]),)
    loop = {11: 12, 12: 11, 13: 12, 14: NS.root()}  # 11 and 12 loop; 13 hangs off the loop
    for block, parent in loop.items():
        record = BlockRecord(block, BlockIdentity(NS.label(), parent, 0, (1, 2, 3, 4)), "m", "r1", 0)
        path = block_path(directory, block)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_block(record, keys, values))
    store = tiered(directory)
    start = store.stats().disk.start
    assert (start.restored, start.torn) == (1, 3)
    assert [h.block for h in store.holdings()] == [14]
    assert sorted(p.name for p in directory.glob("*/*.kv")) == [block_path(directory, 14).name]
    store.close()


def test_a_block_spilled_as_its_own_ancestor_is_refused(tmp_path):
    from workers.cache.disk_tier import DiskTier
    from workers.cache.kv_quant import KVCodec

    tier = DiskTier(tmp_path / "w0", 100 * BLOCK_BYTES, TTL, Clock(), KVCodec(0, mx.float32),
                    SHAPE.bytes_per_token, "m", "r1")
    kv = kv_for([1, 2, 3, 4])
    keys = (mx.stack([c.keys[0, :, :4] for c in kv]),)
    values = (mx.stack([c.values[0, :, :4] for c in kv]),)
    mx.eval(keys, values)

    def spill(block: int, parent: int) -> bool:
        identity = BlockIdentity(NS.label(), parent, 0, (1, 2, 3, 4))
        return tier.spill(BlockRecord(block, identity, "m", "r1", 0), keys, values)

    assert spill(21, 22)  # its parent is not held here: taken
    for block, parent in ((22, 21), (23, 23)):  # 22 -> 21 -> 22; 23 -> 23
        with pytest.raises(RuntimeError) as info:
            spill(block, parent)
        assert str(info.value) == (f"disk tier {tmp_path / 'w0'}: block {block:032x} would be "
                                   "its own ancestor (a broken hash chain); it was not spilled")
    assert [h.block for h in tier.ledger.holdings()] == [21]
    tier.close()
