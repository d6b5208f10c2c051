"""The expiry order of a ``router.kv.ledger.BlockLedger`` whose blocks carry their own TTL.

A request may ask for its blocks to be kept 5 minutes or 1 hour (``workers.messages``'s
``CacheControls``), so blocks of one ledger expire after different idle times. The ledger's
LRU order is then no longer the order of expiry; this keeps one LRU order per TTL class
(at most three in practice: 5 minutes, 1 hour, the store's default), and the next block to
expire is the head of one of them::

    class 300 s    [ a ─ b ─ c ]   oldest use first; the head expires at last_use + 300
    class 3600 s   [ d ─ e ]       head d expires at last_use(d) + 3600
                   due(now): the head with the earliest deadline, if it has passed

Why a block never expires before its descendants: a writer raises the TTL of every block of
its chain (a block's TTL is the longest any writer of a chain through it asked for), so a
parent's TTL is at least its child's, and a parent is touched whenever its child is. Its
deadline is then at least its child's; inside one class, equal deadlines come out deepest
first (the ledger touches a chain deepest first), across classes an ancestor's deadline is
strictly later (a longer TTL, a use no earlier).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping, Protocol, Sequence

from router.kv.key import BlockHash


class _Entry(Protocol):
    ttl_s: float


class ExpiryOrder:
    """Blocks by TTL class, each class least recently used first."""

    def __init__(self) -> None:
        self._classes: dict[float, OrderedDict[BlockHash, None]] = {}

    def used(self, h: BlockHash, ttl_s: float) -> None:
        """``h`` (in class ``ttl_s``) was used now: it goes last in its class."""
        order = self._classes.setdefault(ttl_s, OrderedDict())
        order[h] = None
        order.move_to_end(h)

    def moved(self, h: BlockHash, old_ttl_s: float, new_ttl_s: float) -> None:
        """``h``'s TTL was raised; it joins its new class last (it is touched next)."""
        self.remove(h, old_ttl_s)
        self.used(h, new_ttl_s)

    def raise_chain(self, chain: Sequence[BlockHash], entries: Mapping[BlockHash, _Entry],
                    ttl_s: float) -> bool:
        """Raise the TTL of ``chain``'s blocks (all held) to ``ttl_s``; whether any rose."""
        raised = False
        for h in reversed(chain):  # deepest first, as a touch
            entry = entries[h]
            if entry.ttl_s < ttl_s:
                self.moved(h, entry.ttl_s, ttl_s)
                entry.ttl_s, raised = ttl_s, True
        return raised

    def remove(self, h: BlockHash, ttl_s: float) -> None:
        order = self._classes[ttl_s]
        del order[h]
        if not order:
            del self._classes[ttl_s]

    def due(self, now: float, last_used: Callable[[BlockHash], float]) -> BlockHash | None:
        """The block to expire first if it is idle for its TTL at ``now``; else None."""
        best: BlockHash | None = None
        best_deadline = 0.0
        for ttl_s, order in self._classes.items():
            head = next(iter(order))
            used = last_used(head)
            if now - used < ttl_s:  # the ledger's own test of expiry, to the last bit
                continue
            if best is None or used + ttl_s < best_deadline:
                best, best_deadline = head, used + ttl_s
        return best
