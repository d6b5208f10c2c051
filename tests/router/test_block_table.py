"""BlockTable: lookups through full buckets, growth, the budget, least recently used first.

Keys are built to land where a test wants them: a key's first bucket comes from its high 32
bits and its second from its low 32 bits (``half x buckets >> 32``), so a key whose halves are
both small has bucket 0 for both choices.
"""
from __future__ import annotations

import numpy as np
import pytest

from router.block_ages import MAX_AGE
from router.block_keys import key_of, keys_of
from router.block_table import BUCKET, BlockTable, entry_bytes

KEYS = np.arange(1, 21, dtype=np.uint64) << np.uint64(32) | np.arange(1, 21, dtype=np.uint64)


def table(blocks: int, columns: int = 1) -> BlockTable:
    return BlockTable(columns, blocks * entry_bytes(columns, 1))


def test_keys_fold_block_hashes_and_are_never_zero():
    blocks = [0, 1, 2**127 + 5, 10]
    assert keys_of(blocks).tolist() == [key_of(b) for b in blocks]
    assert key_of(0) == 1 and all(k != 0 for k in keys_of(range(1000)).tolist())
    assert entry_bytes(2, 1) == 22 and entry_bytes(2, 2) == 32


def test_keys_that_share_both_buckets_overflow_and_are_still_found():
    t = table(20)
    t._allocate(4)  # 4 buckets of 8: all 20 keys want bucket 0 twice over
    slots = t.add(KEYS)
    assert sorted((slots // BUCKET).tolist()) == [0] * 8 + [1] * 8 + [2] * 4
    assert t.passed.tolist() == [12, 4, 0, 0]  # 12 went past bucket 0, 4 past bucket 1 too
    assert t.find(KEYS).tolist() == slots.tolist()
    assert [t.find_one(int(k)) for k in KEYS] == slots.tolist()
    assert t.find(np.array([99 << 32 | 1], np.uint64)).tolist() == [-1]
    assert t.find_one(99 << 32 | 1) is None
    t.remove(slots[16:])  # the 4 in bucket 2 each went past buckets 0 and 1
    assert t.passed.tolist() == [8, 0, 0, 0] and t.count == 16
    assert t.find(KEYS[16:]).tolist() == [-1] * 4
    assert t.find(KEYS[:16]).tolist() == slots[:16].tolist()


def test_a_full_table_refuses_more_and_growth_keeps_every_entry():
    t = table(1000)
    first = t.add(keys_of(range(10, 700)))
    t.masks[first, 0] = np.arange(690, dtype=np.uint32)
    t.stamps[first] = 7
    grown = t.add(keys_of(range(700, 1010)))  # past 0.8 of the slots: the table grew
    assert t.count == 1000 and t.room() == 0 and len(grown) == 310
    assert t.count <= 0.8 * t.buckets * BUCKET and t.buckets <= -(-1000 // (0.8 * BUCKET))
    moved = t.find(keys_of(range(10, 700)))
    assert (t.masks[moved, 0] == np.arange(690)).all() and (t.stamps[moved] == 7).all()
    with pytest.raises(RuntimeError, match="adding 1 blocks to a table with room for 0"):
        t.add(keys_of([5]))


def test_the_budget_must_hold_one_block():
    with pytest.raises(ValueError, match=r"max_bytes must hold at least one block \(22 bytes\)"):
        BlockTable(2, 21)
    assert BlockTable(2, 22).max_entries == 1
    with pytest.raises(ValueError, match="more than a table can address"):
        BlockTable(2, 1 << 50)


def test_oldest_goes_by_last_use_ties_in_slot_order():
    t = table(64)                           # 64 blocks: a generation is one tick
    slots = t.add(keys_of(range(1, 11)))    # one tick each: block 1 is the oldest
    t.touch(slots[:2])                      # 1 and 2 used again, in one tick: the newest
    assert sorted(t.oldest(3).tolist()) == sorted(slots[2:5].tolist())  # in slot order
    t.touch(slots[2:10])                    # the other eight in one tick: they tie
    tied = sorted(slots[2:10].tolist())
    assert sorted(t.oldest(5).tolist()) == sorted(sorted(slots[:2].tolist()) + tied[:3])
    assert sorted(t.oldest(100).tolist()) == sorted(slots.tolist())


def test_ages_are_clamped_so_an_old_stamp_never_wraps():
    t = table(64)                           # a generation is one tick
    old = t.add(keys_of([1]))
    for i in range(300):                    # 300 generations on, more than a uint8 holds
        t.touch(old[:0])                    # (an empty touch is not a tick)
        young = t.add(keys_of([1000 + i]))
        t.remove(young)
    newer = t.add(keys_of(range(2, 5)))     # generation 304
    assert t.oldest(1).tolist() == old.tolist()
    ages = (np.uint8(t._generation() & 0xFF) - t.stamps[np.r_[old, newer]]).tolist()
    assert ages == [MAX_AGE + 304 - 256, 2, 1, 0]  # 128 at the last clamp (generation 256)


def test_widening_keeps_the_masks_and_shrinks_the_budget():
    t = BlockTable(2, 100 * entry_bytes(2, 1))
    slots = t.add(keys_of(range(1, 101)))
    t.masks[slots, 0], t.masks[slots, 1] = 5, 9
    t.widen()
    assert t.words == 2 and t.max_entries == 100 * 22 // 32 and t.masks.shape[1] == 4
    assert (t.masks[slots] == [5, 0, 9, 0]).all()
    t.remove(slots[:100 - t.max_entries])
    t.fit()
    assert t.nbytes <= 100 * 22 + BUCKET * 25
    kept = t.find(keys_of(range(100 - t.max_entries + 1, 101)))
    assert (kept >= 0).all() and (t.masks[kept] == [5, 0, 9, 0]).all()
