"""Shared prefixes: which prefixes several different prompts continue (a system prompt, a
few-shot preamble) as opposed to one conversation's own history.

The router tells them apart by the prompts it routes. When a prompt extends a known prefix
(its longest match anywhere), the last matched block is a branch point; the first
continuation is remembered, and a *different* one marks the prefix shared::

    S0 ─ S1 ─┬─ a1 ─ a2        first conversation continues S1 with a1
             └─ b1             a second, different continuation: S0..S1 are shared

A conversation's next turn continues its previous prompt from a new point each time, so its
history never branches and keeps its affinity to one worker; a shared prefix is worth
copying to another worker instead (it is prefilled once there, then reused by every
conversation that lands there). Marks are prefix-closed (an ancestor of a shared block is
shared), so the deepest shared block of a chain is found by bisection.

Memory is bounded: at most ``max_entries`` branch points and as many shared marks; past
that the oldest are dropped in batches, which only makes a prefix look unshared again.
"""
from __future__ import annotations

from itertools import islice
from typing import Sequence

from router.kv.key import BlockHash

DEFAULT_MAX_ENTRIES = 1_000_000


class SharedPrefixes:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._first_next: dict[BlockHash, BlockHash] = {}  # branch point -> first continuation
        self._shared: dict[BlockHash, None] = {}

    def __len__(self) -> int:
        return len(self._shared)

    def note(self, hashes: Sequence[BlockHash], matched_blocks: int) -> None:
        """A prompt with chain ``hashes`` matched ``matched_blocks`` leading blocks somewhere."""
        if not 0 < matched_blocks < len(hashes):
            return
        point, nxt = hashes[matched_blocks - 1], hashes[matched_blocks]
        first = self._first_next.setdefault(point, nxt)
        if first != nxt and point not in self._shared:
            for block in hashes[:matched_blocks]:
                self._shared[block] = None
            _trim(self._shared, self.max_entries)
        _trim(self._first_next, self.max_entries)

    def depth(self, hashes: Sequence[BlockHash], upto: int) -> int:
        """How many leading blocks of ``hashes`` (at most ``upto``) are shared."""
        lo, hi = 0, min(upto, len(hashes))  # invariant: hashes[:lo] shared
        shared = self._shared
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in shared:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _trim(entries: dict, limit: int) -> None:
    if len(entries) > limit:
        excess = len(entries) - limit + max(1, limit // 100)
        for key in list(islice(entries, excess)):
            del entries[key]
