"""The "reuse" eviction order of a ``router.kv.ledger.BlockLedger``: a lazy heap of priorities.

A block's priority is ``last use + horizon x min(hits, 3)`` (the ledger's header says why),
never below its descendants' (the ledger touches a chain deepest first and hands each block
the priority of the one below it). The heap is lazy: every touch pushes a new item, and an
item is live only while it carries its entry's current priority; dead items are skipped when
popped and dropped by a compaction once they outnumber live ones four to one.
"""
from __future__ import annotations

import heapq
from typing import Callable, Protocol

from router.kv.key import BlockHash

MAX_REUSE_BONUS = 3  # hits beyond three earn no further cache lifetime


class _Entry(Protocol):
    hits: int
    priority: float


class ReuseOrder:
    """Priorities of a ledger's blocks; the victim is the live leaf of lowest priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, BlockHash]] = []  # (priority, seq, block)
        self._seq = 0
        self.horizon = 0.0  # the age at which the last victim left

    def restored(self, h: BlockHash, entry: _Entry, last_used: float) -> None:
        """A block found at restart enters at its last use, with no bonus."""
        self._push(last_used, h)

    def touched(self, h: BlockHash, entry: _Entry, now: float, deeper: float) -> float:
        """``h`` was used at ``now``; ``deeper`` is its child's new priority. Returns its own."""
        bonus = self.horizon * min(entry.hits, MAX_REUSE_BONUS)
        entry.priority = max(entry.priority, now + bonus, deeper)
        self._push(entry.priority, h)
        return entry.priority

    def evict(self, fits: Callable[[], bool], live: Callable[[BlockHash, float], bool],
              evictable: Callable[[BlockHash], bool], remove: Callable[[BlockHash], None],
              now: Callable[[], float], entries: int) -> bool:
        """Remove victims until ``fits()``; False when only unevictable blocks are left.

        ``live(h, priority)``: the item is the entry's current one; ``evictable(h)``: a leaf
        outside the chain being inserted.
        """
        skipped = []
        try:
            while not fits():
                if not self._heap:
                    return False  # only protected blocks are left: capacity exhausted
                item = heapq.heappop(self._heap)
                priority, _, h = item
                if not live(h, priority):
                    continue
                if not evictable(h):
                    skipped.append(item)
                    continue
                self.horizon = max(0.0, now() - priority)
                remove(h)
            return True
        finally:
            for item in skipped:
                heapq.heappush(self._heap, item)
            if len(self._heap) > 4 * entries + 1024:
                self._compact(live)

    def _push(self, priority: float, h: BlockHash) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (priority, self._seq, h))

    def _compact(self, live: Callable[[BlockHash, float], bool]) -> None:
        # Keep each entry's live item, sequence number included, so ties still go oldest
        # first after a rebuild exactly as before it.
        kept: dict[BlockHash, tuple[float, int, BlockHash]] = {}
        for item in self._heap:
            if live(item[2], item[0]):
                kept[item[2]] = min(item, kept.get(item[2], item))
        self._heap = list(kept.values())
        heapq.heapify(self._heap)
