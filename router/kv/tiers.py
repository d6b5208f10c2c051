"""One worker's two store tiers as bookkeeping only: the model the simulator and the forecast
run of a worker's ``PrefixStore`` (``workers.cache.store``) with its ``DiskTier``.

``TieredLedger`` owns a memory ``BlockLedger`` and, when the worker has a disk tier, a disk
``BlockLedger`` with its own capacity, the same eviction policy and the same TTL. It follows
the store's rules, without tensors::

    insert   chain ─► memory ledger ──evicted (capacity, not TTL or invalidation)──► disk ledger
    match    [ memory ✓ ✓ ][ disk ✓ ✓ ][ ✗ ...      both parts touched; the caller inserts
                                                    the chain again (promotion: read, not
                                                    written; the disk keeps its copy)

A block lives in a tier while that tier's ledger holds it; the worker holds it while any tier
does. Capacities are in tokens (``bytes_per_token = 1``); time is the injected ``clock``.
"""
from __future__ import annotations

from typing import Callable, Sequence

from router.kv.events import BlockEvent, Tier
from router.kv.key import BlockHash
from router.kv.ledger import DEFAULT_EVICTION, BlockLedger, Eviction, RemovalReason


class TieredLedger:
    """A worker's memory tier and optional disk tier, in tokens (see the module header)."""

    def __init__(self, memory_tokens: int, disk_tokens: int, ttl_s: float,
                 clock: Callable[[], float], eviction: Eviction | str = DEFAULT_EVICTION) -> None:
        if disk_tokens < 0:
            raise ValueError(f"disk_tokens must be >= 0 (0: no disk tier), got {disk_tokens}")
        self.memory = BlockLedger(memory_tokens, ttl_s, clock, bytes_per_token=1,
                                  policy=eviction, on_remove=self._spill)
        self.disk: BlockLedger | None = None
        if disk_tokens:
            self.disk = BlockLedger(disk_tokens, ttl_s, clock, bytes_per_token=1,
                                    policy=eviction, tier=Tier.DISK)
        # memory block -> (parent, namespace, tokens): the ledger forgets them before a spill
        self._origin: dict[BlockHash, tuple[BlockHash, str, int]] = {}
        self.promoted = 0  # blocks read back from disk into memory: stored, never written

    def capacity_tokens(self) -> tuple[int, int]:
        """(memory, disk) capacity in tokens."""
        return (self.memory.capacity_bytes,
                self.disk.capacity_bytes if self.disk is not None else 0)

    # ---- queries -------------------------------------------------------------------------

    def peek(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Leading blocks held in memory, then how many more on disk; nothing touched."""
        in_memory = self.memory.peek(hashes)
        if self.disk is None or in_memory == len(hashes):
            return in_memory, 0
        return in_memory, self.disk.peek(hashes[in_memory:])

    def holds(self, block: BlockHash) -> bool:
        return self.memory.peek([block]) == 1 or (self.disk is not None
                                                  and self.disk.peek([block]) == 1)

    def ttl_left(self, block: BlockHash) -> float:
        """Seconds ``block`` stays in some tier unless used again (0.0 when in none)."""
        disk = self.disk.ttl_left(block) if self.disk is not None else 0.0
        return max(self.memory.ttl_left(block), disk)

    def age(self, block: BlockHash) -> float:
        """Seconds since ``block`` entered the tier that holds it (memory first)."""
        if block in self.memory or self.disk is None:
            return self.memory.age(block)
        return self.disk.age(block)

    def namespaces(self) -> list[str]:
        disk = self.disk.namespaces() if self.disk is not None else []
        return sorted(set(self.memory.namespaces()) | set(disk))

    def written_blocks(self) -> int:
        """Blocks computed and stored (a block promoted from disk was read, not written)."""
        return self.memory.stats().stored_blocks - self.promoted

    # ---- updates -------------------------------------------------------------------------

    def match(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Leading blocks held in memory, then how many more on disk (both parts touched)."""
        in_memory = self.memory.match(hashes)
        if self.disk is None or in_memory == len(hashes):
            return in_memory, 0
        on_disk = self.disk.match(hashes[in_memory:])
        if on_disk:
            self.disk.touch(self.disk.chain_to(hashes[in_memory + on_disk - 1]))
        return in_memory, on_disk

    def insert(self, hashes: Sequence[BlockHash], token_counts: Sequence[int] | int,
               namespace: str, root: BlockHash) -> list[BlockHash]:
        """Store ``hashes`` in memory (as ``BlockLedger.insert``); return the new blocks."""
        on_disk: set[BlockHash] = set()
        if self.disk is not None:
            counts = ([token_counts] * len(hashes) if isinstance(token_counts, int)
                      else list(token_counts))
            parent = root
            for h, n in zip(hashes, counts):
                self._origin[h] = (parent, namespace, n)
                parent = h
            # before the insert: the spills it causes may push these very blocks off the disk
            on_disk = {h for h in hashes if h in self.disk}
        new = self.memory.insert(hashes, token_counts, namespace, root)
        if self.disk is not None:
            self.promoted += sum(1 for h in new if h in on_disk)
            for h in hashes:
                if h not in self.memory:  # not stored (no room): nothing to spill later
                    self._origin.pop(h, None)
        return new

    def invalidate_namespace(self, label: str) -> int:
        """Drop ``label``'s blocks from both tiers; an unknown label drops nothing."""
        gone = 0
        for ledger in (self.memory, self.disk):
            if ledger is not None and label in ledger.namespaces():
                gone += ledger.invalidate_namespace(label)
        return gone

    def drain_events(self) -> list[BlockEvent]:
        events = self.memory.drain_events()
        return events + (self.disk.drain_events() if self.disk is not None else [])

    def _spill(self, block: BlockHash, reason: RemovalReason) -> None:
        origin = self._origin.pop(block, None)
        if self.disk is None or reason != RemovalReason.EVICTED or origin is None:
            return
        parent, namespace, tokens = origin
        if block in self.disk:
            self.disk.touch(self.disk.chain_to(block))
            return
        self.disk.expire()  # before reading the chain: insert would expire its head
        self.disk.insert(self.disk.chain_to(parent) + [block], tokens, namespace, parent)
