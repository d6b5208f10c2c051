"""Recently assembled prefixes: finished requests' K/V caches, kept whole so that the next turn
of the same conversation extends one instead of joining the store's blocks again.

A hit on the store joins the prefix's blocks into one K/V array per layer: a copy of the
whole prefix (1,000 tokens of K or of V are 23 MB on SmolLM2-135M in float32) made on the
way to the first token. The next turn of a chat starts with the previous turn's prompt and
reply, which the previous request's cache holds in one piece when it finishes. So the engine
keeps finished requests' caches here and, on a store hit, takes the one that holds the
matched tokens instead of the joined blocks::

    turn 1 finishes:   cache [system | user 1 | reply 1]            ─► kept
    turn 2, lookup:    the store matches M tokens (full blocks, verified)
                       ─► the kept cache whose first M tokens are turn 2's, cut to where it
                          and turn 2 part (M, or up to 15 tokens past M: the tail)
                       ─► extended by turn 2's new tokens (no join)

Rules:

- The store stays the authority on what may be reused: a kept cache is taken only where the
  store itself matched (every block's identity verified) in the same namespace, and only if
  its tokens from position 0 are the prompt's, so a hash collision can never reach it and
  eviction, expiry and invalidation of the store's blocks apply to it unchanged. Past the store's match it serves only the **tail**:
  the tokens it shares with the prompt up to where the two part, when they part within the
  next block. The store holds whole blocks only, so that partial block is nowhere else; a
  turn would compute it again (8 tokens on average at block 16, of the 80-100 a chat turn
  adds: mlx-lm's prompt cache matches to the token). Where they part a whole block or more
  past the store's match, the store lacks a block the kept cache holds (evicted, expired):
  the kept cache gives only what the store matched. The tail always leaves the prompt's last
  token to compute, as the store's match does.
- A kept cache is handed over, never shared: the request that takes it extends it in place
  and is kept again when it finishes; a cache that an older turn's cache is a prefix of
  replaces that older one.
- Bounded in bytes (each cache's buffers, room for growth included); the least recently kept
  goes first. A cache larger than the whole bound is not kept.
- The engine keeps caches only where the store holds K/V in the model's dtype: a quantized
  tier's blocks differ from the exact K/V a kept cache holds, and a request's numbers must not
  depend on which of the two it found.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count
from typing import Sequence

from mlx_lm.models.cache import KVCache


@dataclass(frozen=True, slots=True)
class KeptStats:
    entries: int
    bytes: int
    capacity_bytes: int
    taken: int    # caches handed to a request in place of a join
    evicted: int  # caches dropped to make room


@dataclass(slots=True)
class _Kept:
    namespace: str
    tokens: tuple[int, ...]
    cache: list[KVCache]
    nbytes: int


def cache_bytes(cache: Sequence[KVCache]) -> int:
    """Bytes a cache's buffers hold (their whole allocation, room for growth included)."""
    return sum(c.keys.nbytes + c.values.nbytes for c in cache if c.keys is not None)


class KeptCaches:
    """Whole K/V caches of finished requests, by namespace and tokens, bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"kept bytes must be >= 0 (0: keep nothing), got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, _Kept] = OrderedDict()  # oldest kept first
        self._ids = count()
        self._bytes = 0
        self._taken = 0
        self._evicted = 0

    def keep(self, namespace: str, tokens: Sequence[int], cache: list[KVCache]) -> bool:
        """Keep ``cache``, which holds the K/V of ``tokens``; whether it was kept."""
        if not tokens or cache[0].offset != len(tokens):
            raise RuntimeError(f"a cache of {cache[0].offset} tokens cannot be kept for "
                               f"{len(tokens)} token ids")
        nbytes = cache_bytes(cache)
        if nbytes > self.capacity_bytes:
            return False
        tokens = tuple(tokens)
        for key, e in list(self._entries.items()):
            if e.namespace == namespace and tokens[:len(e.tokens)] == e.tokens:
                self._remove(key)  # an older turn of the same conversation: superseded
        while self._bytes + nbytes > self.capacity_bytes:
            self._remove(next(iter(self._entries)))
            self._evicted += 1
        self._entries[next(self._ids)] = _Kept(namespace, tokens, cache, nbytes)
        self._bytes += nbytes
        return True

    def take(self, namespace: str, prompt: Sequence[int], tokens: int, block_size: int = 1
             ) -> tuple[list[KVCache], int] | None:
        """The most recently kept cache whose first ``tokens`` tokens (the store's match) are
        ``prompt``'s, no longer kept, and how many of ``prompt``'s tokens it now holds: cut to
        ``tokens`` plus its tail (the rest of the common prefix, when that ends within the next
        ``block_size`` tokens and before the prompt's last token). ``None`` when no kept cache
        holds the matched tokens."""
        if tokens <= 0:
            return None
        want = tuple(prompt[:tokens])
        for key in reversed(self._entries):
            e = self._entries[key]
            if e.namespace == namespace and len(e.tokens) >= tokens and e.tokens[:tokens] == want:
                self._remove(key)
                self._taken += 1
                held = _tail(e.tokens, prompt, tokens, block_size)
                for c in e.cache:  # what lies past the offset is overwritten as it grows
                    c.trim(c.offset - held)
                return e.cache, held
        return None

    def drop(self, namespace: str) -> int:
        """Forget ``namespace``'s caches (it was invalidated); how many."""
        keys = [k for k, e in self._entries.items() if e.namespace == namespace]
        for key in keys:
            self._remove(key)
        return len(keys)

    def stats(self) -> KeptStats:
        return KeptStats(len(self._entries), self._bytes, self.capacity_bytes, self._taken,
                         self._evicted)

    def _remove(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes


def _tail(kept: Sequence[int], prompt: Sequence[int], matched: int, block_size: int) -> int:
    """``matched``, or where ``kept`` and ``prompt`` part when that is within the next
    ``block_size`` tokens (never past the prompt's last token but one)."""
    end = min(len(kept), len(prompt) - 1, matched + block_size)
    common = matched
    while common < end and kept[common] == prompt[common]:
        common += 1
    return common if common < matched + block_size else matched
