"""``router.held.HeldBlocks``: which worker slots hold each block, per tier, read through the
live slots; the memory blocks each slot holds; removals of blocks not held counted; a batch
of stores and removals ending as each block's last event says; the least recently used
forgotten, ``max(1, max_blocks // 100)`` at a time, when the byte budget is full."""
from __future__ import annotations

import pytest

from router.block_table import entry_bytes
from router.held import DISK, MEMORY, HeldBlocks
from router.kv.events import BlockRemoved, BlockStored
from router.kv.key import BlockHash

ROOT = BlockHash(1)


def held(max_blocks: int = 1000, live: int = 0xFFFF_FFFF) -> HeldBlocks:
    """Blocks whose budget holds exactly ``max_blocks`` at up to 32 slots, ``live`` slots live."""
    blocks = HeldBlocks(max_blocks * entry_bytes(2, 1))
    assert blocks.max_blocks == max_blocks
    blocks.set_live(live)
    return blocks


def stores(*ids: int) -> list[BlockStored]:
    return [BlockStored(BlockHash(i), ROOT, 16, "ns") for i in ids]


def removals(*ids: int) -> list[BlockRemoved]:
    return [BlockRemoved(BlockHash(i), "ns") for i in ids]


def masks(blocks: HeldBlocks, *ids: int) -> list[tuple[int, int]]:
    """``(memory mask, disk mask)`` of each block."""
    return [blocks.masks(BlockHash(i))[1:] for i in ids]


def present(blocks: HeldBlocks, *ids: int) -> list[int]:
    return [i for i in ids if blocks.masks(BlockHash(i))[0] >= 0]


class TestWhoHoldsABlock:
    def test_each_slot_is_a_bit_of_its_tiers_mask(self):
        blocks = held()
        blocks.apply(0, stores(10, 11), MEMORY)
        blocks.apply(3, stores(11), MEMORY)
        blocks.apply(5, stores(11, 12), DISK)
        assert masks(blocks, 10, 11, 12) == [(0b1, 0), (0b1001, 0b100000), (0, 0b100000)]
        assert len(blocks) == 3
        assert blocks.masks(BlockHash(99)) == (-1, 0, 0)

    def test_only_memory_blocks_count_as_a_slots_holding(self):
        blocks = held()
        blocks.apply(2, stores(10, 11, 10), MEMORY)     # a block stored twice counts once
        blocks.apply(2, stores(12, 13), DISK)
        assert [blocks.blocks_held(s) for s in (0, 2)] == [0, 2]
        blocks.apply(2, stores(11), MEMORY)             # held already: no change
        assert blocks.blocks_held(2) == 2

    def test_disk_seen_only_once_a_block_is_stored_on_disk(self):
        blocks = held()
        blocks.apply(0, stores(10), MEMORY)
        blocks.apply(0, removals(11), DISK)             # a removal is no store
        assert not blocks.disk_seen
        blocks.apply(0, stores(11), DISK)
        assert blocks.disk_seen

    def test_reads_and_with_the_live_slots_until_a_sweep_clears_them(self):
        blocks = held(live=0b11)
        blocks.apply(0, stores(10), MEMORY)
        blocks.apply(1, stores(10), MEMORY)
        blocks.apply(0, stores(10), DISK)
        blocks.set_live(0b10)                           # slot 0's worker removed
        assert masks(blocks, 10) == [(0b10, 0)]
        blocks.set_live(0b11)
        assert masks(blocks, 10) == [(0b11, 0b1)]       # its bits were still there
        blocks.sweep({0})
        assert masks(blocks, 10) == [(0b10, 0)]
        blocks.sweep({1})                               # nobody holds it: it goes
        assert (len(blocks), present(blocks, 10)) == (0, [])

    def test_a_block_only_removed_slots_hold_goes_with_its_last_live_holder(self):
        blocks = held(live=0b11)
        blocks.apply(0, stores(10), MEMORY)
        blocks.apply(1, stores(10), MEMORY)
        blocks.set_live(0b10)
        blocks.apply(1, removals(10), MEMORY)
        assert (len(blocks), present(blocks, 10)) == (0, [])

    def test_reset_gives_a_slot_a_count_of_nothing(self):
        blocks = held()
        blocks.apply(4, stores(10, 11), MEMORY)
        blocks.reset(4)
        assert blocks.blocks_held(4) == 0


class TestRemovals:
    def test_a_removal_clears_the_bit_and_a_block_nobody_holds_goes(self):
        blocks = held()
        blocks.apply(0, stores(10, 11), MEMORY)
        blocks.apply(1, stores(11), MEMORY)
        blocks.apply(0, removals(10, 11), MEMORY)
        assert (present(blocks, 10, 11), masks(blocks, 11)) == ([11], [(0b10, 0)])
        assert (blocks.blocks_held(0), blocks.blocks_held(1), blocks.unknown_removals) == (0, 1, 0)

    def test_removals_of_blocks_not_held_are_counted_not_refused(self):
        blocks = held()
        blocks.apply(0, stores(10), MEMORY)
        blocks.apply(1, removals(10, 12), MEMORY)       # slot 1 held neither
        blocks.apply(0, removals(10, 10), MEMORY)       # the second finds the bit gone
        assert blocks.unknown_removals == 3
        assert (len(blocks), blocks.blocks_held(0)) == (0, 0)

    def test_a_memory_removal_leaves_the_disk_bit(self):
        blocks = held()
        blocks.apply(0, stores(10), MEMORY)
        blocks.apply(0, stores(10), DISK)
        blocks.apply(0, removals(10), MEMORY)
        assert masks(blocks, 10) == [(0, 0b1)]


class TestABatchOfBothKinds:
    def test_each_block_ends_as_its_last_event_says(self):
        blocks = held()
        blocks.apply(0, stores(10, 11), MEMORY)
        batch = [*removals(10), *stores(12), *removals(12), *stores(11), *removals(11),
                 *stores(10), *removals(13)]
        blocks.apply(0, batch, MEMORY)
        assert present(blocks, 10, 11, 12, 13) == [10]
        assert blocks.blocks_held(0) == 1
        assert blocks.unknown_removals == 1             # 13 only: 12 and 11 were held then

    def test_a_removal_before_any_store_of_a_block_not_held_is_unknown(self):
        blocks = held()
        blocks.apply(0, [*removals(20), *stores(20), *stores(21)], MEMORY)
        assert (present(blocks, 20, 21), blocks.unknown_removals) == ([20, 21], 1)
        assert blocks.blocks_held(0) == 2


class TestReplace:
    def test_a_slot_holds_exactly_the_blocks_given_in_that_tier(self):
        blocks = held()
        blocks.apply(0, stores(10, 11, 12), MEMORY)
        blocks.apply(0, stores(10), DISK)
        blocks.apply(1, stores(11), MEMORY)
        blocks.replace(0, [BlockHash(12), BlockHash(13)], MEMORY)
        assert present(blocks, 10, 11, 12, 13) == [10, 11, 12, 13]
        assert masks(blocks, 10, 11, 12, 13) == [(0, 0b1), (0b10, 0), (0b1, 0), (0b1, 0)]
        assert blocks.blocks_held(0) == 2


class TestAFullBudget:
    def test_the_oldest_go_a_hundredth_of_the_budget_at_a_time(self):
        blocks = held(max_blocks=300)
        blocks.apply(0, stores(*range(100, 400)), MEMORY)
        blocks.apply(0, stores(400), MEMORY)
        assert (blocks.dropped, len(blocks)) == (3, 298)
        assert present(blocks, 100, 101, 102, 103, 400) == [103, 400]
        assert blocks.blocks_held(0) == 298

    def test_a_block_a_match_touched_is_kept_and_the_next_oldest_goes(self):
        blocks = held(max_blocks=5)
        blocks.apply(0, stores(1, 2, 3, 4, 5), MEMORY)
        blocks.touch([blocks.masks(BlockHash(1))[0]])
        blocks.apply(1, stores(6), DISK)                # under 100 blocks: one at a time
        assert (blocks.dropped, present(blocks, 1, 2, 3, 6)) == (1, [1, 3, 6])
        assert (blocks.blocks_held(0), blocks.blocks_held(1)) == (4, 0)

    def test_a_block_stored_again_is_used_again(self):
        blocks = held(max_blocks=5)
        blocks.apply(0, stores(1, 2, 3, 4, 5), MEMORY)
        blocks.apply(1, stores(1), MEMORY)              # held already: its age is new
        blocks.apply(0, stores(6), MEMORY)
        assert present(blocks, 1, 2, 3) == [1, 3]

    def test_widening_to_64_slots_forgets_what_the_budget_no_longer_holds(self):
        blocks = held(max_blocks=10)
        blocks.apply(0, stores(*range(10, 17)), MEMORY)
        blocks.widen()                                  # 32 bytes a block now, not 22
        assert (blocks.slots, blocks.max_blocks) == (64, 10 * 22 // 32)
        assert (blocks.dropped, present(blocks, *range(10, 17))) == (1, list(range(11, 17)))
        assert blocks.blocks_held(0) == 6
        blocks.apply(0, removals(16), MEMORY)           # read through the wider live mask
        assert (present(blocks, 16), blocks.blocks_held(0)) == ([], 5)
        blocks.set_live(1 << 40 | 1)
        blocks.apply(40, stores(14), MEMORY)
        blocks.apply(0, stores(15), DISK)
        assert masks(blocks, 14, 15) == [(1 << 40 | 1, 0), (1, 1)]
        assert blocks.blocks_held(40) == 1


@pytest.mark.parametrize("column", [MEMORY, DISK])
def test_a_batch_larger_than_the_budget_keeps_its_last_blocks(column):
    blocks = held(max_blocks=4)
    blocks.apply(0, stores(1, 2, 3, 4, 5, 6), column)
    assert present(blocks, 1, 2, 3, 4, 5, 6) == [3, 4, 5, 6]
    assert (len(blocks), blocks.dropped) == (4, 2)
