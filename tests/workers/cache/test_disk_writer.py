"""The disk tier's writer thread: when it stops on an error, nothing waits on it forever.

A block the file format cannot hold (a complex64 array: ``workers.cache.disk_files`` writes float
and integer arrays only) raises ``ValueError`` on the writer thread, as a bug in what the
store hands the tier would. Before, that ended the thread silently and the next ``flush``
waited forever; now ``flush`` and ``close`` raise ``WriterStopped`` naming the error at once.
"""
from __future__ import annotations

import logging
import time

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from router.kv.key import BlockIdentity
from workers.cache.disk_files import BlockRecord, block_path
from workers.cache.disk_tier import DiskTier
from workers.cache.disk_writer import DiskWriter, PendingBlock, WriterStopped
from workers.cache.kv_quant import KVCodec
from tests.conftest import Clock

pytestmark = pytest.mark.usefixtures("bounded")  # a wait that never ends fails, saying so

TOKENS = (1, 2, 3, 4)
STOPPED = (r"the writer thread stopped on ValueError\('cannot write a complex64 array to a "
           r"block file'\); blocks spilled since were not written")


def block(h: int, dtype: mx.Dtype = mx.float32) -> PendingBlock:
    kv = (mx.zeros((1, 1, len(TOKENS), 2), dtype=dtype),)
    mx.eval(kv)  # as the store hands them over: the writer thread evaluates nothing
    return PendingBlock(BlockRecord(h, BlockIdentity("ns", 0, 0, TOKENS), "m", "r1", 0), kv, kv)


def test_a_stopped_writer_fails_flush_at_once_and_refuses_further_writes(tmp_path, caplog):
    writer = DiskWriter(tmp_path)
    writer.write(block(7))
    writer.flush()
    assert block_path(tmp_path, 7).exists() and writer.take_failed() == []
    with caplog.at_level(logging.ERROR, logger="workers.cache.disk_writer"):
        writer.write(block(8, mx.complex64))
        start = time.monotonic()
        with pytest.raises(WriterStopped, match=STOPPED):
            writer.flush()
        assert time.monotonic() - start < 5  # at once, not after FLUSH_LIMIT_S
    assert [r.getMessage() for r in caplog.records] == [
        f"disk tier {tmp_path}: the writer thread stopped"]
    assert (writer.take_failed(), writer.pending_count(), writer.counts.failed) == ([8], 0, 1)
    writer.write(block(9))  # nobody would write it: refused like on a full disk
    assert (writer.take_failed(), writer.pending_count(), writer.counts.failed) == ([9], 0, 2)
    assert not block_path(tmp_path, 9).exists()
    with pytest.raises(WriterStopped, match=STOPPED):
        writer.close()


def test_a_flush_the_thread_does_not_reach_in_time_says_how_much_is_queued(tmp_path):
    writer = DiskWriter(tmp_path)
    writer.close()  # the thread is gone without an error: nothing will ever flush
    writer.write(block(3))
    with pytest.raises(WriterStopped, match=r"a flush is not done after 0\.2 s, 1 writes still "
                                            r"queued \(does the disk answer\?\)"):
        writer.flush(limit_s=0.2)


def test_a_tier_whose_writer_stopped_still_releases_its_directory(tmp_path):
    def tier() -> DiskTier:
        return DiskTier(tmp_path / "w0", 1 << 20, 60.0, Clock(), KVCodec(0, mx.float32),
                        2 * 4, "m", "r1")

    first = tier()
    bad = block(5, mx.complex64)
    assert first.spill(bad.record, bad.keys, bad.values)
    with pytest.raises(WriterStopped, match=STOPPED):
        first.flush()
    assert 5 not in first  # the failed write is forgotten
    with pytest.raises(WriterStopped, match=STOPPED):
        first.close()
    tier().close()  # the flock was released all the same
