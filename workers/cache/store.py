"""The prefix store: K/V tensors per block, keyed by the chained block hash, bounded in bytes.

The store owns the tensors; the bookkeeping (which blocks, LRU leaves first, TTL, invalidation,
events, the event log) is ``router.kv.ledger.BlockLedger``, the same class the simulator replays.
When the ledger drops a block (evicted, expired, invalidated) it calls back here and the
block's tensors go with it.

One block holds exactly its own slice of every layer's K and V, nothing more::

    block i  keys   [layers, kv_heads, block_size, head_dim]   (float32: 4 bytes/element)
             values [layers, kv_heads, block_size, head_dim]   (or their 8/4-bit encoding)
             identity (namespace, parent hash, position, token ids: checked on every hit)

so the bytes per cached token are ``2 x layers x kv_heads x head_dim x bytes/element``.

A lookup answers hit, partial, near miss or miss (``workers.cache.lookup`` says which is
which), with the cache to extend when tokens are reused.

Tiers. With a ``DiskTier`` (``workers.cache.disk_tier``) the store has two, each with its own
budget: a block the memory ledger evicts is spilled to disk (``workers.cache.spill``: written
behind, off the engine's step), and a lookup continues its chain on disk where memory ends::

    prompt   [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ]
    memory     ✓     ✓                        matched in memory, touched
    disk                   ✓     ✓            read (prefetched at submit), verified, promoted
                                       ✗      the suffix from here is prefilled

Either tier may hold K/V quantized (``workers.cache.kv_quant``, ``kv_bits`` 8 or 4); a block moving
between tiers of different precision is re-encoded, and a hit is always decoded to the
model's dtype. TTL and invalidation cover both tiers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.events import BlockEvent
from router.kv.key import (BlockHash, BlockIdentity, ChainIdentities, Hasher, Namespace,
                        hash_blocks, identities, reusable_tokens)
from router.kv.ledger import (DEFAULT_EVICTION, BlockLedger, Eviction, Holding, LedgerEvent,
                           LedgerStats, RemovalReason)
from workers.cache.disk_files import BlockData
from workers.cache.disk_tier import DiskStats, DiskTier
from workers.cache.blocks import BlockSlices, KVShape, StoredBlock, common_prefix
from workers.cache.kv_quant import KVCodec
from workers.cache.lookup import Lookup, assemble, outcome
from workers.cache.spill import overflow, spill
from workers.messages import LookupReport

log = logging.getLogger(__name__)
_LOGGED_MISMATCHES = 64  # distinct blocks whose identity mismatch is logged (once each)


@dataclass(frozen=True, slots=True)
class StoreStats:
    ledger: LedgerStats
    tensor_bytes: int        # bytes of K/V actually held in memory
    bytes_per_token: int     # memory tier: 2 x layers x kv_heads x head_dim x bytes/elem
    identity_mismatches: int  # hits refused: the block under the hash is another block
    disk: DiskStats | None = None


class PrefixStore:
    """Deduplicated per-block K/V storage with LRU/TTL/invalidation from ``BlockLedger``."""

    def __init__(self, shape: KVShape, block_size: int, capacity_bytes: int, ttl_s: float,
                 clock: Callable[[], float], eviction: Eviction = DEFAULT_EVICTION, *, kv_bits: int = 0,
                 disk: DiskTier | None = None, hasher: Hasher = hash_blocks) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.shape = shape
        self.block_size = block_size
        self.codec = KVCodec(kv_bits, shape.dtype)
        self.codec.check(shape.head_dim)
        self.disk = disk
        self._hash = hasher
        self._logged: set[BlockHash] = set()
        self._blocks: dict[BlockHash, StoredBlock] = {}
        self._tensor_bytes = 0
        self._mismatches = 0
        self._promoted = 0  # blocks read back from disk into memory: stored, not written
        self.ledger = BlockLedger(capacity_bytes, ttl_s, clock,
                                  shape.tier_bytes_per_token(self.codec),
                                  policy=eviction, on_remove=self._drop)

    # ---- lookup --------------------------------------------------------------------------

    def prefetch(self, namespace: Namespace, prompt: Sequence[int]) -> int:
        """Start reading the prompt's blocks that only the disk holds; return how many."""
        if self.disk is None:
            return 0
        hashes = self._hash(prompt, self.block_size, namespace)
        in_memory = self.ledger.peek(hashes)
        on_disk = self.disk.ledger.peek(hashes[in_memory:])
        self.disk.prefetch(hashes[in_memory:in_memory + on_disk])
        return on_disk

    def lookup(self, namespace: Namespace, prompt: Sequence[int]) -> Lookup:
        """Find the longest stored prefix of ``prompt`` (at most ``len(prompt) - 1`` tokens)."""
        bs = self.block_size
        mismatches_before = self._mismatches
        hashes = self._hash(prompt, bs, namespace)
        held = self.ledger.peek(hashes)
        in_memory = self._verified(hashes, identities(namespace, hashes, prompt, bs, 0, held), held)
        in_memory = self.ledger.match(hashes[:in_memory])
        loaded = self._load_from_disk(namespace, hashes, prompt, in_memory)
        matched = in_memory + len(loaded)
        cached = reusable_tokens(len(prompt), matched, bs)
        parent = hashes[matched - 1] if matched else namespace.root()
        lcp, child = self._closest_child(parent, prompt[matched * bs:])
        common = matched * bs + lcp
        next_prompt = prompt[common] if common < len(prompt) else None
        next_stored = child[lcp] if child is not None and lcp < len(child) else None
        reusable = reusable_tokens(len(prompt), len(hashes), bs)
        report = LookupReport(
            outcome=outcome(cached, reusable, common, next_prompt, next_stored),
            prompt_tokens=len(prompt), matched_tokens=cached,
            common_prefix=common, next_prompt_token=next_prompt, next_stored_token=next_stored,
            entry_age_s=self._age(hashes[matched - 1]) if matched else None,
            ttl_s=self.ledger.ttl_s, disk_tokens=max(0, cached - in_memory * bs),
            identity_mismatches=self._mismatches - mismatches_before)
        if not cached:
            return Lookup(report, None)
        parts = [self._decoded(self._blocks[h]) for h in hashes[:in_memory]]
        parts += [(self.disk.codec.decode(b.keys), self.disk.codec.decode(b.values))
                  for b in loaded]
        return Lookup(report, assemble(parts, cached, self.shape.layers))

    def _load_from_disk(self, namespace: Namespace, hashes: list[BlockHash],
                        prompt: Sequence[int], in_memory: int) -> list[BlockData]:
        """Verified disk blocks continuing the memory match; promoted into memory."""
        if self.disk is None:
            return []
        run = self.disk.ledger.peek(hashes[in_memory:])
        chain = hashes[in_memory:in_memory + run]
        want = identities(namespace, hashes, prompt, self.block_size, in_memory, in_memory + run)
        loaded = self.disk.load(chain, want, self.mismatch)
        if loaded:
            read = {b.record.block: StoredBlock(b.record.identity, b.keys, b.values)
                    for b in loaded}
            self._promote(namespace, hashes[:in_memory + len(loaded)], read, self.disk.codec)
        return loaded

    def _promote(self, namespace: Namespace, chain: Sequence[BlockHash],
                 blocks: dict[BlockHash, StoredBlock], codec: KVCodec) -> int:
        """Store ``blocks`` (held in ``codec``, not computed here) along ``chain``; how many."""
        new = self.ledger.insert(chain, self.block_size, namespace.label(), namespace.root())
        self._promoted += len(new)
        for h in new:
            b = blocks[h]
            keys, values = self.codec.recode(b.keys, codec), self.codec.recode(b.values, codec)
            self._put(h, StoredBlock(b.identity, keys, values))
        mx.eval([self._blocks[h].keys for h in new], [self._blocks[h].values for h in new])
        return len(new)

    def _verified(self, hashes: Sequence[BlockHash], want: Sequence[BlockIdentity], n: int
                  ) -> int:
        """How many of the first ``n`` held blocks really are the prompt's: namespace, parent,
        position and tokens, not the hash alone (a collision is a miss, counted)."""
        for i in range(n):
            held = self._blocks[hashes[i]].identity
            if held != want[i]:
                self.mismatch(hashes[i], want[i], held)
                return i
        return n

    def mismatch(self, block: BlockHash, want: BlockIdentity, held: BlockIdentity) -> None:
        """Count a block refused for its identity; log it once per block."""
        self._mismatches += 1
        if block in self._logged or len(self._logged) >= _LOGGED_MISMATCHES:
            return
        self._logged.add(block)
        log.warning("cache identity mismatch at block %032x: the lookup wants namespace %s, "
                    "parent %032x, position %d; the store holds namespace %s, parent %032x, "
                    "position %d%s: served as a miss", block, want.namespace, want.parent,
                    want.position, held.namespace, held.parent, held.position,
                    "" if want.tokens == held.tokens else ", other tokens")

    def _closest_child(self, parent: BlockHash, want: Sequence[int]
                       ) -> tuple[int, tuple[int, ...] | None]:
        """The stored child block of ``parent`` (either tier) sharing the longest prefix with
        ``want`` (the prompt from that block on); on a tie the first found, memory first."""
        candidates = [self._blocks[h].identity.tokens for h in self.ledger.children(parent)]
        if self.disk is not None:
            candidates += [self.disk.tokens(h) for h in self.disk.ledger.children(parent)
                           if h not in self._blocks]
        best, best_tokens = 0, None
        for tokens in candidates:
            n = common_prefix(tokens, want)
            if best_tokens is None or n > best:
                best, best_tokens = n, tokens
        return best, best_tokens

    def _age(self, block: BlockHash) -> float:
        if block in self.ledger or self.disk is None:
            return self.ledger.age(block)
        return self.disk.ledger.age(block)

    def _decoded(self, block: StoredBlock) -> tuple[mx.array, mx.array]:
        return self.codec.decode(block.keys), self.codec.decode(block.values)

    # ---- write ---------------------------------------------------------------------------

    def write(self, namespace: Namespace, tokens: Sequence[int], cache: Sequence[KVCache],
              ttl_s: float | None = None) -> int:
        """Store the full blocks of ``tokens`` whose K/V ``cache`` holds; return tokens written.

        ``ttl_s``: the writer's TTL (None: the store's); the memory ledger keeps each block of
        the chain for the longest TTL any writer asked (the disk tier keeps its own).

        ``cache`` holds (at least) the K/V of ``tokens`` in order, one KVCache per layer. Blocks
        already stored are touched, not copied again. When the memory budget is spent the
        blocks that fit are stored in memory and, with a disk tier, the rest go straight to
        disk (a prompt larger than the memory tier is still cached whole); blocks evicted to
        make room go to the disk tier too. A hash held as another block (a collision) ends
        the chain there: nothing is stored under another block's hash.
        """
        bs = self.block_size
        held = cache[0].offset if cache else 0
        usable = min(len(tokens), held) // bs * bs
        hashes = self._hash(tokens[:usable], bs, namespace)
        want = ChainIdentities(namespace, hashes, tokens, bs)
        new = self.ledger.insert(hashes, bs, namespace.label(), namespace.root(), ttl_s)
        first = hashes.index(new[0]) if new else self._chain_in_memory(hashes, want)
        slices = BlockSlices(cache, bs)
        for i, h in enumerate(new, start=first):
            keys, values = slices.block(i)
            self._put(h, StoredBlock(want[i], self.codec.encode(keys), self.codec.encode(values)))
        mx.eval([self._blocks[h].keys for h in new], [self._blocks[h].values for h in new])
        spilled = 0 if self.disk is None else overflow(self.disk, self.ledger, hashes, want,
                                                       first + len(new), slices)
        return (len(new) + spilled) * bs

    def _chain_in_memory(self, hashes: Sequence[BlockHash], want: ChainIdentities) -> int:
        """How many leading blocks of the chain memory holds as these very blocks."""
        n = 0
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            if block is None or block.identity != want[i]:
                break
            n += 1
        return n

    def _put(self, h: BlockHash, block: StoredBlock) -> None:
        self._blocks[h] = block
        self._tensor_bytes += block.nbytes

    def _drop(self, block: BlockHash, reason: RemovalReason) -> None:
        gone = self._blocks.pop(block, None)
        if gone is None:  # a block whose tensors were never written has nothing to drop
            return
        self._tensor_bytes -= gone.nbytes
        if reason == RemovalReason.EVICTED and self.disk is not None:
            spill(self.disk, block, gone, self.codec)

    # ---- blocks between workers (``workers.cache.transfer``) ---------------------------------

    def served(self, namespace: Namespace, tokens: Sequence[int], start: int, stop: int
               ) -> list[tuple[StoredBlock, KVCodec]]:
        """Blocks ``start`` to ``stop`` of ``tokens``' chain as held here (either tier, each
        verified), with the codec they are held in; up to the first this store lacks."""
        hashes = self._hash(tokens[:stop * self.block_size], self.block_size, namespace)
        want = ChainIdentities(namespace, hashes, tokens, self.block_size)
        out: list[tuple[StoredBlock, KVCodec]] = []
        for i in range(start, len(hashes)):
            held = self._blocks.get(hashes[i])
            if held is not None and held.identity == want[i]:
                out.append((held, self.codec))
                continue
            loaded = self.disk.load([hashes[i]], [want[i]], self.mismatch) if (
                self.disk is not None and hashes[i] in self.disk) else []
            if not loaded:
                break
            out.append((StoredBlock(want[i], loaded[0].keys, loaded[0].values), self.disk.codec))
        return out

    def adopt(self, namespace: Namespace, chain: Sequence[BlockHash], start: int,
              blocks: Sequence[StoredBlock], codec: KVCodec) -> int:
        """Store ``blocks`` (verified by the caller, held in ``codec``) as blocks ``start`` on
        of ``chain``, whose first ``start`` this memory tier must hold; how many were stored
        (0 when the head of the chain is gone meanwhile, fewer when memory is full)."""
        self.ledger.expire()
        if self.ledger.peek(chain[:start]) < start:
            return 0
        return self._promote(namespace, chain[:start + len(blocks)],
                             dict(zip(chain[start:], blocks)), codec)

    # ---- management ----------------------------------------------------------------------

    def written_blocks(self) -> int:
        """Blocks whose K/V were computed and stored here (not those read back from disk)."""
        return self.ledger.stats().stored_blocks - self._promoted

    def namespaces(self) -> list[str]:
        """Namespaces held in either tier."""
        disk = self.disk.ledger.namespaces() if self.disk is not None else []
        return sorted(set(self.ledger.namespaces()) | set(disk))

    def invalidate_namespace(self, namespace: Namespace | str) -> int:
        label = namespace.label() if isinstance(namespace, Namespace) else namespace
        if label not in self.namespaces():
            held = ", ".join(self.namespaces()) or "none"
            raise ValueError(f"unknown namespace {label!r}: held namespaces are {held}")
        in_memory = label in self.ledger.namespaces()
        removed = self.ledger.invalidate_namespace(label) if in_memory else 0
        if self.disk is not None:
            removed += self.disk.invalidate_namespace(label)
        return removed

    def invalidate_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> int:
        hashes = self._hash(tokens, self.block_size, namespace)
        removed = self.ledger.invalidate_prefix(hashes)
        if self.disk is not None:
            removed += self.disk.invalidate_prefix(hashes)
        return removed

    def expire(self) -> int:
        gone = len(self.ledger.expire())
        return gone + (self.disk.expire() if self.disk is not None else 0)

    def stats(self) -> StoreStats:
        return StoreStats(self.ledger.stats(), self._tensor_bytes, self.ledger.bytes_per_token,
                          self._mismatches, self.disk.stats() if self.disk is not None else None)

    def drain_events(self) -> list[BlockEvent]:
        """Both tiers' events; the router holds a block on a worker while any tier does."""
        events = self.ledger.drain_events()
        return events + (self.disk.drain_events() if self.disk is not None else [])

    def holdings(self) -> list[Holding]:
        disk = self.disk.ledger.holdings() if self.disk is not None else []
        return self.ledger.holdings() + disk

    def log(self) -> list[LedgerEvent]:
        return self.ledger.log()

    def flush(self) -> None:
        """Wait until every block spilled to disk is written."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Write the memory tier's blocks to disk too (so a restart keeps them), finish the
        disk tier's writes and release its directory."""
        if self.disk is None:
            return
        for holding in self.ledger.holdings():  # parents before children
            if holding.block not in self.disk:
                spill(self.disk, holding.block, self._blocks[holding.block], self.codec)
        self.disk.close()
