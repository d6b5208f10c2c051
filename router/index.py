"""The prefix index: which worker the router believes holds which blocks.

The index owns the router's belief, nothing else. It is fed by the workers' block events
(``EventBatch``), by what the router has just routed ("pending" entries, so a burst of
requests sharing a new prefix lands together before any event arrives), and by a worker's full
holdings when the router restarts or notices a lost batch.

Each worker gets a slot (a bit); each block maps to the bitmask of workers holding it::

    held:     h0 -> 0b1011   h1 -> 0b0011   h2 -> 0b0001
    pending:  h1 -> {slot 2: expires 12.5}

    match([h0, h1, h2]) walks the chain ANDing masks:  slot0: 3 blocks, slot1: 2, slot3: 1

Rules:

- A stored event makes the block held by that worker and confirms (drops) a pending entry.
- A pending entry lives ``pending_ttl_s`` seconds (10 s: longer than a long prompt's queue
  and prefill under load, so its own stored events normally confirm it first); if no event
  confirms it by then it is gone. It covers at most ``pending_blocks`` (32) blocks past what
  the worker already holds: siblings find the worker by the first new blocks.
- Removing a worker forgets its blocks and pending entries at once (its slot is cleared from
  every mask lazily: the slot is retired and never reused for another worker).
- Events for an unknown worker, and removals of blocks that worker was not holding, are
  ignored and counted (``IndexCounters``), never an error. A sequence gap in a worker's
  batches is counted and marks the worker stale until ``rebuild`` replaces its holdings.
- Tiers: a worker holds a block while its memory or its disk does (``BlockStored``/``Removed``
  carry the tier; each tier has its own mask). ``match`` counts both, and says how many of
  each worker's matched blocks only its disk holds (``Match.disk_blocks``): workers' memory
  chains are prefix-closed (leaves leave first), so that is found by a second bisection over
  the memory masks alone, run only once some worker has announced a disk tier.
- Memory is bounded: at most ``max_blocks`` distinct blocks; past that the oldest-stored
  entries are dropped in batches (counted as ``dropped``), which can only cost a cache hit.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable, Sequence

from router.kv.events import BlockRemoved, BlockStored, EventBatch, Tier
from router.kv.key import BlockHash

DEFAULT_MAX_BLOCKS = 4_000_000
DEFAULT_PENDING_TTL_S = 10.0
DEFAULT_PENDING_BLOCKS = 32


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
    """Block -> holders bitmask, plus pending routed entries; bounded; workers added live."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
                 pending_blocks: int = DEFAULT_PENDING_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        if pending_ttl_s < 0:
            raise ValueError(f"pending_ttl_s must be >= 0 seconds, got {pending_ttl_s}")
        self.max_blocks = max_blocks
        self.pending_ttl_s = pending_ttl_s
        self.pending_blocks = pending_blocks
        self._slot: dict[str, int] = {}        # live worker -> bit index
        self._names: dict[int, str] = {}       # bit index -> live worker
        self._next_slot = 0
        self._live_mask = 0
        self._held: dict[BlockHash, int] = {}  # insertion order = oldest first
        self._disk: dict[BlockHash, int] = {}  # blocks on workers' disk tiers
        self._held_count: dict[str, int] = {}
        self._pending: dict[BlockHash, dict[int, float]] = {}
        self._pending_queue: deque[tuple[float, int, tuple[BlockHash, ...]]] = deque()
        self._seq: dict[str, int] = {}
        self._stale: set[str] = set()
        self._counts = dict(unknown_worker_events=0, unknown_block_removals=0,
                            sequence_gaps=0, dropped=0, pending_expired=0)

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._slot:
            raise ValueError(f"worker {worker_id!r} is already in the index; remove it first")
        slot = self._next_slot
        self._next_slot += 1
        self._slot[worker_id] = slot
        self._names[slot] = worker_id
        self._live_mask |= 1 << slot
        self._held_count[worker_id] = 0

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything it held, at once. Unknown ids are a ValueError."""
        slot = self._slot_of(worker_id)
        del self._slot[worker_id], self._names[slot], self._held_count[worker_id]
        self._seq.pop(worker_id, None)
        self._stale.discard(worker_id)
        self._live_mask &= ~(1 << slot)
        # Masks keep the retired bit until their block is next touched; every read ANDs
        # with the live mask, so the worker's blocks are forgotten now, in O(1).

    def workers(self) -> list[str]:
        return list(self._slot)

    def stale_workers(self) -> list[str]:
        """Workers whose event stream had a gap: rebuild them from their holdings."""
        return sorted(self._stale)

    def blocks_held(self, worker_id: str) -> int:
        self._slot_of(worker_id)
        return self._held_count[worker_id]

    def __len__(self) -> int:
        return len(self._held)

    def counters(self) -> IndexCounters:
        return IndexCounters(**self._counts)

    # ---- updates -------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        """Apply one worker's batch of stored / removed events."""
        slot = self._slot.get(batch.worker_id)
        if slot is None:
            self._counts["unknown_worker_events"] += len(batch.events)
            return
        last = self._seq.get(batch.worker_id)
        if last is not None and batch.seq != last + 1:
            self._counts["sequence_gaps"] += 1
            self._stale.add(batch.worker_id)
        self._seq[batch.worker_id] = batch.seq
        for event in batch.events:
            held = self._disk if event.tier == Tier.DISK else self._held
            if isinstance(event, BlockStored):
                self._store(batch.worker_id, slot, event.block, held)
            elif isinstance(event, BlockRemoved):
                self._unstore(batch.worker_id, slot, event.block, held)

    def rebuild(self, worker_id: str, holdings: Iterable[BlockHash],
                disk_holdings: Iterable[BlockHash] = ()) -> None:
        """Replace what the index believes ``worker_id`` holds with ``holdings`` (in memory)
        and ``disk_holdings``."""
        slot = self._slot_of(worker_id)
        bit = 1 << slot
        for held, blocks in ((self._held, holdings), (self._disk, disk_holdings)):
            for block in [b for b, mask in held.items() if mask & bit]:
                self._unstore(worker_id, slot, block, held)
            for block in blocks:
                self._store(worker_id, slot, block, held)
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

        Stores evict leaves first, so along a chain the set of holders only shrinks: the
        depth of every worker is found by bisection (O(workers x log blocks) lookups, not
        one per block). Where the belief is not monotone (e.g. after ``dropped`` entries)
        the answer is a hint that can only cost a cache hit; the worker verifies its blocks.
        """
        self.expire_pending(now)
        if not self._disk:
            return Match(self._depths(hashes, self._mask))
        blocks = self._depths(hashes, self._mask_any_tier)
        memory = self._depths(hashes, self._mask)
        disk = {w: n - memory.get(w, 0) for w, n in blocks.items() if n > memory.get(w, 0)}
        return Match(blocks, disk)

    def _depths(self, hashes: Sequence[BlockHash], mask_of) -> dict[str, int]:
        result: dict[str, int] = {}
        if not hashes:
            return result
        first = mask_of(hashes[0]) & self._live_mask
        if not first:
            return result
        last_i = len(hashes) - 1
        last = mask_of(hashes[last_i]) & first
        if last:
            self._record(result, last, len(hashes))
        stack = [(0, first, last_i, last)]
        # Each step ends an interval or splits it in two smaller ones: at most 2 x len(hashes)
        # steps. A bound, not a while, so that a broken split fails at once instead of spinning.
        for _ in range(2 * len(hashes)):
            if not stack:
                break
            lo, lo_mask, hi, hi_mask = stack.pop()
            if lo_mask == hi_mask:
                continue  # nobody's depth ends inside (lo, hi]
            if hi - lo == 1:
                self._record(result, lo_mask & ~hi_mask, lo + 1)
                continue
            mid = (lo + hi) // 2
            mid_mask = mask_of(hashes[mid]) & lo_mask
            stack.append((lo, lo_mask, mid, mid_mask))
            stack.append((mid, mid_mask, hi, hi_mask & mid_mask))
        else:
            raise RuntimeError(f"bisection over {len(hashes)} blocks did not converge")
        return result

    def _mask_any_tier(self, block: BlockHash) -> int:
        return self._mask(block) | self._disk.get(block, 0)

    def holders(self, block: BlockHash) -> list[str]:
        """The live workers whose events say they hold ``block`` (routed-only excluded)."""
        mask = (self._held.get(block, 0) | self._disk.get(block, 0)) & self._live_mask
        return [name for slot, name in self._names.items() if mask >> slot & 1]  # either tier

    def _mask(self, block: BlockHash) -> int:
        mask = self._held.get(block, 0)
        entry = self._pending.get(block)
        if entry:
            for slot in entry:
                mask |= 1 << slot
        return mask

    # ---- internals -----------------------------------------------------------------------

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

    def _store(self, worker_id: str, slot: int, block: BlockHash, held: dict) -> None:
        bit = 1 << slot
        mask = held.get(block, 0) & self._live_mask
        if not mask & bit and held is self._held:
            self._held_count[worker_id] += 1
        held[block] = mask | bit
        entry = self._pending.get(block)
        if entry is not None and entry.pop(slot, None) is not None and not entry:
            del self._pending[block]
        if len(held) > self.max_blocks:
            self._drop_oldest(held)

    def _unstore(self, worker_id: str, slot: int, block: BlockHash, held: dict) -> None:
        bit = 1 << slot
        mask = held.get(block, 0) & self._live_mask
        if not mask & bit:
            self._counts["unknown_block_removals"] += 1
            return
        if held is self._held:
            self._held_count[worker_id] -= 1
        mask &= ~bit
        if mask:
            held[block] = mask
        else:
            del held[block]

    def _drop_oldest(self, held: dict) -> None:
        # Drop 1% at a time so the scan over the dict's head is paid rarely.
        excess = len(held) - self.max_blocks + max(1, self.max_blocks // 100)
        for block in list(islice(held, excess)):
            mask = held.pop(block) & self._live_mask
            for _ in range(mask.bit_count() if held is self._held else 0):
                low = mask & -mask
                self._held_count[self._names[low.bit_length() - 1]] -= 1
                mask ^= low
            self._counts["dropped"] += 1
