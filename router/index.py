"""The prefix index: which worker the router believes holds which blocks.

The index owns the router's belief, nothing else. It is fed by the workers' block events
(``EventBatch``), by what the router has just routed ("pending" entries, so a burst of
requests sharing a new prefix lands together before any event arrives), and by a worker's full
holdings when the router restarts or notices a lost batch.

Each worker gets a slot (a bit); each block maps to the bitmask of workers holding it, one
mask per tier (``router.held``, over a ``router.block_table.BlockTable``)::

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
  batches is counted and marks the worker stale until ``rebuild`` replaces its holdings; so
  does ``mark_gap``, for a lost last batch that no later batch shows (the feed's heartbeat).
- Tiers: a worker holds a block while its memory or its disk does (``BlockStored``/``Removed``
  carry the tier; each tier has its own mask). ``match`` counts both, and says how many of
  each worker's matched blocks only its disk holds (``Match.disk_blocks``): a second walk over
  the memory masks alone, run only once some worker has announced a disk tier.
- ``match`` finds every worker's depth by a dyadic bisection of single-block lookups
  (``router.walk``): O(workers x log blocks) of them, at the same blocks of a shared prefix
  for every prompt that continues it.

Memory: the held blocks live in NumPy arrays (``router.block_table``) of at most
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
    least recent out     0.2809    0.2549    0.2092    0.1325    0.1016
      goodput            57.83%    56.38%    51.59%    42.63%    38.17%
    oldest out (before)  0.2809    0.1934    0.1656    0.1226    0.0917
      goodput            57.83%    49.58%    46.65%    40.71%    36.45%

Refreshing by stores alone (not by matches) did no better than oldest-out (0.1653 at 1/2);
marking every block up to the deepest match instead of those looked at, no better than LRU
(0.2021). Forgetting can only cost a cache hit: size the budget to the fleet (``bytes_for``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from router.block_table import entry_bytes
from router.held import DISK, MEMORY, WORD, HeldBlocks
from router.kv.events import BlockStored, EventBatch, Tier
from router.kv.key import BlockHash
from router.walk import walk_chain

DEFAULT_INDEX_BYTES = 2 << 30  # 2 GiB, as llm-d budgets its index
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
    """Block -> holders bitmask per tier, plus pending routed entries; within a byte budget;
    workers added live."""

    def __init__(self, max_bytes: int = DEFAULT_INDEX_BYTES,
                 pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
                 pending_blocks: int = DEFAULT_PENDING_BLOCKS) -> None:
        if pending_ttl_s < 0:
            raise ValueError(f"pending_ttl_s must be >= 0 seconds, got {pending_ttl_s}")
        self._held = HeldBlocks(max_bytes)
        self.pending_ttl_s = pending_ttl_s
        self.pending_blocks = pending_blocks
        self._slot: dict[str, int] = {}        # live worker -> bit index
        self._names: dict[int, str] = {}       # bit index -> live worker
        self._next_slot = 0                    # slots from here on were never used
        self._retired: set[int] = set()        # removed workers' slots, bits not yet cleared
        self._free: list[int] = []             # swept slots, ready for a new worker
        self._live_mask = 0
        self._pending: dict[BlockHash, dict[int, float]] = {}
        self._pending_queue: deque[tuple[float, int, tuple[BlockHash, ...]]] = deque()
        self._seq: dict[str, int] = {}
        self._stale: set[str] = set()
        self._counts = dict(unknown_worker_events=0, sequence_gaps=0, pending_expired=0)

    @staticmethod
    def bytes_for(blocks: int, workers: int = 32) -> int:
        """The ``max_bytes`` that holds ``blocks`` blocks of up to ``workers`` workers."""
        return blocks * entry_bytes(2, -(-workers // WORD))

    @property
    def max_blocks(self) -> int:
        """How many distinct blocks fit in the budget at the current mask width."""
        return self._held.max_blocks

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._slot:
            raise ValueError(f"worker {worker_id!r} is already in the index; remove it first")
        slot = self._claim_slot()
        self._slot[worker_id] = slot
        self._names[slot] = worker_id
        self._set_live(self._live_mask | 1 << slot)
        self._held.reset(slot)

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
        return self._held.blocks_held(self._slot_of(worker_id))

    def __len__(self) -> int:
        return len(self._held)

    def counters(self) -> IndexCounters:
        return IndexCounters(unknown_block_removals=self._held.unknown_removals,
                             dropped=self._held.dropped, **self._counts)

    # ---- updates -------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        """Apply one worker's batch of stored / removed events, in order (a tier at a time:
        the tiers' masks are apart)."""
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
                self._held.apply(slot, events, column)
        self._confirm(slot, [e.block for e in batch.events if isinstance(e, BlockStored)])

    def mark_gap(self, worker_id: str, seq: int) -> None:
        """``worker_id``'s batches up to ``seq`` include one never applied that no later
        batch shows (the last one was lost): counted, and the worker is stale until
        ``rebuild``; batch ``seq + 1`` follows without a second gap. Unknown ids are a
        ValueError."""
        self._slot_of(worker_id)
        self._counts["sequence_gaps"] += 1
        self._stale.add(worker_id)
        self._seq[worker_id] = seq

    def rebuild(self, worker_id: str, holdings: Iterable[BlockHash],
                disk_holdings: Iterable[BlockHash] = ()) -> None:
        """Replace what the index believes ``worker_id`` holds with ``holdings`` (in memory)
        and ``disk_holdings``."""
        slot = self._slot_of(worker_id)
        for column, blocks in ((MEMORY, list(holdings)), (DISK, list(disk_holdings))):
            self._held.replace(slot, blocks, column)
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
        self._held.touch(walked.used)
        blocks = self._named(walked.ends[0])
        if not self._held.disk_seen:
            return Match(blocks)
        in_memory = self._named(walked.ends[1])
        return Match(blocks, {w: n - in_memory.get(w, 0) for w, n in blocks.items()
                              if n > in_memory.get(w, 0)})

    def holders(self, block: BlockHash) -> list[str]:
        """The live workers whose events say they hold ``block`` (routed-only excluded)."""
        _, memory, disk = self._held.masks(block)
        mask = memory | disk  # either tier
        return [name for slot, name in self._names.items() if mask >> slot & 1]

    # ---- internals -----------------------------------------------------------------------

    def _probe(self, block: BlockHash) -> tuple[int, list[int]]:
        """``router.walk``'s probe: the block's table slot and its live holders' masks, held
        or pending in either tier, then (once a disk tier is seen) in memory."""
        slot, memory, disk = self._held.masks(block)
        for worker in self._pending.get(block, ()):
            memory |= 1 << worker
        memory &= self._live_mask
        if not self._held.disk_seen:
            return slot, [memory]
        return slot, [memory | disk, memory]

    def _confirm(self, slot: int, stored: list[BlockHash]) -> None:
        """Stored blocks are no longer pending for the worker that stored them."""
        pending = self._pending
        for block in stored if pending else ():
            entry = pending.get(block)
            if entry is not None and entry.pop(slot, None) is not None and not entry:
                del pending[block]

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
        if self._next_slot < self._held.slots:
            self._next_slot += 1
            return self._next_slot - 1
        if not self._free and self._retired:
            self._held.sweep(self._retired)
            self._free = sorted(self._retired)
            self._retired = set()
        if self._free:
            return self._free.pop(0)
        self._held.widen()
        return self._claim_slot()

    def _set_live(self, mask: int) -> None:
        self._live_mask = mask
        self._held.set_live(mask)
