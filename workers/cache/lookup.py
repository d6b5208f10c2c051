"""What a ``workers.cache.store.PrefixStore`` lookup answers: its outcome and the cache to extend.

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

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from workers.messages import LookupOutcome, LookupReport


@dataclass(frozen=True, slots=True)
class Lookup:
    """A lookup's answer: the report and, when tokens are reused, the cache to extend."""

    report: LookupReport
    cache: list[KVCache] | None  # one KVCache per layer holding report.matched_tokens


def outcome(cached: int, reusable: int, common: int, next_prompt: int | None,
            next_stored: int | None) -> LookupOutcome:
    """The outcome of a lookup that reused ``cached`` of ``reusable`` tokens and shares
    ``common`` with the closest stored sequence (each side's next token, None at its end)."""
    if cached and cached == reusable:
        return LookupOutcome.HIT
    if common == 0:
        return LookupOutcome.MISS
    if next_stored is not None and next_prompt is not None:
        return LookupOutcome.NEAR_MISS
    return LookupOutcome.PARTIAL


def assemble(parts: list[tuple[mx.array, mx.array]], tokens: int, layers: int
             ) -> list[KVCache]:
    """One ``KVCache`` per layer holding the first ``tokens`` of the blocks' K/V ``parts``."""
    keys = mx.concatenate([k for k, _ in parts], axis=2)[:, :, :tokens]
    values = mx.concatenate([v for _, v in parts], axis=2)[:, :, :tokens]
    caches = []
    for layer in range(layers):
        cache = KVCache()
        cache.state = (keys[layer][None], values[layer][None], tokens)
        caches.append(cache)
    # Left lazy: the join happens inside the caller's prefill graph, with no extra sync.
    return caches
