"""What a disk tier finds at start (``workers.cache.disk_scan``), with real block files.

A directory written by hand: block files with chosen parents, models, revisions and
mtimes, plus leftover and broken files. Each test pins exactly which blocks are found, which
files are deleted, how each deletion is counted, and the order and ages ``newest_within``
keeps within a budget.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from router.kv.key import BlockHash, BlockIdentity, hash_blocks
from workers.cache.disk_files import (_PREFIX, MAGIC, SUFFIX, TMP_SUFFIX, BlockRecord,
                                      block_path, encode_block)
from tests.support.killed_writer import BS, NS, prompt, store_on
from tests.support.paths import REPO
from workers.cache.disk_scan import ScanCounts, scan

NOW = 1_000_000.0  # the wall clock at the scan
TTL = 100.0
ROOT = BlockHash(999)
TOKENS = (1, 2, 3, 4)

KEYS = (mx.zeros((1, 1, 4, 2), mx.float32),)


def write(directory: Path, block: int, parent: int, age: float = 0.0, model: str = "m",
          revision: str = "r1", tokens: tuple[int, ...] = TOKENS) -> Path:
    """Block ``block``'s file, last used ``age`` seconds before ``NOW``."""
    record = BlockRecord(BlockHash(block), BlockIdentity("ns", BlockHash(parent), 0, tokens),
                         model, revision, 0)
    path = block_path(directory, BlockHash(block))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_block(record, KEYS, KEYS))
    os.utime(path, (NOW - age, NOW - age))
    return path


def found(directory: Path) -> list[int]:
    return sorted(int(p.name.split(".")[0], 16) for p in directory.glob("*/*.kv"))


class TestScan:
    def test_servable_blocks_are_found_with_their_mtimes(self, tmp_path):
        write(tmp_path, 1, 999, age=10.0)
        write(tmp_path, 2, 1, age=5.0)
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        assert {h: t for h, (_, t) in got.found.items()} == {1: NOW - 10.0, 2: NOW - 5.0}
        assert got.found[BlockHash(2)][0].parent == BlockHash(1)
        assert got.counts == ScanCounts()

    def test_other_models_and_revisions_are_foreign_and_deleted(self, tmp_path):
        write(tmp_path, 1, 999)
        write(tmp_path, 2, 999, model="other")
        write(tmp_path, 3, 999, revision="r2")
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        assert list(got.found) == [1] and got.counts == ScanCounts(foreign=2)
        assert found(tmp_path) == [1]

    def test_a_block_unused_for_the_ttl_is_expired_at_exactly_the_ttl(self, tmp_path):
        write(tmp_path, 1, 999, age=TTL - 1.0)
        write(tmp_path, 2, 999, age=TTL)
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        assert list(got.found) == [1] and got.counts == ScanCounts(expired=1)
        assert found(tmp_path) == [1]

    def test_leftover_tmp_files_and_broken_files_are_torn(self, tmp_path):
        write(tmp_path, 1, 999)
        tmp = block_path(tmp_path, BlockHash(2)).with_suffix(TMP_SUFFIX)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(b"half a block")
        cut = write(tmp_path, 3, 999)
        cut.write_bytes(cut.read_bytes()[:-1])
        moved = write(tmp_path, 4, 999)
        elsewhere = block_path(tmp_path, BlockHash(5))
        elsewhere.parent.mkdir(parents=True, exist_ok=True)
        moved.rename(elsewhere)  # the file's name says 5, its header says 4
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        assert list(got.found) == [1] and got.counts == ScanCounts(torn=3)
        assert sorted(p.name for p in tmp_path.glob("*/*")) == [block_path(tmp_path, 1).name]

    def test_a_file_of_an_older_format_is_outdated_and_deleted(self, tmp_path):
        write(tmp_path, 1, 999)
        old = write(tmp_path, 2, 999)
        data = bytearray(old.read_bytes())
        _, _, header_len = _PREFIX.unpack_from(data)
        _PREFIX.pack_into(data, 0, MAGIC, 1, header_len)  # a version 1 file
        old.write_bytes(bytes(data))
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        assert list(got.found) == [1] and got.counts == ScanCounts(outdated=1)
        assert found(tmp_path) == [1]

    def test_blocks_whose_parent_chain_loops_are_torn(self, tmp_path):
        for block, parent in ((11, 12), (12, 11), (13, 12), (14, 999)):
            write(tmp_path, block, parent)
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        assert list(got.found) == [14] and got.counts == ScanCounts(torn=3)
        assert found(tmp_path) == [14]


class TestNewestWithin:
    def test_the_newest_are_kept_a_parent_as_recent_as_its_newest_child(self, tmp_path):
        write(tmp_path, 1, 999, age=50.0)   # parent of 2: counted as used 5 s ago
        write(tmp_path, 2, 1, age=5.0)
        write(tmp_path, 3, 999, age=20.0)
        write(tmp_path, 4, 999, age=40.0)
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        keep = got.newest_within(budget=3 * 4 * 10, bytes_per_token=10)  # three blocks
        assert [(r.block, age) for r, age in keep] == [(1, 5.0), (2, 5.0), (3, 20.0)]
        assert got.counts == ScanCounts(over_budget=1)
        assert found(tmp_path) == [1, 2, 3]

    def test_a_block_costs_its_own_tokens(self, tmp_path):
        write(tmp_path, 1, 999, age=1.0, tokens=(1, 2))
        write(tmp_path, 2, 999, age=2.0, tokens=(1, 2, 3, 4))
        write(tmp_path, 3, 999, age=3.0, tokens=(5, 6))
        got = scan(tmp_path, "m", "r1", TTL, NOW)
        keep = got.newest_within(budget=4, bytes_per_token=1)
        assert [r.block for r, _ in keep] == [1, 3]  # 2 does not fit after 1; 3 does
        assert got.counts.over_budget == 1 and found(tmp_path) == [1, 3]


class TestAfterAKill:
    """A worker killed (SIGKILL) while its disk tier is writing: the next start on its
    directory drops exactly the files the kill left half-written and serves every other block,
    verified (the writing process: ``tests.support.killed_writer``)."""

    def test_blocks_torn_by_a_kill_are_dropped_and_the_rest_served(self, tmp_path):
        directory = tmp_path / "w0"
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.killed_writer",
                                 str(directory)], cwd=REPO)  # from the root: ``tests`` imports
        try:
            deadline = time.monotonic() + 120
            while len(list(directory.glob(f"*/*{SUFFIX}"))) < 12:
                assert proc.poll() is None, "the writing process ended before it was killed"
                assert time.monotonic() < deadline, "no block files appeared within 120 s"
                time.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        torn = len(list(directory.glob(f"*/*{TMP_SUFFIX}")))
        files = len(list(directory.glob(f"*/*{SUFFIX}")))
        again = store_on(directory)
        start = again.stats().disk.start
        assert (start.restored, start.torn) == (files, torn)
        assert not list(directory.glob(f"*/*{TMP_SUFFIX}"))
        served = reachable = 0
        for i in range(files):  # the prompts the child stored (at most one per file)
            chain = hash_blocks(prompt(i), BS, NS)
            # a block is served when its chain from the root is on disk: a leaf whose parent's
            # write was torn waits for the parent to be computed again
            on_disk = [block_path(directory, h).exists() for h in chain]
            reachable += BS * (on_disk.index(False) if False in on_disk else len(on_disk))
            served += again.lookup(NS, prompt(i) + [1]).report.disk_tokens
        disk = again.stats().disk
        assert (served, disk.read_blocks, disk.corrupt) == (reachable, reachable // BS, 0)
        # blocks are written in queue order (each prompt's leaf first): only the one being
        # written or next at the kill can be a parent whose child made it to disk
        assert files - reachable // BS <= 1
        again.close()
