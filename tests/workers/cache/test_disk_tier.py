"""The disk tier: spill, read back, restart, TTL, invalidation, and every fault, with real files.

The prefix store with a disk tier, exactly: prefetch, promotion back into memory (events,
counts, what a later spill and restart keep), precision changes between tiers, the closest
stored block across tiers, ages and invalidation over both, and a directory whose blocks'
parents loop (``open_store``'s refusals: ``test_open_store.py``).

The disk tier under faults: a directory removed while running is made again with one
warning, and files of the old format are dropped at start, counted, never misread (a prompt
larger than the memory tier, cached whole: ``test_spill.py``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from router.kv.events import BlockRemoved, BlockStored, Tier
from router.kv.key import BlockIdentity, Namespace, hash_blocks
from router.kv.ledger import Eviction
from workers.cache.disk_files import BlockRecord, block_path, encode_block
from workers.cache.disk_tier import DiskDirError
from workers.messages import LookupOutcome
from workers.cache.blocks import KVShape
from workers.cache.open_store import open_store
from workers.cache.store import PrefixStore
from tests.workers.cache.test_store import BS, NS, SHAPE, kv_for
from tests.conftest import Clock
from router.kv.events import BlockStored, Tier
from workers.cache.open_store import open_store
import shutil
import msgpack
from router.kv.key import hash_blocks
from workers.cache.disk_lock import DiskDirError
from workers.cache.disk_files import MAGIC, SUFFIX, block_path, _PREFIX


pytestmark = pytest.mark.usefixtures("bounded")  # the disk tier waits on its threads

TTL = 60.0

BLOCK_BYTES = BS * SHAPE.bytes_per_token

A = list(range(1, 9))      # two blocks

B = list(range(101, 109))  # two other blocks

WALL_START = 1_000_000.0   # the wall clock the disk files are stamped with

POLICY: list[Eviction] = [Eviction.LRU]  # the policy of the test running (``_every_policy``)

@pytest.fixture(autouse=True)
def _every_policy(eviction):
    """Every test here runs once per eviction policy: what they assert holds under both."""
    POLICY[0] = eviction
    yield
    POLICY[0] = Eviction.LRU

def tiered(directory: Path, mem_blocks: int = 2, disk_blocks: int = 100, clock: Clock | None = None,
           model: str = "m", revision: str = "r1", wall=None, **kw) -> PrefixStore:
    return open_store(SHAPE, BS, TTL, clock or Clock(), memory_bytes=mem_blocks * BLOCK_BYTES,
                      eviction=POLICY[0], disk_dir=directory, disk_bytes=disk_blocks * BLOCK_BYTES,
                      model=model, revision=revision, wall_clock=wall or Clock(WALL_START), **kw)

def put(store: PrefixStore, tokens: list[int], ns: Namespace = NS) -> int:
    return store.write(ns, tokens, kv_for(tokens))

def spilled_a(tmp_path: Path, **kw) -> PrefixStore:
    """A store whose memory holds B and whose disk holds A's two blocks (written)."""
    store = tiered(tmp_path / "w0", **kw)
    put(store, A)
    put(store, B)  # evicts A's two blocks (leaf first) to disk
    store.flush()
    return store

def ha() -> list:
    return hash_blocks(A, BS, NS)

def _fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == 28  # ENOSPC
    finally:
        os.close(fd)
    return filler


class TestBehaviour:
    def test_evicted_blocks_are_written_and_served_from_disk(self, tmp_path):
        store = spilled_a(tmp_path)
        a0, a1 = ha()
        b0, b1 = hash_blocks(B, BS, NS)
        assert sorted(p.name for p in (tmp_path / "w0").glob("*/*.kv")) == sorted(
            block_path(tmp_path, h).name for h in (a0, a1))
        events = store.drain_events()
        assert events == [
            BlockStored(a0, NS.root(), BS, NS.label()), BlockStored(a1, a0, BS, NS.label()),
            BlockRemoved(a1, NS.label()), BlockStored(b0, NS.root(), BS, NS.label()),
            BlockRemoved(a0, NS.label()), BlockStored(b1, b0, BS, NS.label()),
            BlockStored(a1, a0, BS, NS.label(), Tier.DISK), BlockStored(a0, NS.root(), BS, NS.label(), Tier.DISK)]
        disk = store.stats().disk
        assert (disk.written_blocks, disk.ledger.blocks, disk.pending_writes) == (2, 2, 0)

        found = store.lookup(NS, A + [9])
        assert found.report.outcome == LookupOutcome.HIT
        assert (found.report.matched_tokens, found.report.disk_tokens) == (8, 8)
        want = kv_for(A)
        for layer in range(SHAPE.layers):
            assert mx.array_equal(found.cache[layer].keys[:, :, :8], want[layer].keys[:, :, :8])
            assert mx.array_equal(found.cache[layer].values[:, :, :8], want[layer].values[:, :, :8])
        assert store.stats().disk.read_blocks == 2
        # promoted back into memory (B went to disk); a second lookup is served from memory
        assert store.lookup(NS, A + [9]).report.disk_tokens == 0
        store.close()

    def test_a_pending_block_is_served_before_its_file_exists(self, tmp_path):
        store = tiered(tmp_path / "w0")
        store.disk._writer.flush()  # the thread is idle; what follows queues behind nothing
        put(store, A)
        put(store, B)
        report = store.lookup(NS, A + [9]).report  # whether written yet or not, it is served
        assert (report.matched_tokens, report.disk_tokens) == (8, 8)
        store.close()

    def test_restart_indexes_the_directory_and_announces_the_disk_blocks(self, tmp_path):
        store = spilled_a(tmp_path)
        store.close()  # A was on disk already; close writes B, the memory tier, too
        again = tiered(tmp_path / "w0")
        a0, a1 = ha()
        b0, b1 = hash_blocks(B, BS, NS)
        assert again.stats().disk.start.restored == 4
        # oldest first (A was spilled before B was persisted), children before parents
        assert again.drain_events() == [BlockStored(a1, a0, BS, NS.label(), Tier.DISK),
                                        BlockStored(a0, NS.root(), BS, NS.label(), Tier.DISK),
                                        BlockStored(b1, b0, BS, NS.label(), Tier.DISK),
                                        BlockStored(b0, NS.root(), BS, NS.label(), Tier.DISK)]
        assert [(h.block, h.tier) for h in again.holdings()] == [
            (b0, Tier.DISK), (b1, Tier.DISK), (a0, Tier.DISK), (a1, Tier.DISK)]
        report = again.lookup(NS, A + [9]).report
        assert (report.matched_tokens, report.disk_tokens) == (8, 8)
        again.close()

    def test_a_file_truncated_by_a_kill_is_dropped_at_restart_and_counted(self, tmp_path):
        store = spilled_a(tmp_path)
        store.close()
        a0, a1 = ha()
        path = block_path(tmp_path / "w0", a1)
        os.truncate(path, path.stat().st_size - 100)                 # torn mid-write
        (path.parent / (path.name + ".tmp")).write_bytes(b"ORKV\x01")  # a write never renamed
        again = tiered(tmp_path / "w0")
        start = again.stats().disk.start
        assert (start.restored, start.torn) == (3, 2)  # a0, b0, b1
        assert not path.exists() and not list((tmp_path / "w0").glob("*/*.tmp"))
        report = again.lookup(NS, A + [9]).report
        assert (report.matched_tokens, report.disk_tokens) == (4, 4)  # a0 only, a1 recomputed
        again.close()

    def test_a_corrupt_file_is_dropped_counted_and_never_served(self, tmp_path):
        store = spilled_a(tmp_path)
        a0, a1 = ha()
        path = block_path(tmp_path / "w0", a1)
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF  # one flipped byte in the payload: same size, bad checksum
        path.write_bytes(bytes(data))
        report = store.lookup(NS, A + [9]).report
        assert (report.matched_tokens, report.disk_tokens) == (4, 4)
        assert store.stats().disk.corrupt == 1
        store.flush()
        assert not path.exists() and a1 not in store.disk
        store.close()

    def test_a_file_holding_other_tokens_is_refused(self, tmp_path):
        store = spilled_a(tmp_path)
        a0, a1 = ha()
        path = block_path(tmp_path / "w0", a1)
        kv = kv_for([50, 51, 52, 53])
        keys = (mx.stack([c.keys[0, :, :4] for c in kv]),)
        values = (mx.stack([c.values[0, :, :4] for c in kv]),)
        forged = BlockRecord(a1, BlockIdentity(NS.label(), a0, 1, (50, 51, 52, 53)), "m", "r1", 0)
        path.write_bytes(encode_block(forged, keys, values))  # valid checksum, other tokens
        report = store.lookup(NS, A + [9]).report
        stats = store.stats()
        # a sound file of another block under the same hash: a miss, never served, never deleted
        assert (report.matched_tokens, stats.identity_mismatches, stats.disk.corrupt) == (4, 1, 0)
        assert path.exists()
        store.close()

    def test_two_workers_cannot_share_a_directory(self, tmp_path):
        first = tiered(tmp_path / "w0")
        with pytest.raises(DiskDirError, match=r"is in use by another worker \(pid %d\)" % os.getpid()):
            tiered(tmp_path / "w0")
        first.close()
        tiered(tmp_path / "w0").close()  # released on close

    def test_a_directory_that_cannot_be_written_is_a_clear_error(self, tmp_path):
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        with pytest.raises(DiskDirError, match="cannot use .*a-file/w0 for the disk tier: Not a directory"):
            tiered(blocker / "w0")
        with pytest.raises(DiskDirError, match="set \\[cache\\] disk_dir"):
            tiered(Path("/proc/orchard-disk"))

    def test_another_models_blocks_are_cleaned_up_and_never_served(self, tmp_path):
        store = spilled_a(tmp_path, model="m", revision="r1")
        store.close()
        again = tiered(tmp_path / "w0", model="m", revision="r2")  # new weights, same directory
        assert again.stats().disk.start.foreign == 4
        assert again.stats().disk.ledger.blocks == 0
        assert not list((tmp_path / "w0").glob("*/*.kv"))
        assert again.lookup(NS, A + [9]).report.outcome == LookupOutcome.MISS
        again.close()

    def test_blocks_expired_while_down_are_dropped_at_restart(self, tmp_path):
        wall = Clock(WALL_START)
        store = spilled_a(tmp_path, wall=wall)
        store.close()
        a0, a1 = ha()
        b0, b1 = hash_blocks(B, BS, NS)
        for h in (a0, b0, b1):
            os.utime(block_path(tmp_path / "w0", h), (wall.now - 10, wall.now - 10))
        os.utime(block_path(tmp_path / "w0", a1), (wall.now - TTL - 1, wall.now - TTL - 1))
        again = tiered(tmp_path / "w0", wall=wall)
        start = again.stats().disk.start
        assert (start.restored, start.expired) == (3, 1)
        assert {h.block for h in again.holdings()} == {a0, b0, b1}
        again.close()

    def test_disk_full_stops_writes_once_and_memory_carries_on(self, tmp_path, caplog):
        store = tiered(tmp_path / "w0")
        a0, a1 = ha()
        for h in (a0, a1):  # the kernel's own ENOSPC: the tier's .tmp files lead to /dev/full
            path = block_path(tmp_path / "w0", h)
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / (path.name + ".tmp")).symlink_to("/dev/full")
        with caplog.at_level(logging.WARNING, logger="workers.cache.disk_writer"):
            put(store, A)
            put(store, B)
            store.flush()
            disk = store.stats().disk
            assert (disk.full, disk.failed_writes, disk.written_blocks, disk.ledger.blocks) == (True, 2, 0, 0)
            assert put(store, list(range(201, 209))) == 8  # memory carries on; B spills nowhere
            disk = store.stats().disk
            assert (disk.skipped_full, disk.ledger.blocks) == (2, 0)
        assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 1
        assert store.lookup(NS, list(range(201, 209)) + [1]).report.matched_tokens == 8
        store.close()

    def test_a_full_disk_is_written_again_once_space_returns(self, tmp_path, caplog):
        from tests.support.small_disk import small_disk
        from workers.cache.disk_tier import FULL_RECHECK_S

        clock = Clock()
        with small_disk(tmp_path / "disk", megabytes=1) as disk:
            store = tiered(disk / "w0", clock=clock)
            a0, a1 = ha()
            b0, b1 = hash_blocks(B, BS, NS)
            filler = _fill(disk)
            with caplog.at_level(logging.WARNING, logger="workers"):
                put(store, A)
                put(store, B)  # A's two blocks spill: the kernel says ENOSPC
                store.flush()
                stats = store.stats().disk
                assert (stats.full, stats.failed_writes, stats.written_blocks) == (True, 2, 0)
                filler.unlink()                       # an operator frees space
                clock.now += FULL_RECHECK_S - 0.5
                put(store, list(range(201, 209)))     # B spills: too soon to look, skipped
                store.flush()
                stats = store.stats().disk
                assert (stats.full, stats.skipped_full, stats.ledger.blocks) == (True, 2, 0)
                clock.now += 0.5
                put(store, A)                         # the 201.. blocks spill: space is back
                store.flush()
            stats = store.stats().disk
            assert (stats.full, stats.written_blocks, stats.ledger.blocks) == (False, 2, 2)
            c0, c1 = hash_blocks(list(range(201, 209)), BS, NS)
            assert sorted(p.name for p in (disk / "w0").glob("*/*.kv")) == sorted(
                block_path(disk / "w0", h).name for h in (c0, c1))
            messages = [r.getMessage() for r in caplog.records]
            assert len([m for m in messages if "is full" in m]) == 1
            assert len([m for m in messages if "writes resume" in m]) == 1
            report = store.lookup(NS, list(range(201, 209)) + [1]).report
            assert (report.matched_tokens, report.disk_tokens) == (8, 8)
            store.close()

    def test_ttl_covers_the_disk_tier(self, tmp_path):
        clock = Clock()
        store = spilled_a(tmp_path, clock=clock)
        clock.now = TTL + 1
        assert store.expire() == 4  # B's two in memory, A's two on disk
        store.flush()
        assert not list((tmp_path / "w0").glob("*/*.kv"))
        assert store.lookup(NS, A + [9]).report.outcome == LookupOutcome.MISS
        store.close()

    def test_invalidation_covers_both_tiers(self, tmp_path):
        store = spilled_a(tmp_path)
        assert store.invalidate_prefix(NS, A) == 1  # a1 on disk; a0 stays
        assert store.invalidate_namespace(NS) == 3  # b0, b1 in memory and a0 on disk
        store.flush()
        assert not list((tmp_path / "w0").glob("*/*.kv"))
        with pytest.raises(ValueError, match="unknown namespace"):
            store.invalidate_namespace(NS)
        store.close()

    def test_the_disk_tier_evicts_by_the_same_policy(self, tmp_path):
        store = tiered(tmp_path / "w0", mem_blocks=2, disk_blocks=3)
        put(store, A)
        put(store, B)     # A's 2 blocks to disk
        put(store, A)     # A back from memory's view: B's 2 blocks to disk; disk holds 3 of 4
        store.flush()
        a0, a1 = ha()
        b0, b1 = hash_blocks(B, BS, NS)
        # disk LRU: a1 (leaf, oldest) went to make room for b0; a0 stays (b1, b0, a0)
        assert {h.block for h in store.disk.ledger.holdings()} == {a0, b0, b1}
        assert store.stats().disk.ledger.evictions == 1
        store.close()

    def test_prefetch_reads_disk_blocks_before_the_lookup(self, tmp_path):
        store = spilled_a(tmp_path)
        assert store.prefetch(NS, A + [9]) == 2
        assert store.prefetch(NS, B + [9]) == 0  # in memory
        assert store.lookup(NS, A + [9]).report.disk_tokens == 8
        store.close()

    def test_the_read_bandwidth_is_the_bytes_read_back_over_the_time_reading_them(self, tmp_path):
        store = spilled_a(tmp_path)
        assert store.disk.read_bytes_s is None  # nothing read back yet
        assert store.lookup(NS, A[:BS] + [9]).report.disk_tokens == BS  # a0: one file
        first = store.stats().disk
        assert first.read_blocks == 1 and first.read_bytes > BLOCK_BYTES  # K/V and a header
        assert store.disk.read_bytes_s == first.read_bytes / first.read_s
        assert store.lookup(NS, A + [9]).report.disk_tokens == BS  # a0 in memory now; a1 read
        second = store.stats().disk
        assert second.read_blocks == 2
        sample = (second.read_bytes - first.read_bytes) / (second.read_s - first.read_s)
        # a moving average: the newest lookup weighs 0.3
        assert store.disk.read_bytes_s == pytest.approx(0.7 * first.read_bytes / first.read_s
                                                        + 0.3 * sample, rel=1e-9)
        store.close()

    def test_close_keeps_the_memory_tier_on_disk_for_the_next_start(self, tmp_path):
        store = tiered(tmp_path / "w0", mem_blocks=10)
        put(store, A)
        store.close()  # nothing was evicted: close writes the memory tier's blocks
        again = tiered(tmp_path / "w0", mem_blocks=10)
        assert again.stats().disk.start.restored == 2
        report = again.lookup(NS, A + [9]).report
        assert (report.matched_tokens, report.disk_tokens) == (8, 8)
        again.close()

    def test_an_engine_restarted_on_its_directory_reuses_its_cache_and_agrees(self, tmp_path):
        from tests.support.forged_models import tiny_model
        from workers.engine.engine import Engine, EngineConfig
        from workers.messages import GenerateRequest, SamplingParams

        config = EngineConfig(block_size=16, disk_bytes=1 << 26, disk_dir=str(tmp_path),
                              worker_id="w0")
        prompt = tuple(range(5, 5 + 16 * 5 + 3))

        def run(engine):
            req = GenerateRequest("r", engine.namespace("t"), prompt, SamplingParams(max_tokens=4))
            (result,) = engine.generate([req])
            return result

        first = Engine.open(tiny_model(), config)
        cold = run(first)
        first.close()
        second = Engine.open(tiny_model(), config)
        warm = run(second)
        second.close()
        assert (cold.cached_tokens, warm.cached_tokens, warm.lookup.disk_tokens) == (0, 80, 80)
        assert warm.output_tokens == cold.output_tokens


OTHER = Namespace("tenant-b", "m", "r1")


class TestStoreTiersExact:
    def test_prefetch_starts_the_reads_of_the_blocks_only_the_disk_holds(self, tmp_path):
        store = spilled_a(tmp_path)
        assert store.stats().disk.prefetched == 0
        assert store.prefetch(NS, A + [9]) == 2
        assert store.stats().disk.prefetched == 2
        assert store.prefetch(NS, A + [9]) == 2  # still on disk, already being read
        assert store.stats().disk.prefetched == 2
        assert store.lookup(NS, A + [9]).report.disk_tokens == 8
        assert store.stats().disk.prefetched == 2  # the lookup started no read of its own
        store.close()

    def test_promoted_blocks_are_announced_counted_and_kept_by_a_restart(self, tmp_path):
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

    def test_a_block_promoted_from_a_4_bit_disk_is_held_at_memory_precision(self, tmp_path):
        from tests.workers.cache.test_kv_quant import SHAPE as WIDE, BS as WIDE_BS, TOKENS, random_cache

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

    def test_the_closest_stored_block_is_looked_for_in_both_tiers_memory_first(self, tmp_path):
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

    def test_a_hit_ending_in_a_block_memory_could_not_take_is_aged_on_disk(self, tmp_path):
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

    def test_namespaces_and_invalidation_cover_both_tiers(self, tmp_path):
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

    def test_blocks_whose_parents_loop_are_dropped_at_restart_as_torn(self, tmp_path):
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

    def test_a_block_spilled_as_its_own_ancestor_is_refused(self, tmp_path):
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


class TestDiskFaults:
    def test_a_removed_directory_is_made_again_with_one_warning_and_writes_resume(self, tmp_path, caplog):
        directory = tmp_path / "w0"
        store = tiered(directory, mem_blocks=2)
        put(store, A)
        put(store, B)  # A's two blocks go to disk
        store.flush()
        shutil.rmtree(directory)
        caplog.set_level(logging.WARNING, logger="workers.cache.disk_writer")
        more = [list(range(200 + 10 * i, 200 + 10 * i + 2 * BS)) for i in range(6)]
        for tokens in more:  # B, then each but the last, evicted: twelve writes in all
            put(store, tokens)
        store.flush()
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "was removed while in use: made it again" in warnings[0].message
        stats = store.stats().disk
        assert (stats.lost_blocks, stats.failed_writes) == (2, 0)
        assert directory.is_dir() and len(list(directory.glob(f"*/*{SUFFIX}"))) == 12
        # A's blocks went with the directory: a miss, recomputed; the new blocks are served
        assert store.lookup(NS, A + [9]).report.matched_tokens == 0
        report = store.lookup(NS, more[0] + [9]).report
        assert (report.matched_tokens, report.disk_tokens) == (2 * BS, 2 * BS)
        with pytest.raises(DiskDirError, match="in use by another worker"):
            tiered(directory)  # the new directory's lock is held again
        store.close()
        # the new directory holds every block written since, and the lock was released
        again = tiered(directory, mem_blocks=2)
        assert again.stats().disk.start.restored == 14  # close wrote the memory tier too
        again.close()

    def test_files_of_the_old_format_are_dropped_at_start_and_counted(self, tmp_path):
        directory = tmp_path / "w0"
        store = tiered(directory, mem_blocks=2)
        put(store, A)
        store.close()
        for path in directory.glob(f"*/*{SUFFIX}"):  # rewrite both as version 1 files
            data = bytearray(path.read_bytes())
            magic, _, header_len = _PREFIX.unpack_from(data)
            assert magic == MAGIC
            _PREFIX.pack_into(data, 0, MAGIC, 1, header_len)
            path.write_bytes(bytes(data))
        again = tiered(directory, mem_blocks=2)
        start = again.stats().disk.start
        assert (start.outdated, start.restored, start.torn) == (2, 0, 0)
        assert list(directory.glob(f"*/*{SUFFIX}")) == []
        assert again.lookup(NS, A + [9]).report.matched_tokens == 0
        again.close()

    def test_a_block_file_records_its_whole_identity(self, tmp_path):
        store = tiered(tmp_path / "w0", mem_blocks=10)
        put(store, A)
        store.close()
        a0, a1 = hash_blocks(A, BS, NS)
        data = block_path(tmp_path / "w0", a1).read_bytes()
        _, version, header_len = _PREFIX.unpack_from(data)
        header = msgpack.unpackb(data[_PREFIX.size:_PREFIX.size + header_len], raw=False)
        assert version == 2
        assert header[:7] == [a1.to_bytes(16, "little"), a0.to_bytes(16, "little"), NS.label(), 1,
                              "m", "r1", A[BS:]]
