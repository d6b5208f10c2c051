"""A block's key in ``router.block_table.BlockTable`` and the two buckets it may live in.

- Keys: ``(hash(block) x GOLDEN) mod 2**64``, 0 taken as 1. Python's int hash (the value
  modulo 2**61 - 1, the same in every process) folds a 128-bit block hash in C; the odd
  multiplier spreads small ids (tests, trace ids) over the table. Blocks that share a key
  share a belief, which can only cost a miss: a worker verifies every block's identity. At
  18M blocks the chance that any two collide is about 1e-4.
- Homes: the two buckets a key may live in (``homes_of``; the table's header says how the two
  choices are used).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio, odd
_GOLDEN = np.uint64(GOLDEN)
_M64 = (1 << 64) - 1
_SHIFT = np.uint64(32)
_LITTLE_ENDIAN = sys.byteorder == "little"


def keys_of(blocks: Sequence[int]) -> np.ndarray:
    """The table keys of ``blocks`` (uint64), in order."""
    keys = np.fromiter(map(hash, blocks), np.uint64, len(blocks))
    keys *= _GOLDEN  # wraps modulo 2**64
    return np.maximum(keys, 1, out=keys)


def key_of(block: int) -> int:
    return (hash(block) * GOLDEN) & _M64 or 1


def homes_of(keys: np.ndarray, buckets: int) -> np.ndarray:
    """Each key's two buckets, ``(keys, 2)``: column 1 its first (from the high 32 bits),
    column 0 its second (the low 32 bits), each ``half x buckets >> 32``."""
    halves = keys.view(np.uint32).reshape(-1, 2)
    if not _LITTLE_ENDIAN:
        halves = halves[:, ::-1]
    at = halves * np.uint64(buckets)
    at >>= _SHIFT
    return at.view(np.int64)  # < buckets
