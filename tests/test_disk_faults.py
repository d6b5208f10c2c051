"""The disk tier under faults: a prompt larger than the memory tier is cached whole (the rest
goes straight to disk), a directory removed while running is made again with one warning,
and files of the old format are dropped at start, counted, never misread."""
from __future__ import annotations

import logging
import shutil

import msgpack
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from router.kv.key import hash_blocks
from test_disk_tier import A, B, BS, NS, put, tiered
from workers.cache.disk_lock import DiskDirError
from workers.cache.disk_files import MAGIC, SUFFIX, block_path, _PREFIX


def test_a_prompt_larger_than_memory_is_cached_whole_on_disk(tmp_path):
    store = tiered(tmp_path / "w0", mem_blocks=2)
    prompt = list(range(1, 1 + 5 * BS))  # five blocks, memory holds two
    assert put(store, prompt) == 5 * BS
    store.flush()
    hashes = hash_blocks(prompt, BS, NS)
    on_disk = sorted(p.name for p in (tmp_path / "w0").glob(f"*/*{SUFFIX}"))
    assert on_disk == sorted(block_path(tmp_path / "w0", h).name for h in hashes[2:])
    report = store.lookup(NS, prompt + [99]).report
    assert (report.matched_tokens, report.disk_tokens) == (5 * BS, 3 * BS)
    store.close()


def test_a_removed_directory_is_made_again_with_one_warning_and_writes_resume(tmp_path, caplog):
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


def test_files_of_the_old_format_are_dropped_at_start_and_counted(tmp_path):
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


def test_a_block_file_records_its_whole_identity(tmp_path):
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
