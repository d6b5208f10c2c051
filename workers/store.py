"""The prefix store: K/V tensors per block, keyed by the chained block hash, bounded in bytes.

The store owns the tensors; the bookkeeping (which blocks, LRU leaves first, TTL, invalidation,
events, the event log) is ``router.ledger.BlockLedger``, the same class the simulator replays.
When the ledger drops a block (evicted, expired, invalidated) it calls back here and the
block's tensors go with it.

One block holds exactly its own slice of every layer's K and V, nothing more::

    block i  keys   [layers, kv_heads, block_size, head_dim]   (float32: 4 bytes/element)
             values [layers, kv_heads, block_size, head_dim]
             tokens (block_size token ids, checked on every hit)

so the bytes per cached token are ``2 x layers x kv_heads x head_dim x bytes/element``.

Lookup outcomes (``LookupOutcome``), for a prompt whose full blocks the store may reuse up to
``len(prompt) - 1`` tokens:

- **hit**: every reusable token came from the store;
- **partial**: some prefix was reused and the closest stored sequence simply ends there (the
  prompt runs on past what was ever stored);
- **near_miss**: the closest stored sequence diverges from the prompt (it has a next token and
  it differs), whether or not some blocks were reused before the divergence;
- **miss**: no stored sequence shares even one token with the prompt.

The near miss is measured in tokens: whole matched blocks plus the longest common prefix of the
prompt's next block with the closest stored child block (``common=5919 of 5923``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.events import BlockEvent
from router.key import BlockHash, Namespace, hash_blocks, reusable_tokens
from router.ledger import BlockLedger, Holding, LedgerEvent, LedgerStats, RemovalReason
from workers.messages import LookupOutcome, LookupReport


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one cached token costs: the model's K/V geometry."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.size


@dataclass(frozen=True, slots=True)
class _Block:
    tokens: tuple[int, ...]
    keys: mx.array    # [layers, kv_heads, block_size, head_dim]
    values: mx.array


@dataclass(frozen=True, slots=True)
class Lookup:
    """A lookup's answer: the report and, when tokens are reused, the cache to extend."""

    report: LookupReport
    cache: list[KVCache] | None  # one KVCache per layer holding report.matched_tokens


@dataclass(frozen=True, slots=True)
class StoreStats:
    ledger: LedgerStats
    tensor_bytes: int        # bytes of K/V actually held
    bytes_per_token: int     # theoretical: 2 x layers x kv_heads x head_dim x bytes/elem
    hash_mismatches: int     # hits refused because stored tokens differed


class PrefixStore:
    """Deduplicated per-block K/V storage with LRU/TTL/invalidation from ``BlockLedger``."""

    def __init__(self, shape: KVShape, block_size: int, capacity_bytes: int, ttl_s: float,
                 clock: Callable[[], float], eviction: str = "lru") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.shape = shape
        self.block_size = block_size
        self._blocks: dict[BlockHash, _Block] = {}
        self._tensor_bytes = 0
        self._mismatches = 0
        self.ledger = BlockLedger(capacity_bytes, ttl_s, clock, shape.bytes_per_token,
                                  policy=eviction, on_remove=self._drop)

    # ---- lookup --------------------------------------------------------------------------

    def lookup(self, namespace: Namespace, prompt: Sequence[int]) -> Lookup:
        """Find the longest stored prefix of ``prompt`` (at most ``len(prompt) - 1`` tokens)."""
        bs = self.block_size
        hashes = hash_blocks(prompt, bs, namespace)
        matched = self._verified(hashes, prompt, self.ledger.peek(hashes))
        matched = self.ledger.match(hashes[:matched])
        cached = reusable_tokens(len(prompt), matched, bs)
        parent = hashes[matched - 1] if matched else namespace.root()
        lcp, child = self._closest_child(parent, prompt[matched * bs:(matched + 1) * bs])
        common = matched * bs + lcp
        next_prompt = prompt[common] if common < len(prompt) else None
        next_stored = child.tokens[lcp] if child is not None and lcp < len(child.tokens) else None
        reusable = reusable_tokens(len(prompt), len(hashes), bs)
        if cached and cached == reusable:
            outcome = LookupOutcome.HIT
        elif common == 0:
            outcome = LookupOutcome.MISS
        elif next_stored is not None and next_prompt is not None:
            outcome = LookupOutcome.NEAR_MISS
        else:
            outcome = LookupOutcome.PARTIAL
        report = LookupReport(
            outcome=outcome, prompt_tokens=len(prompt), matched_tokens=cached,
            common_prefix=common, next_prompt_token=next_prompt, next_stored_token=next_stored,
            entry_age_s=self.ledger.age(hashes[matched - 1]) if matched else None,
            ttl_s=self.ledger.ttl_s)
        cache = self._assemble(hashes[:matched], cached) if cached else None
        return Lookup(report, cache)

    def _verified(self, hashes: Sequence[BlockHash], prompt: Sequence[int], n: int) -> int:
        """How many of the first ``n`` held blocks really hold the prompt's tokens."""
        bs = self.block_size
        for i in range(n):
            if self._blocks[hashes[i]].tokens != tuple(prompt[i * bs:(i + 1) * bs]):
                self._mismatches += 1
                return i
        return n

    def _closest_child(self, parent: BlockHash, want: Sequence[int]) -> tuple[int, _Block | None]:
        best, best_block = 0, None
        for h in self.ledger.children(parent):
            block = self._blocks[h]
            n = _common_prefix(block.tokens, want)
            if best_block is None or n > best:
                best, best_block = n, block
        return best, best_block

    def _assemble(self, hashes: Sequence[BlockHash], tokens: int) -> list[KVCache]:
        keys = mx.concatenate([self._blocks[h].keys for h in hashes], axis=2)[:, :, :tokens]
        values = mx.concatenate([self._blocks[h].values for h in hashes], axis=2)[:, :, :tokens]
        caches = []
        for layer in range(self.shape.layers):
            cache = KVCache()
            cache.state = (keys[layer][None], values[layer][None], tokens)
            caches.append(cache)
        # Left lazy: the join happens inside the caller's prefill graph, with no extra sync.
        return caches

    # ---- write ---------------------------------------------------------------------------

    def write(self, namespace: Namespace, tokens: Sequence[int], cache: Sequence[KVCache]) -> int:
        """Store the full blocks of ``tokens`` whose K/V ``cache`` holds; return tokens written.

        ``cache`` holds (at least) the K/V of ``tokens`` in order, one KVCache per layer. Blocks
        already stored are touched, not copied again. When the byte budget is spent the blocks
        that fit are stored and the rest are not (the ledger reports what it kept).
        """
        bs = self.block_size
        held = cache[0].offset if cache else 0
        usable = min(len(tokens), held) // bs * bs
        hashes = hash_blocks(tokens[:usable], bs, namespace)
        new = self.ledger.insert(hashes, bs, namespace.label(), namespace.root())
        if not new:
            return 0
        first = hashes.index(new[0])  # blocks before it were already held
        layer_keys = [c.keys for c in cache]
        layer_values = [c.values for c in cache]
        for i, h in enumerate(new, start=first):
            start, end = i * bs, (i + 1) * bs
            # mx.stack copies: a block holds exactly its slice, never the cache's spare room.
            keys = mx.stack([k[0, :, start:end] for k in layer_keys])
            values = mx.stack([v[0, :, start:end] for v in layer_values])
            self._blocks[h] = _Block(tuple(tokens[start:end]), keys, values)
            self._tensor_bytes += keys.nbytes + values.nbytes
        mx.eval([self._blocks[h].keys for h in new], [self._blocks[h].values for h in new])
        return len(new) * bs

    def _drop(self, block: BlockHash, reason: RemovalReason) -> None:
        gone = self._blocks.pop(block, None)
        if gone is not None:  # a block whose tensors were never written has nothing to drop
            self._tensor_bytes -= gone.keys.nbytes + gone.values.nbytes

    # ---- management ----------------------------------------------------------------------

    def invalidate_namespace(self, namespace: Namespace | str) -> int:
        label = namespace.label() if isinstance(namespace, Namespace) else namespace
        return self.ledger.invalidate_namespace(label)

    def invalidate_prefix(self, namespace: Namespace, tokens: Sequence[int]) -> int:
        return self.ledger.invalidate_prefix(hash_blocks(tokens, self.block_size, namespace))

    def expire(self) -> int:
        return len(self.ledger.expire())

    def stats(self) -> StoreStats:
        return StoreStats(self.ledger.stats(), self._tensor_bytes, self.shape.bytes_per_token,
                          self._mismatches)

    def drain_events(self) -> list[BlockEvent]:
        return self.ledger.drain_events()

    def holdings(self) -> list[Holding]:
        return self.ledger.holdings()

    def log(self) -> list[LedgerEvent]:
        return self.ledger.log()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
