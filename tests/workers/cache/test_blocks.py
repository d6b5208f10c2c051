"""What a block holds (``workers.cache.blocks``): K/V geometry, bytes, slices, common prefixes.

Exact byte counts from the geometry, and slices cut from a cache with spare room whose every
value encodes (layer, head, position), so a slice off by a token or a layer changes a value.
"""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.key import BlockHash, BlockIdentity
from workers.cache.blocks import BlockSlices, KVShape, StoredBlock, common_prefix
from workers.cache.kv_quant import KVCodec

SHAPE = KVShape(layers=2, kv_heads=3, head_dim=64, dtype=mx.float16)


class TestKVShape:
    def test_a_token_costs_its_keys_and_values_in_every_layer_and_head(self):
        assert SHAPE.bytes_per_token == 2 * 2 * 3 * 64 * 2
        assert KVShape(1, 1, 8, mx.float32).bytes_per_token == 64

    @pytest.mark.parametrize("bits, per_head", [(0, 128), (8, 64 + 4), (4, 32 + 4)])
    def test_a_tier_costs_what_its_codec_holds(self, bits, per_head):
        # per head and token: 64 x 2 bytes; 64 x 1 + f16 scale and bias; 64 / 2 + the same
        assert SHAPE.tier_bytes_per_token(KVCodec(bits, mx.float16)) == 2 * 2 * 3 * per_head


class TestStoredBlock:
    def test_its_bytes_are_every_part_of_its_keys_and_values(self):
        identity = BlockIdentity("a", BlockHash(1), 0, (1, 2))
        keys = (mx.zeros((2, 3, 4, 8), mx.float32), mx.zeros((2, 3, 4, 1), mx.float16))
        values = (mx.zeros((2, 3, 4, 8), mx.float32),)
        assert StoredBlock(identity, keys, values).nbytes == 768 + 48 + 768


def cache(tokens: int, layers: int = 2, heads: int = 2, dim: int = 2) -> list[KVCache]:
    """Per-layer caches with 16 spare positions: keys = layer*100 + head*10 + position."""
    out = []
    for layer in range(layers):
        head = mx.arange(heads).reshape(1, heads, 1, 1) * 10
        pos = mx.arange(tokens + 16).reshape(1, 1, tokens + 16, 1)
        keys = mx.broadcast_to(layer * 100 + head + pos, (1, heads, tokens + 16, dim))
        c = KVCache()
        c.keys, c.values, c.offset = keys.astype(mx.float32), -keys.astype(mx.float32), tokens
        out.append(c)
    return out


class TestBlockSlices:
    def test_a_block_is_its_own_positions_of_every_layer(self):
        keys, values = BlockSlices(cache(12), block_size=4).block(1)
        assert keys.shape == values.shape == (2, 2, 4, 2)  # [layers, heads, block, dim]
        assert keys[:, :, :, 0].tolist() == [
            [[layer * 100 + head * 10 + p for p in range(4, 8)] for head in range(2)]
            for layer in range(2)]
        assert mx.array_equal(values, -keys)

    def test_the_last_block_stops_at_its_end_not_at_the_spare_room(self):
        keys, _ = BlockSlices(cache(8), block_size=4).block(1)
        assert keys.shape[2] == 4 and keys[0, 0, :, 0].tolist() == [4, 5, 6, 7]


class TestCommonPrefix:
    @pytest.mark.parametrize("a, b, n", [
        ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3, 4], 2),
        ([5], [6], 0), ([], [1], 0), ([1, 9, 3], [1, 2, 3], 1),
    ])
    def test_the_leading_tokens_both_share(self, a, b, n):
        assert common_prefix(a, b) == n
