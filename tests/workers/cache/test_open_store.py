"""``open_store`` (``workers.cache.open_store``): the sizes it refuses, the tiers it opens.

Its refusals word for word (and the disk directory released after one), no disk tier
without ``disk_bytes``, the memory tier's precision, and the model name a disk tier's blocks
are marked with when none is given.
"""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from router.kv.ledger import Eviction
from workers.cache.open_store import open_store
from tests.conftest import Clock
from tests.support.prefix_stores import A, BS, SHAPE, put

pytestmark = pytest.mark.usefixtures("bounded")  # a disk tier waits on its threads

TTL = 60.0

BLOCK_BYTES = BS * SHAPE.bytes_per_token


class TestOpenStore:
    def test_a_worker_without_disk_bytes_has_no_disk_tier(self):
        store = open_store(SHAPE, BS, TTL, Clock(), memory_bytes=BLOCK_BYTES * 4)
        assert store.disk is None and store.stats().disk is None
        with pytest.raises(ValueError, match="needs a disk_dir"):
            open_store(SHAPE, BS, TTL, Clock(), memory_bytes=1, disk_bytes=1)

    def test_open_store_refuses_bad_sizes_word_for_word_and_releases_the_directory(self, tmp_path):
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

    def test_open_store_hands_the_memory_tier_its_precision(self):
        from tests.support.prefix_stores import WIDE

        store = open_store(WIDE, 16, TTL, Clock(), memory_bytes=1 << 20, kv_bits=8)
        assert store.stats().bytes_per_token == 544  # 8-bit: 64 + 2 x 2 bytes per head and token

    def test_a_store_opened_without_a_model_name_keeps_its_blocks_for_the_same(self, tmp_path):
        def unnamed(**kw):
            return open_store(SHAPE, BS, TTL, Clock(), memory_bytes=10 * BLOCK_BYTES,
                              disk_dir=tmp_path, disk_bytes=10 * BLOCK_BYTES, **kw)

        store = unnamed()  # model and revision default to ""
        put(store, A)
        store.close()
        again = unnamed(model="", revision="")
        assert (again.stats().disk.start.restored, again.stats().disk.start.foreign) == (2, 0)
        again.close()


    def test_a_disk_dir_without_disk_bytes_opens_no_disk_tier(self, tmp_path):
        store = open_store(SHAPE, BS, TTL, Clock(), memory_bytes=BLOCK_BYTES, disk_dir=tmp_path)
        assert store.disk is None and list(tmp_path.iterdir()) == []

    def test_the_disk_tier_gets_its_own_precision_model_and_revision(self, tmp_path):
        from tests.support.prefix_stores import WIDE

        store = open_store(WIDE, 16, TTL, Clock(), memory_bytes=1 << 20, disk_dir=tmp_path,
                           disk_bytes=1 << 20, disk_kv_bits=4, model="m", revision="r2")
        assert (store.disk.codec.bits, store.disk.model, store.disk.revision) == (4, "m", "r2")
        assert store.disk.ledger.bytes_per_token == 288  # 4-bit: 32 + 2 x 2 bytes per head
        assert store.stats().bytes_per_token == 2048  # memory stays unquantized
        store.close()
