"""A lookup's answer (``workers.cache.lookup``): the outcome rules and the cache it assembles.

``outcome`` is checked case by case against the rules in the module's header; ``assemble``
against blocks whose every K/V value encodes (layer, head, position, dim), so a slip in which
slice lands where changes an exact value.
"""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from workers.cache.lookup import assemble, outcome
from workers.messages import LookupOutcome

LAYERS, HEADS, BLOCK, DIM = 2, 3, 4, 2


class TestOutcome:
    @pytest.mark.parametrize("cached, reusable, common, next_prompt, next_stored, want", [
        (8, 8, 8, None, None, LookupOutcome.HIT),
        (8, 8, 9, 5, 6, LookupOutcome.HIT),            # all reused: a divergence after is moot
        (0, 8, 0, 1, 2, LookupOutcome.MISS),
        (0, 0, 0, None, None, LookupOutcome.MISS),      # nothing reusable, nothing shared
        (4, 8, 6, 50, 7, LookupOutcome.NEAR_MISS),      # reused some, then diverged
        (0, 8, 2, 3, 9, LookupOutcome.NEAR_MISS),       # diverged inside the first block
        (0, 8, 1, 3, 9, LookupOutcome.NEAR_MISS),       # one token shared is not a miss
        (4, 8, 4, 5, None, LookupOutcome.PARTIAL),      # the stored sequence ends there
        (4, 8, 4, None, 5, LookupOutcome.PARTIAL),
        (0, 0, 3, None, None, LookupOutcome.PARTIAL),   # shares tokens, reuses none
    ])
    def test_each_case_of_the_header(self, cached, reusable, common, next_prompt, next_stored,
                                     want):
        assert outcome(cached, reusable, common, next_prompt, next_stored) is want


def block(index: int) -> tuple[mx.array, mx.array]:
    """Block ``index``'s K/V, [layers, heads, BLOCK, dim]: value = layer*1000 + head*100 +
    position*10 + dim for keys, its negative for values."""
    layer = mx.arange(LAYERS).reshape(LAYERS, 1, 1, 1) * 1000
    head = mx.arange(HEADS).reshape(1, HEADS, 1, 1) * 100
    pos = (mx.arange(BLOCK) + index * BLOCK).reshape(1, 1, BLOCK, 1) * 10
    dim = mx.arange(DIM).reshape(1, 1, 1, DIM)
    keys = (layer + head + pos + dim).astype(mx.float32)
    return keys, -keys


class TestAssemble:
    def test_one_cache_per_layer_holding_exactly_the_first_tokens(self):
        caches = assemble([block(0), block(1)], tokens=6, layers=LAYERS)
        assert len(caches) == LAYERS
        for layer, cache in enumerate(caches):
            assert cache.offset == 6
            assert cache.keys.shape == (1, HEADS, 6, DIM)
            assert cache.values.shape == (1, HEADS, 6, DIM)
            # head 2, position 5 (the second block's second token), dim 1
            assert cache.keys[0, 2, 5, 1].item() == layer * 1000 + 200 + 50 + 1
            assert cache.values[0, 2, 5, 1].item() == -(layer * 1000 + 200 + 50 + 1)
            assert cache.keys[0, :, :, 0].tolist() == [
                [layer * 1000 + h * 100 + p * 10 for p in range(6)] for h in range(HEADS)]

    def test_every_token_of_the_blocks_when_asked_for_all(self):
        caches = assemble([block(0)], tokens=BLOCK, layers=LAYERS)
        assert mx.array_equal(caches[1].keys[0], block(0)[0][1])
        assert mx.array_equal(caches[1].values[0], block(0)[1][1])
