"""BlockTable: lookups through full buckets, growth, the budget, least recently used first;
then, exactly, which bucket and slot each key of a batch takes (two choices, ties, batch
order), the ``passed`` counts through stores, removals and saturation, the lookups and stores
that meet a broken table, growth's sizes, the budget's bounds, rows, ticks and memory maps.

Keys are built to land where a test wants them: a key's first bucket comes from its high 32
bits and its second from its low 32 bits (``half x buckets >> 32``), so a key whose halves are
both small has bucket 0 for both choices.
"""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from router.block_ages import MAX_AGE
from router.block_keys import key_of, keys_of
from router.block_table import BUCKET, MAP_BYTES, PLACE_BATCH, BlockTable, _zeros, entry_bytes

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


# ---- exact placement, lookup, removal and growth ------------------------------------------


def homed(first: int, second: int, buckets: int, i: int = 0) -> int:
    """The ``i``-th key whose first bucket is ``first`` and second ``second`` among
    ``buckets``: each half the least that lands there, plus ``1 + i`` (never the key 0)."""
    def half(bucket: int) -> int:
        return -(-(bucket << 32) // buckets) + 1 + i
    return half(first) << 32 | half(second)


def keys(*values: int) -> np.ndarray:
    return np.array(values, np.uint64)


def small(buckets: int, blocks: int = 60) -> BlockTable:
    """A table of ``buckets`` buckets now (it may grow to hold ``blocks``)."""
    t = table(blocks)
    t._allocate(buckets)
    return t


class TestTwoChoices:
    def test_a_key_goes_to_its_second_bucket_when_its_first_is_full_and_is_found_there(self):
        t = small(4)
        t.add(keys(*[homed(0, 0, 4, i) for i in range(8)]))     # bucket 0 full
        second = t.add(keys(homed(0, 2, 4, 20), homed(0, 2, 4, 21)))
        assert second.tolist() == [16, 17]                        # bucket 2, in order
        assert [t.find_one(homed(0, 2, 4, i)) for i in (20, 21)] == [16, 17]
        assert t.find(keys(homed(0, 2, 4, 20), homed(0, 2, 4, 21))).tolist() == [16, 17]
        assert t.passed.tolist() == [0, 0, 0, 0]                  # nothing went past a bucket

    def test_a_key_goes_to_its_first_bucket_on_a_tie_and_each_key_to_its_roomier_bucket(self):
        t = small(4)
        assert t.add(keys(homed(1, 2, 4))).tolist() == [8]        # both empty: its first
        t.add(keys(*[homed(0, 0, 4, i) for i in range(8)]))       # bucket 0 full
        # in one batch: one key whose first is full goes to its second, one whose second is
        # full to its first
        assert t.add(keys(homed(0, 2, 4, 30), homed(3, 0, 4, 30))).tolist() == [16, 24]

    def test_each_key_of_a_batch_weighs_its_own_two_buckets(self):
        """Bucket 0 full, bucket 3 half full: one key (0, 2) goes to 2, one (1, 3) to 1, each
        to its own roomier bucket (over both keys, the second buckets have more room)."""
        t = small(4)
        t.add(keys(*[homed(0, 0, 4, i) for i in range(8)]))
        t.add(keys(*[homed(3, 3, 4, i) for i in range(4)]))
        assert t.add(keys(homed(0, 2, 4, 40), homed(1, 3, 4, 40))).tolist() == [16, 8]

    def test_keys_of_one_batch_take_a_bucket_s_slots_in_batch_order(self):
        """40 keys in one batch, 20 wanting bucket 3 and then 20 wanting bucket 1: the first
        eight of each in their bucket's slots in order (ranked by a stable sort)."""
        t = small(8)
        batch = [homed(3, 3, 8, i) for i in range(20)] + [homed(1, 1, 8, i) for i in range(20)]
        slots = t.add(keys(*batch)).tolist()
        assert slots[:8] == list(range(24, 32)) and slots[20:28] == list(range(8, 16))
        assert t.find(keys(*batch)).tolist() == slots

    def test_a_found_slot_indexes_the_masks(self):
        t = small(4)
        t.add(keys(homed(0, 0, 4)))
        found = t.find(keys(homed(0, 0, 4), homed(1, 1, 4)))
        assert found.dtype == np.intp and found.tolist() == [0, -1]


class TestPassed:
    def _overflowed(self) -> BlockTable:
        """4 buckets (all a budget of 25 blocks gets): bucket 0 full of keys homed there and
        two more of them past it in bucket 1, which six homed there fill; two more homed 1
        past it in bucket 2."""
        t = small(4, blocks=25)
        t.add(keys(*[homed(0, 0, 4, i) for i in range(10)]))      # 8 in bucket 0, 2 in 1
        t.add(keys(*[homed(1, 1, 4, i) for i in range(6)]))       # bucket 1 full
        assert t.add(keys(homed(1, 1, 4, 50), homed(1, 1, 4, 51))).tolist() == [16, 17]
        assert t.passed.tolist() == [2, 2, 0, 0] and t.buckets == 4
        return t

    def test_removing_a_key_from_its_second_bucket_uncounts_nothing(self):
        t = self._overflowed()
        assert t.add(keys(homed(0, 3, 4, 70), homed(0, 3, 4, 71))).tolist() == [24, 25]
        t.remove(np.array([25]))   # in its second bucket, not its first slot there
        assert t.passed.tolist() == [2, 2, 0, 0] and t.count == 19
        assert t.find_one(homed(0, 3, 4, 70)) == 24 and t.find_one(homed(0, 3, 4, 71)) is None

    def test_removing_a_key_uncounts_each_bucket_it_went_past_and_no_other(self):
        t = self._overflowed()
        assert [t.find_one(homed(1, 1, 4, 50)), t.find_one(homed(0, 0, 4, 3))] == [16, 3]
        t.remove(np.array([16, 3]))   # one that went past bucket 1, one in its first bucket
        assert t.passed.tolist() == [2, 1, 0, 0]
        assert t.find_one(homed(1, 1, 4, 51)) == 17 and t.find_one(homed(1, 1, 4, 50)) is None

    def test_removing_a_key_that_went_past_two_buckets_uncounts_both(self):
        t = small(4, blocks=25)
        t.add(keys(*[homed(1, 1, 4, i) for i in range(8)]))       # bucket 1 full
        t.add(keys(*[homed(2, 2, 4, i) for i in range(8)]))       # bucket 2 full
        assert t.add(keys(homed(1, 1, 4, 50))).tolist() == [24]   # past 1 and 2, into 3
        assert t.passed.tolist() == [0, 1, 1, 0]
        t.remove(np.array([24]))
        assert t.passed.tolist() == [0, 0, 0, 0] and t.find_one(homed(1, 1, 4, 50)) is None

    def test_a_count_saturates_at_255_and_then_stays(self):
        t = small(45, blocks=300)   # 360 slots: 264 keys fit without growth
        batch = keys(*[homed(0, 0, 45, i) for i in range(8 + 256)])
        slots = t.add(batch)
        assert t.buckets == 45 and t.passed[0] == 255   # 256 went past bucket 0
        assert t.find(batch).tolist() == slots.tolist()
        t.remove(slots[8:])
        assert t.passed[0] == 255   # saturated: it may undercount, so it is never uncounted
        assert t.find(batch[:8]).tolist() == slots[:8].tolist()

    def test_a_lookup_walks_once_round_a_table_every_bucket_of_which_was_passed(self):
        t = small(4)
        t.add(keys(homed(0, 0, 4)))
        t.passed[:] = 1   # a broken count: each bucket says keys went past it
        assert t.find(keys(homed(0, 0, 4))).tolist() == [0]   # found: no walk
        assert t.find_one(homed(0, 0, 4)) == 0
        message = "^a lookup walked every bucket of the table$"
        with pytest.raises(RuntimeError, match=message):
            t.find(keys(homed(1, 1, 4)))
        with pytest.raises(RuntimeError, match=message):
            t.find_one(homed(1, 1, 4))

    def test_a_table_with_no_room_left_in_any_bucket_refuses_a_key(self):
        t = small(4)
        t._flat[:] = 7   # a broken table: every slot taken, its count says empty
        message = "^no bucket had room: the table is over its capacity$"
        with pytest.raises(RuntimeError, match=message):
            t.add(keys(homed(1, 2, 4)))


class TestGrowth:
    def test_a_table_grows_by_half_or_to_what_the_batch_needs_past_0_8_of_its_slots(self):
        t = table(1000)                 # 16 buckets of 8 to start, 157 at most
        t.add(keys_of(range(1, 103)))   # 102 <= 0.8 x 128: no growth
        assert t.buckets == 16
        t.add(keys_of([103]))           # 103: by half
        assert t.buckets == 24
        t.add(keys_of(range(104, 604)))  # 603 blocks need 603 / 0.8 / 8 = 95 buckets
        assert t.buckets == 95
        everything = keys_of(range(1, 604))
        assert (t.find(everything) >= 0).all() and len(set(t.find(everything).tolist())) == 603

    def test_a_table_at_0_8_of_its_slots_exactly_does_not_grow(self):
        t = small(5)                    # 40 slots: 32 is 0.8 of them
        t.add(keys_of(range(1, 33)))
        assert t.buckets == 5 and t.count == 32

    def test_a_batch_of_more_than_a_placement_batch_is_placed_in_order(self):
        t = table(3000)
        exact = keys_of(range(1, PLACE_BATCH + 1))
        slots = t.add(exact)
        assert t.find(exact).tolist() == slots.tolist() and len(set(slots.tolist())) == PLACE_BATCH
        more = keys_of(range(PLACE_BATCH + 1, 2500))
        slots = t.add(more)
        assert len(slots) == len(more) and t.find(more).tolist() == slots.tolist()
        assert len(set(slots.tolist())) == len(more) and t.count == 2499

    def test_fitting_a_table_within_its_budget_leaves_it_as_it_is(self):
        t = BlockTable(1, 100 * entry_bytes(1, 1))   # at most 16 buckets: it starts there
        slots = t.add(keys_of(range(1, 51)))
        before = t.keys
        t.fit()
        assert t.keys is before and t.find(keys_of(range(1, 51))).tolist() == slots.tolist()


class TestRowsAndStamps:
    def test_a_row_is_its_slot_s_words_and_no_slot_s_row_is_zero(self):
        t = BlockTable(2, 40 * entry_bytes(2, 1))
        slots = t.add(keys_of(range(1, 4)))
        t.masks[:-1] = 7                  # every slot's words, but the absent row
        t.masks[slots[1]] = [5, 9]
        assert t.row(int(slots[1])) == [5, 9] and t.row(None) == [0, 0]
        assert t.row(len(t.masks) - 2) == [7, 7]

    def test_a_touch_is_one_tick(self):
        t = table(64)                     # a generation is one tick
        [a] = t.add(keys_of([1]))         # tick 1
        t.touch(np.array([a]))            # tick 2
        [b] = t.add(keys_of([2]))         # tick 3
        t.touch([int(b)])                 # tick 4, one by one
        assert t.stamps[[a, b]].tolist() == [2, 4]


class TestBudget:
    def test_a_one_block_table_is_one_bucket_and_its_arrays_are_exactly_sized(self):
        t = BlockTable(2, 22)
        assert (t.max_entries, t.buckets) == (1, 1)
        # keys 8 x 8, masks 9 rows (the last always zero) x 2 x 4, stamps 8, passed 1
        assert t.nbytes == 64 + 72 + 8 + 1 and t.passed.dtype == np.uint8

    def test_a_table_addresses_at_most_2_32_minus_1_buckets(self):
        most = 27_487_790_688   # blocks: 0.8 of 8 slots in each of 2**32 - 1 buckets
        assert BlockTable(2, most * 22).max_entries == most   # (it starts at 16 buckets)
        over = (most + 6) * 22  # one bucket more
        with pytest.raises(ValueError, match=rf"^max_bytes {over} is more than a table can "
                                             rf"address \(34359738368 slots\): give it less$"):
            BlockTable(2, over)


class TestMemory:
    def _mapped(self, array: np.ndarray) -> bool:
        while isinstance(array, (np.ndarray, memoryview)):
            array = array.obj if isinstance(array, memoryview) else array.base
        return isinstance(array, mmap.mmap)

    def test_arrays_of_a_mebibyte_or_more_live_in_memory_maps_of_their_own(self):
        assert not self._mapped(_zeros((MAP_BYTES - 1,), np.uint8))
        mapped = _zeros((MAP_BYTES // 4,), np.uint32)
        assert self._mapped(mapped) and mapped.shape == (MAP_BYTES // 4,)
        assert mapped.dtype == np.uint32 and not mapped.any()
        assert not self._mapped(_zeros((MAP_BYTES // 8 - 1,), np.uint64))
        assert _zeros((MAP_BYTES // 8, 2), np.uint32).shape == (MAP_BYTES // 8, 2)

    @pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
    def test_a_memory_map_is_private_as_the_heap_is(self):
        mapped = _zeros((MAP_BYTES,), np.uint8)
        mapped[:] = 1   # touched
        at = mapped.__array_interface__["data"][0]
        with open("/proc/self/maps") as maps:
            [perms] = [line.split()[1] for line in maps
                       if int(line.split()[0].split("-")[0], 16) <= at
                       < int(line.split()[0].split("-")[1], 16)]
        assert perms == "rw-p"   # private: a forked child writes its own copy
