"""The dyadic bisection: every worker's leading run of held blocks down a chain, from a few
single-block lookups (``router.index`` matches prompts with it).

Stores evict leaves first, so along a chain the set of holders only shrinks, and each worker's
depth is found by bisection: a lookup of the first and the last block, then of one block per
step inside each interval where the holders change, about log2(n) lookups per distinct depth
instead of n. Each interval is split at the multiple of the largest power of two inside it::

    blocks     0 ........ 127 128 ...... 255 256 ............... 511  (512: 8k tokens at block 16)
    looked at  ^                ^          ^                     ^    first, last, then 256, 128,
                                                                      192 or 384 ... as needed

Dyadic split points sit at the same positions of a prefix whatever the prompt's length, so
every prompt that shares a prefix looks at the same blocks of it (a midpoint split would look
at different ones for each length), and eviction, which keeps what walks look at, keeps them.

A block the walk does not look at counts as its neighbours say. A worker's store keeps its
chains prefix-closed, so a gap in the router's belief is the router's own forgetting and the
worker holds the block; where a belief is wrong anyway (not prefix-closed) the answer is a
hint that can only cost a cache hit: the worker verifies every block.

Measured on a 1M-block index (32 workers, a shared 2-core machine, 2026-12-01): for 1,000
prompts of 512 blocks extending stored chains, 11 lookups a match and 31 us (a lookup is 0.9
us when its memory is cached, 1.8 us when not); a vectorised lookup of all 512 blocks had
cost 75 us (28 us of it folding the hashes to keys, the rest NumPy's per-call cost, which a
33-block strided lookup pays too: 15 us). With the dict of 128-bit ints this replaced (five
times the memory) a whole decision took 50 us at p50 against 79 us now (``orchard simulate
--decision-bench --block-size 16``, load 1.5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# one block -> (its table slot or -1; per tier, its live holders' mask)
Probe = Callable[[int], tuple[int, list[int]]]


@dataclass(frozen=True, slots=True)
class Walked:
    """Per tier, ``(mask of workers, depth)`` pairs; and the table slots of the blocks the
    walk looked at on the way to the deepest match."""

    ends: list[list[tuple[int, int]]]
    used: list[int]


def walk_chain(hashes: Sequence[int], probe: Probe) -> Walked:
    """Each tier's leading runs down ``hashes`` (at least one block)."""
    probed: dict[int, tuple[int, list[int]]] = {}  # position -> what ``probe`` said

    def masks_at(position: int) -> list[int]:
        found = probed.get(position)
        if found is None:
            found = probed[position] = probe(hashes[position])
        return found[1]

    ends = [_runs(len(hashes), tier, masks_at) for tier in range(len(masks_at(0)))]
    deepest = max((depth for tier in ends for _, depth in tier), default=0)
    return Walked(ends, [slot for position, (slot, _) in probed.items()
                         if position < deepest and slot >= 0])


def dyadic_split(lo: int, hi: int) -> int:
    """The multiple of the largest power of two strictly between ``lo`` and ``hi`` (hi - lo
    >= 2): the common high bits of ``lo`` and ``hi - 1``, then the bit where they differ."""
    low = (lo ^ (hi - 1)).bit_length() - 1
    return (hi - 1) >> low << low


def _runs(n: int, tier: int, masks_at: Callable[[int], list[int]]) -> list[tuple[int, int]]:
    """``(bits, depth)``: the bits set at block 0 in ``tier`` hold their first ``depth``
    blocks."""
    head = masks_at(0)[tier]
    if not head:
        return []
    last = masks_at(n - 1)[tier] & head if n > 1 else head
    found = [(last, n)] if last else []
    stack = [(0, head, n - 1, last)]  # bits held through the interval's start, its end
    # Each step ends an interval or splits it in two smaller ones: at most 2 x n steps. A
    # bound, not a while, so that a broken split fails at once instead of spinning.
    for _ in range(2 * n):
        if not stack:
            return found
        lo, lo_mask, hi, hi_mask = stack.pop()
        if lo_mask == hi_mask:
            continue  # nobody's run ends inside (lo, hi]
        if hi - lo == 1:
            found.append((lo_mask & ~hi_mask, lo + 1))
            continue
        low = (lo ^ (hi - 1)).bit_length() - 1  # dyadic_split, inlined: the hot loop
        mid = (hi - 1) >> low << low
        mid_mask = masks_at(mid)[tier] & lo_mask
        stack.append((lo, lo_mask, mid, mid_mask))
        stack.append((mid, mid_mask, hi, hi_mask & mid_mask))
    raise RuntimeError(f"bisection over {n} blocks did not converge")
