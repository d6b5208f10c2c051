"""``HeldBlocks``: which workers' events say they hold each block, per tier, in a byte budget.

The half of the router's belief that the workers' block events write (``router.index`` owns
the rest: worker slots, pending entries, sequence numbers, matching). It keeps one
``router.block_table.BlockTable`` with a mask column per tier (``MEMORY``, ``DISK``) and a
bit per worker slot, counts each slot's memory blocks, and when a store finds the budget full
forgets the least recently used blocks, ``max(1, max_blocks // 100)`` at a time (the rule and
what it costs: ``router.index``'s header).

A worker's batch is applied a tier at a time, all of a tier's events in one pass: each block
ends as its last event says, and a removal of a block the worker did not hold just then is
counted (``unknown_removals``), never an error. Reads AND with the live slots
(``set_live``): a removed worker's bits stay until ``sweep`` clears them.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from router.block_keys import key_of, keys_of
from router.block_table import BlockTable
from router.kv.events import BlockStored
from router.kv.key import BlockHash

MEMORY, DISK = 0, 1  # the table's mask columns
WORD = 32


class HeldBlocks:
    def __init__(self, max_bytes: int) -> None:
        self._table = BlockTable(2, max_bytes)
        self._held = np.zeros(WORD, np.int64)  # memory blocks per slot
        self._live_mask = 0
        self._live = np.zeros(2, np.uint32)    # the live mask, for both tiers' words
        self.disk_seen = False                 # some worker has stored a block on disk
        self.dropped = 0
        self.unknown_removals = 0

    # ---- reads ---------------------------------------------------------------------------

    @property
    def max_blocks(self) -> int:
        return self._table.max_entries

    @property
    def slots(self) -> int:
        """Worker slots the masks hold now (32 a word)."""
        return self._table.words * WORD

    def __len__(self) -> int:
        return self._table.count

    def blocks_held(self, slot: int) -> int:
        return int(self._held[slot])

    def masks(self, block: BlockHash) -> tuple[int, int, int]:
        """``(table slot or -1, memory mask, disk mask)`` of one block, live slots only."""
        table, words, live = self._table, self._table.words, self._live_mask
        slot = table.find_one(key_of(block))
        if slot is None:
            return -1, 0, 0
        if words == 1:  # the common case, without building the row
            memory, disk = table.row_words(slot)
            return slot, memory & live, disk & live
        row = table.row(slot)
        return slot, _join(row[:words]) & live, _join(row[words:]) & live

    def touch(self, slots: list[int]) -> None:
        """``slots`` were looked at by a match: used now."""
        self._table.touch(slots)

    # ---- worker slots --------------------------------------------------------------------

    def set_live(self, mask: int) -> None:
        self._live_mask = mask
        words = np.frombuffer(mask.to_bytes(4 * self._table.words, "little"), "<u4")
        self._live = np.tile(words.astype(np.uint32), 2)

    def reset(self, slot: int) -> None:
        """``slot`` is given to a new worker: it holds nothing yet."""
        self._held[slot] = 0

    def sweep(self, slots: set[int]) -> None:
        """Clear ``slots``' bits (retired workers') from both tiers, everywhere."""
        for column in (MEMORY, DISK):
            self._clear_bits(column, slots)

    def widen(self) -> None:
        """32 more slots: a word more per tier. The budget then holds fewer blocks, so the
        least recently used past it go."""
        table = self._table
        table.widen()
        self.set_live(self._live_mask)
        self._held = np.concatenate([self._held, np.zeros(WORD, np.int64)])
        if table.count > table.max_entries:
            self._drop(table.count - table.max_entries)
        table.fit()

    # ---- events --------------------------------------------------------------------------

    def apply(self, slot: int, events: Sequence, column: int) -> None:
        """One tier's events from the worker in ``slot``, in order."""
        blocks = [event.block for event in events]
        stored = [type(event) is BlockStored for event in events]
        if all(stored):
            self._store(slot, blocks, column)
        elif not any(stored):
            self._unstore(slot, blocks, column)
        else:  # stores and removals interleaved (a store evicting to make room, say)
            self._interleaved(slot, blocks, np.array(stored), column)

    def replace(self, slot: int, blocks: list[BlockHash], column: int) -> None:
        """What ``slot`` holds in ``column`` is exactly ``blocks`` (a rebuild: a sweep)."""
        self._clear_bits(column, {slot})
        if column == MEMORY:
            self._held[slot] = 0
        self._store(slot, blocks, column)

    # ---- internals -----------------------------------------------------------------------

    def _bit(self, slot: int, column: int) -> tuple[int, np.uint32]:
        """The mask column (of ``table.masks``) and the bit of ``slot`` in ``column``'s tier."""
        return column * self._table.words + slot // WORD, np.uint32(1 << slot % WORD)

    def _interleaved(self, slot: int, blocks: list[BlockHash], stored: np.ndarray,
                     column: int) -> None:
        """Events of both kinds at once: per block, the state before each event is the event
        before it (or what the table held); a removal of a block not held then is unknown."""
        keys = keys_of(blocks)
        order = np.lexsort((np.arange(len(keys)), keys))  # by block, then as they came
        ordered, kinds = keys[order], stored[order]
        first = np.ones(len(keys), bool)
        first[1:] = ordered[1:] != ordered[:-1]
        last = np.ones(len(keys), bool)
        last[:-1] = first[1:]
        slots = self._table.find(ordered[first])
        at, bit = self._bit(slot, column)
        held = (self._table.masks[slots, at] & bit) != 0  # before the batch, per block
        before = np.empty(len(keys), bool)
        before[1:] = kinds[:-1]
        before[first] = held
        self.unknown_removals += int(np.count_nonzero(~kinds & ~before))
        ends_held = kinds[last]
        self._clear(slot, slots[held & ~ends_held], column)
        self._store(slot, [blocks[i] for i in np.sort(order[last][ends_held]).tolist()], column)

    def _store(self, slot: int, blocks: list[BlockHash], column: int) -> None:
        if not blocks:
            return
        self.disk_seen |= column == DISK
        keys = keys_of(blocks)
        if len(keys) > 1:
            _, first = np.unique(keys, return_index=True)
            keys = keys[np.sort(first)]  # distinct, in the order they were stored
        slots = self._admit(keys)
        slots = slots[slots >= 0]
        at, bit = self._bit(slot, column)
        masks = self._table.masks
        before = masks[slots, at]
        masks[slots, at] = before | bit
        if column == MEMORY:
            self._held[slot] += int(np.count_nonzero((before & bit) == 0))

    def _admit(self, keys: np.ndarray) -> np.ndarray:
        """The slots of ``keys`` (distinct, in store order), adding the absent ones and
        evicting the least recently used first when the budget is full. A key the same call
        added and then had to evict again (a batch larger than the budget) is -1."""
        table = self._table
        slots = table.find(keys)
        table.touch(slots[slots >= 0])
        absent = np.flatnonzero(slots < 0)
        added, moved = 0, False
        while added < len(absent):
            if not table.room():
                self._drop(max(1, table.max_entries // 100))
                moved = True  # the drop may have taken some of them
            buckets = table.buckets
            take = absent[added:added + table.room()]
            slots[take] = table.add(keys[take])
            moved |= table.buckets != buckets  # a growth moved every slot
            added += len(take)
        return table.find(keys) if moved else slots

    def _unstore(self, slot: int, blocks: list[BlockHash], column: int) -> None:
        keys = np.unique(keys_of(blocks))  # a repeated removal finds the bit gone: unknown
        slots = self._table.find(keys)
        at, bit = self._bit(slot, column)
        held = slots[(self._table.masks[slots, at] & bit) != 0]  # slot -1: the zero row
        self.unknown_removals += len(blocks) - len(held)
        self._clear(slot, held, column)

    def _clear(self, slot: int, slots: np.ndarray, column: int) -> None:
        """``slot``'s bit off at ``slots`` (all holding it); entries nobody holds go."""
        at, bit = self._bit(slot, column)
        self._table.masks[slots, at] &= ~bit
        if column == MEMORY:
            self._held[slot] -= len(slots)
        self._remove_unheld(slots)

    def _clear_bits(self, column: int, slots: set[int]) -> None:
        """Clear ``slots``' bits from ``column`` everywhere (a sweep over the table)."""
        masks, words = self._table.masks, self._table.words
        clear = np.zeros(words, np.uint32)
        for slot in slots:
            clear[slot // WORD] |= np.uint32(1 << slot % WORD)
        tier = slice(column * words, (column + 1) * words)
        for live in self._table.chunks():
            rows = masks[live, tier]
            hit = (rows & clear).any(1)
            masks[live[hit], tier] = rows[hit] & ~clear
            self._remove_unheld(live[hit])

    def _remove_unheld(self, slots: np.ndarray) -> None:
        """Remove the entries among ``slots`` that no live worker holds in either tier."""
        self._table.remove(slots[~(self._table.masks[slots] & self._live).any(1)])

    def _drop(self, count: int) -> None:
        table = self._table
        victims = table.oldest(count)
        memory = table.masks[victims, :table.words] & self._live[:table.words]
        bits = np.unpackbits(memory.view(np.uint8), axis=1, bitorder="little")
        self._held -= bits.sum(0, dtype=np.int64)
        table.remove(victims)
        self.dropped += len(victims)


def _join(words: list[int]) -> int:
    """A mask's uint32 words, least significant first, as one int."""
    mask = 0
    for i, word in enumerate(words):
        mask |= word << WORD * i
    return mask
