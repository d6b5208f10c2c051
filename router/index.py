"""The prefix index: which worker the router believes holds which blocks.

The index owns the router's belief, nothing else. It is fed by the workers' block events
(``EventBatch``), by what the router has just routed ("pending" entries, so a burst of
requests sharing a new prefix lands together before any event arrives), and by a worker's full
holdings when the router restarts or notices a lost batch.

Each worker gets a slot (a bit); each block maps to the bitmask of workers holding it, one
mask per tier, in a ``router.block_table.BlockTable``::

    held:     h0 -> 0b1011   h1 -> 0b0011   h2 -> 0b0001
    pending:  h1 -> {slot 2: expires 12.5}

    match([h0, h1, h2]) walks the chain ANDing masks:  slot0: 3 blocks, slot1: 2, slot3: 1

Rules:

- A stored event makes the block held by that worker and confirms (drops) a pending entry.
- A pending entry lives ``pending_ttl_s`` seconds (10 s: longer than a long prompt's queue
  and prefill under load, so its own stored events normally confirm it first); if no event
  confirms it by then it is gone. It covers at most ``pending_blocks`` (32) blocks past what
  the worker already holds: siblings find the worker by the first new blocks.
- Removing a worker forgets its blocks and pending entries at once: its slot is retired and
  every read ANDs with the live slots. A retired slot is given to a new worker only after one
  sweep has cleared every retired bit (when no never-used slot is left); past that the masks
  widen by 32 slots (a 32-bit word per tier).
- Events for an unknown worker, and removals of blocks that worker was not holding, are
  ignored and counted (``IndexCounters``), never an error. A sequence gap in a worker's
  batches is counted and marks the worker stale until ``rebuild`` replaces its holdings.
- Tiers: a worker holds a block while its memory or its disk does (``BlockStored``/``Removed``
  carry the tier; each tier has its own mask). ``match`` counts both, and says how many of
  each worker's matched blocks only its disk holds (``Match.disk_blocks``): a second walk over
  the memory masks alone, run only once some worker has announced a disk tier.
- ``match`` finds every worker's depth by a dyadic bisection of single-block lookups
  (``router.walk``): O(workers x log blocks) of them, at the same blocks of a shared prefix
  for every prompt that continues it.

Memory: the held blocks live in a ``router.block_table.BlockTable`` (NumPy arrays) of at most
``max_bytes``, the router's ``[router] index_bytes``, 2 GiB by default (llm-d's budget):
``bytes_for(1)`` = 22 bytes a block at up to 32 workers, 32 at 33 to 64, so 2 GiB holds 97M
blocks at 32 workers, five times the 18M of 32 Macs x (1M memory + 8M disk tokens) at block
16. Measured (``orchard simulate --decision-bench``, resident memory over indexed blocks, 32
workers): 24 to 27 bytes a block at 1M blocks, 31 at 18M (the dict of 128-bit ints it
replaces: 134 at 1M); figures in ``docs/benchmarks.md``, ``## Router``. Pending entries (a
dict, bounded by the routing rate x ``pending_ttl_s`` x ``pending_blocks``) are outside it.

Eviction, when a store finds the budget full: the least recently used blocks go first,
``max(1, max_blocks // 100)`` at a time (counted as ``dropped``). A block is used when an
event stores it (any worker, any tier) and when a ``match`` looks at it on the way to its
deepest match. Every walk starts at a chain's head and looks at the same blocks of a shared
prefix, so the router forgets old conversations before the system prompts and histories that
prompts still continue. Recency is kept to 1/64 of the budget's stores (generations).

What it costs, on the shipped conversation trace (8 workers x 1M tokens, block 512, seed 0,
2026-12-01): hit ratio and goodput (TTFT <= 2 s) with a budget of x times the fleet's 15,616
blocks, ``orchard simulate --policies orchard --index-bytes N`` with N = 22 x blocks (x = 1:
343,552 bytes, nothing dropped; x = 1/2: 171,776)::

    x                    1         3/4       1/2       1/4       1/8
    least recent out     0.2809    0.2543    0.2082    0.1354    0.1050
      goodput            57.83%    56.01%    51.67%    43.07%    38.63%
    oldest out (before)  0.2809    0.1943    0.1675    0.1188    0.0972
      goodput            57.83%    50.20%    46.75%    40.82%    37.11%

Refreshing by stores alone (not by matches) did no better than oldest-out (0.1631 at 1/2);
marking every block up to the deepest match instead of those looked at, no better than LRU
(0.2048). Forgetting can only cost a cache hit: size the budget to the fleet (``bytes_for``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from router.block_table import BlockTable, entry_bytes, key_of, keys_of
from router.kv.events import BlockRemoved, BlockStored, EventBatch, Tier
from router.kv.key import BlockHash
from router.walk import walk_chain

DEFAULT_INDEX_BYTES = 2 << 30  # 2 GiB, as llm-d budgets its index
DEFAULT_PENDING_TTL_S = 10.0
DEFAULT_PENDING_BLOCKS = 32
MEMORY, DISK = 0, 1  # the table's mask columns
_WORD = 32


@dataclass(frozen=True, slots=True)
class IndexCounters:
    """What the index ignored or dropped, for operators and tests."""

    unknown_worker_events: int
    unknown_block_removals: int
    sequence_gaps: int
    dropped: int
    pending_expired: int


@dataclass(frozen=True, slots=True)
class Match:
    """Leading blocks of a chain each worker holds (held or pending), by worker id."""

    blocks: dict[str, int]
    disk_blocks: dict[str, int] = field(default_factory=dict)  # of those, on disk only


class PrefixIndex:
    """Block -> holders bitmask per tier, plus pending routed entries; within a byte budget;
    workers added live."""

    def __init__(self, max_bytes: int = DEFAULT_INDEX_BYTES,
                 pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
                 pending_blocks: int = DEFAULT_PENDING_BLOCKS) -> None:
        if pending_ttl_s < 0:
            raise ValueError(f"pending_ttl_s must be >= 0 seconds, got {pending_ttl_s}")
        self._table = BlockTable(2, max_bytes)  # MEMORY, DISK
        self.pending_ttl_s = pending_ttl_s
        self.pending_blocks = pending_blocks
        self._slot: dict[str, int] = {}        # live worker -> bit index
        self._names: dict[int, str] = {}       # bit index -> live worker
        self._next_slot = 0                    # slots from here on were never used
        self._retired: set[int] = set()        # removed workers' slots, bits not yet cleared
        self._free: list[int] = []             # swept slots, ready for a new worker
        self._live_mask = 0
        self._live = np.zeros(1, np.uint32)    # the live mask as one tier's words
        self._held = np.zeros(_WORD, np.int64)  # memory blocks per slot
        self._disk_seen = False
        self._pending: dict[BlockHash, dict[int, float]] = {}
        self._pending_queue: deque[tuple[float, int, tuple[BlockHash, ...]]] = deque()
        self._seq: dict[str, int] = {}
        self._stale: set[str] = set()
        self._counts = dict(unknown_worker_events=0, unknown_block_removals=0,
                            sequence_gaps=0, dropped=0, pending_expired=0)

    @staticmethod
    def bytes_for(blocks: int, workers: int = 32) -> int:
        """The ``max_bytes`` that holds ``blocks`` blocks of up to ``workers`` workers."""
        return blocks * entry_bytes(2, -(-workers // _WORD))

    @property
    def max_blocks(self) -> int:
        """How many distinct blocks fit in the budget at the current mask width."""
        return self._table.max_entries

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._slot:
            raise ValueError(f"worker {worker_id!r} is already in the index; remove it first")
        slot = self._claim_slot()
        self._slot[worker_id] = slot
        self._names[slot] = worker_id
        self._set_live(self._live_mask | 1 << slot)
        self._held[slot] = 0

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything it held, at once. Unknown ids are a ValueError."""
        slot = self._slot_of(worker_id)
        del self._slot[worker_id], self._names[slot]
        self._seq.pop(worker_id, None)
        self._stale.discard(worker_id)
        self._set_live(self._live_mask & ~(1 << slot))
        self._retired.add(slot)
        for block in [b for b, entry in self._pending.items() if slot in entry]:
            entry = self._pending[block]
            del entry[slot]
            if not entry:
                del self._pending[block]

    def workers(self) -> list[str]:
        return list(self._slot)

    def stale_workers(self) -> list[str]:
        """Workers whose event stream had a gap: rebuild them from their holdings."""
        return sorted(self._stale)

    def blocks_held(self, worker_id: str) -> int:
        return int(self._held[self._slot_of(worker_id)])

    def __len__(self) -> int:
        return self._table.count

    def counters(self) -> IndexCounters:
        return IndexCounters(**self._counts)

    # ---- updates -------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        """Apply one worker's batch of stored / removed events, in order."""
        slot = self._slot.get(batch.worker_id)
        if slot is None:
            self._counts["unknown_worker_events"] += len(batch.events)
            return
        last = self._seq.get(batch.worker_id)
        if last is not None and batch.seq != last + 1:
            self._counts["sequence_gaps"] += 1
            self._stale.add(batch.worker_id)
        self._seq[batch.worker_id] = batch.seq
        for column, tier in ((MEMORY, Tier.MEMORY), (DISK, Tier.DISK)):
            events = [event for event in batch.events if event.tier == tier]
            if events:
                self._apply_tier(slot, events, column)

    def rebuild(self, worker_id: str, holdings: Iterable[BlockHash],
                disk_holdings: Iterable[BlockHash] = ()) -> None:
        """Replace what the index believes ``worker_id`` holds with ``holdings`` (in memory)
        and ``disk_holdings``."""
        slot = self._slot_of(worker_id)
        for column, blocks in ((MEMORY, list(holdings)), (DISK, list(disk_holdings))):
            self._clear_bits(column, {slot})
            if column == MEMORY:
                self._held[slot] = 0
            self._store(slot, blocks, column)
            self._confirm(slot, blocks)
        self._stale.discard(worker_id)
        self._seq.pop(worker_id, None)

    def note_routed(self, worker_id: str, hashes: Sequence[BlockHash], now: float,
                    held_blocks: int = 0) -> None:
        """Record that ``hashes`` were just sent to ``worker_id`` (pending until confirmed).

        Only the ``pending_blocks`` blocks after the ``held_blocks`` it already holds are
        noted: enough for a sibling sharing the new prefix to find the worker, at a bounded
        cost per decision.
        """
        chain = tuple(hashes[held_blocks:held_blocks + self.pending_blocks])
        if not chain or self.pending_ttl_s == 0:
            return
        slot = self._slot_of(worker_id)
        expires = now + self.pending_ttl_s
        for block in chain:
            self._pending.setdefault(block, {})[slot] = expires
        self._pending_queue.append((expires, slot, chain))

    def expire_pending(self, now: float) -> None:
        queue = self._pending_queue
        while queue and queue[0][0] <= now:
            expires, slot, chain = queue.popleft()
            for block in chain:
                entry = self._pending.get(block)
                if entry is not None and entry.get(slot) == expires:
                    del entry[slot]
                    self._counts["pending_expired"] += 1
                    if not entry:
                        del self._pending[block]

    # ---- queries -------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash], now: float) -> Match:
        """How many leading blocks of ``hashes`` each live worker holds or was just sent.

        The dyadic bisection (``router.walk``): O(workers x log blocks) single lookups, not
        one per block; the blocks it looked at, up to the deepest match, are marked used
        (eviction keeps them longest). Where the belief is not monotone (after evictions,
        say) the answer is a hint that can only cost a cache hit; the worker verifies.
        """
        self.expire_pending(now)
        if not hashes:
            return Match({})
        walked = walk_chain(hashes, self._probe)
        self._table.touch(walked.used)
        blocks = self._named(walked.ends[0])
        if not self._disk_seen:
            return Match(blocks)
        in_memory = self._named(walked.ends[1])
        return Match(blocks, {w: n - in_memory.get(w, 0) for w, n in blocks.items()
                              if n > in_memory.get(w, 0)})

    def holders(self, block: BlockHash) -> list[str]:
        """The live workers whose events say they hold ``block`` (routed-only excluded)."""
        words = self._table.words
        row = self._table.row(self._table.find_one(key_of(block)))
        mask = (_join(row[:words]) | _join(row[words:])) & self._live_mask  # either tier
        return [name for slot, name in self._names.items() if mask >> slot & 1]

    # ---- internals -----------------------------------------------------------------------

    def _probe(self, block: BlockHash) -> tuple[int, list[int]]:
        """``router.walk``'s probe: the block's slot and its live holders' masks, held or
        pending in either tier, then (once a disk tier is seen) held or pending in memory."""
        table, words = self._table, self._table.words
        slot = table.find_one(key_of(block))
        if slot is None:
            slot, memory, disk = -1, 0, 0
        elif words == 1:  # the common case, without building the row
            memory, disk = table.row_words(slot)
        else:
            row = table.row(slot)
            memory, disk = _join(row[:words]), _join(row[words:])
        for worker in self._pending.get(block, ()):
            memory |= 1 << worker
        memory &= self._live_mask
        if not self._disk_seen:
            return slot, [memory]
        return slot, [memory | disk & self._live_mask, memory]

    def _named(self, ends: list[tuple[int, int]]) -> dict[str, int]:
        result: dict[str, int] = {}
        for mask, depth in ends:
            self._record(result, mask, depth)
        return result

    def _record(self, result: dict[str, int], mask: int, depth: int) -> None:
        names = self._names
        for _ in range(mask.bit_count()):  # one turn per worker bit
            low = mask & -mask
            name = names.get(low.bit_length() - 1)
            if name is not None:
                result[name] = depth
            mask ^= low

    def _slot_of(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            known = ", ".join(sorted(self._slot)) or "none"
            raise ValueError(f"unknown worker {worker_id!r}: known workers are {known}")
        return slot

    def _claim_slot(self) -> int:
        if self._next_slot < self._table.words * _WORD:
            self._next_slot += 1
            return self._next_slot - 1
        if not self._free and self._retired:
            for column in (MEMORY, DISK):
                self._clear_bits(column, self._retired)
            self._free = sorted(self._retired)
            self._retired = set()
        if self._free:
            return self._free.pop(0)
        self._table.widen()
        self._set_live(self._live_mask)
        self._held = np.concatenate([self._held, np.zeros(_WORD, np.int64)])
        if self._table.count > self._table.max_entries:
            self._drop(self._table.count - self._table.max_entries)
        self._table.fit()
        return self._claim_slot()

    def _set_live(self, mask: int) -> None:
        self._live_mask = mask
        words = self._table.words
        self._live = np.frombuffer(mask.to_bytes(4 * words, "little"), "<u4").astype(np.uint32)

    def _bit(self, slot: int, column: int) -> tuple[int, np.uint32]:
        """The mask column (of ``table.masks``) and the bit of ``slot`` in ``column``'s tier."""
        return column * self._table.words + slot // _WORD, np.uint32(1 << slot % _WORD)

    def _apply_tier(self, slot: int, events: list, column: int) -> None:
        """One tier's events of a batch, in order: each block ends as its last event says."""
        blocks = [event.block for event in events]
        stored = [type(event) is BlockStored for event in events]
        if all(stored):
            self._store(slot, blocks, column)
        elif not any(stored):
            self._unstore(slot, blocks, column)
        else:  # stores and removals interleaved (a store evicting to make room, say)
            self._interleaved(slot, blocks, np.array(stored), column)
        self._confirm(slot, [block for block, kind in zip(blocks, stored) if kind])

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
        self._counts["unknown_block_removals"] += int(np.count_nonzero(~kinds & ~before))
        ends_held = kinds[last]
        self._clear(slot, slots[held & ~ends_held], column)
        self._store(slot, [blocks[i] for i in np.sort(order[last][ends_held]).tolist()], column)

    def _store(self, slot: int, blocks: list[BlockHash], column: int) -> None:
        if not blocks:
            return
        self._disk_seen |= column == DISK
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

    def _confirm(self, slot: int, stored: list[BlockHash]) -> None:
        """Stored blocks are no longer pending for the worker that stored them."""
        pending = self._pending
        for block in stored if pending else ():
            entry = pending.get(block)
            if entry is not None and entry.pop(slot, None) is not None and not entry:
                del pending[block]

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
        self._counts["unknown_block_removals"] += len(blocks) - len(held)
        self._clear(slot, held, column)

    def _clear(self, slot: int, slots: np.ndarray, column: int) -> None:
        """``slot``'s bit off at ``slots`` (all holding it); entries nobody holds go."""
        at, bit = self._bit(slot, column)
        self._table.masks[slots, at] &= ~bit
        if column == MEMORY:
            self._held[slot] -= len(slots)
        self._remove_unheld(slots)

    def _clear_bits(self, column: int, slots: set[int]) -> None:
        """Clear worker ``slots``' bits from ``column`` everywhere (a sweep over the table)."""
        masks, words = self._table.masks, self._table.words
        clear = np.zeros(words, np.uint32)
        for slot in slots:
            clear[slot // _WORD] |= np.uint32(1 << slot % _WORD)
        tier = slice(column * words, (column + 1) * words)
        for live in self._table.chunks():
            rows = masks[live, tier]
            hit = (rows & clear).any(1)
            masks[live[hit], tier] = rows[hit] & ~clear
            self._remove_unheld(live[hit])

    def _remove_unheld(self, slots: np.ndarray) -> None:
        """Remove the entries among ``slots`` that no live worker holds in either tier."""
        live = np.tile(self._live, 2)
        self._table.remove(slots[~(self._table.masks[slots] & live).any(1)])

    def _drop(self, count: int) -> None:
        table = self._table
        victims = table.oldest(count)
        memory = table.masks[victims, :table.words] & self._live
        bits = np.unpackbits(memory.view(np.uint8), axis=1, bitorder="little")
        self._held -= bits.sum(0, dtype=np.int64)
        table.remove(victims)
        self._counts["dropped"] += len(victims)


def _join(words: list[int]) -> int:
    """A mask's uint32 words, least significant first, as one int."""
    mask = 0
    for i, word in enumerate(words):
        mask |= word << _WORD * i
    return mask
