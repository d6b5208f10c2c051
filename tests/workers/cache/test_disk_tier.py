"""The disk tier: spill, read back, restart, TTL, invalidation, and every fault, with real files.

The disk tier under faults: a directory removed while running is made again with one
warning, and files of the old format are dropped at start, counted, never misread (a prompt
larger than the memory tier, cached whole: ``test_spill.py``; the prefix store over a disk
tier, exactly: ``test_store.py``'s ``TestStoreTiersExact``; ``open_store``'s refusals:
``test_open_store.py``).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import msgpack
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from router.kv.events import BlockRemoved, BlockStored, Tier
from router.kv.key import BlockIdentity, hash_blocks
from tests.conftest import Clock
from tests.support.prefix_stores import (A, B, BLOCK_BYTES, BS, NS, SHAPE, TTL, WALL_START,
                                         every_policy, ha, kv_for, put, spilled_a,  # noqa: F401
                                         tiered)
from workers.cache.disk_files import (MAGIC, SUFFIX, _PREFIX, BlockRecord, block_path,
                                      encode_block)
from workers.cache.disk_lock import DiskDirError
from workers.messages import LookupOutcome

# the disk tier waits on its threads; every test runs once per eviction policy
pytestmark = pytest.mark.usefixtures("bounded", "every_policy")


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
