"""What the prefix store holds per block, and the K/V geometry it is measured in.

A block holds exactly its own slice of every layer's K and V, and the identity that its
hash stands for (``router.kv.key.BlockIdentity``), checked on every hit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.key import BlockIdentity
from workers.cache.kv_quant import KVCodec, nbytes


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

    def tier_bytes_per_token(self, codec: KVCodec) -> int:
        return codec.bytes_per_token(self.layers, self.kv_heads, self.head_dim)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    identity: BlockIdentity
    keys: tuple[mx.array, ...]    # [layers, kv_heads, block_size, head_dim], encoded
    values: tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return nbytes(self.keys) + nbytes(self.values)


class BlockSlices:
    """One block's K/V cut out of a request's per-layer caches (a copy: a block holds exactly
    its slice, never the cache's spare room)."""

    def __init__(self, cache: Sequence[KVCache], block_size: int) -> None:
        self._keys = [c.keys for c in cache]
        self._values = [c.values for c in cache]
        self._bs = block_size

    def block(self, i: int) -> tuple[mx.array, mx.array]:
        start, end = i * self._bs, (i + 1) * self._bs
        return (mx.stack([k[0, :, start:end] for k in self._keys]),
                mx.stack([v[0, :, start:end] for v in self._values]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
