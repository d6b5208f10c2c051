"""Prefix stores for the store's and the disk tier's tests: a small K/V shape, a cache whose
values encode (layer, position, token), and a store of two memory blocks over a disk tier.

``tiered`` opens its store under the eviction policy of the test running: a test class that
uses it takes the ``every_policy`` fixture (``@pytest.mark.usefixtures("every_policy")``), so
it runs once per policy.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import Eviction
from tests.conftest import Clock
from workers.cache.blocks import KVShape
from workers.cache.open_store import open_store
from workers.cache.store import PrefixStore

BS = 4

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=8, dtype=mx.float32)

NS = Namespace("tenant-a", "m", "r1")


def kv_for(tokens: list[int]) -> list[KVCache]:
    """A per-layer cache whose K/V encode (layer, position, token) so slices can be checked."""
    caches = []
    n = len(tokens)
    tok = mx.array(tokens, dtype=mx.float32).reshape(1, 1, n, 1)
    pos = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
    for layer in range(SHAPE.layers):
        base = mx.broadcast_to(tok * 1000 + pos, (1, SHAPE.kv_heads, n, SHAPE.head_dim))
        c = KVCache()
        # a cache with spare room, like mlx-lm's (it allocates 256 positions at a time)
        keys = mx.concatenate([base + layer, mx.zeros((1, SHAPE.kv_heads, 256, SHAPE.head_dim))], 2)
        values = mx.concatenate([-base - layer, mx.zeros_like(keys[:, :, :256])], 2)
        c.keys, c.values, c.offset = keys, values, n
        caches.append(c)
    return caches


def put(store: PrefixStore, tokens: list[int], ns: Namespace = NS) -> int:
    return store.write(ns, tokens, kv_for(tokens))


TTL = 60.0

BLOCK_BYTES = BS * SHAPE.bytes_per_token

A = list(range(1, 9))      # two blocks

B = list(range(101, 109))  # two other blocks

WALL_START = 1_000_000.0   # the wall clock the disk files are stamped with

POLICY: list[Eviction] = [Eviction.LRU]  # the policy of the test running (``every_policy``)


@pytest.fixture
def every_policy(eviction):
    """The test runs once per eviction policy: what it asserts holds under both."""
    POLICY[0] = eviction
    yield
    POLICY[0] = Eviction.LRU


def tiered(directory: Path, mem_blocks: int = 2, disk_blocks: int = 100, clock: Clock | None = None,
           model: str = "m", revision: str = "r1", wall=None, **kw) -> PrefixStore:
    return open_store(SHAPE, BS, TTL, clock or Clock(), memory_bytes=mem_blocks * BLOCK_BYTES,
                      eviction=POLICY[0], disk_dir=directory, disk_bytes=disk_blocks * BLOCK_BYTES,
                      model=model, revision=revision, wall_clock=wall or Clock(WALL_START), **kw)


def spilled_a(tmp_path: Path, **kw) -> PrefixStore:
    """A store whose memory holds B and whose disk holds A's two blocks (written)."""
    store = tiered(tmp_path / "w0", **kw)
    put(store, A)
    put(store, B)  # evicts A's two blocks (leaf first) to disk
    store.flush()
    return store


def ha() -> list:
    return hash_blocks(A, BS, NS)


# A wider shape, for the quantized tiers (a head of 64 values groups for 4- and 8-bit codes).
WIDE_BS = 16

WIDE = KVShape(layers=2, kv_heads=2, head_dim=64, dtype=mx.float32)

WIDE_NS = Namespace("t", "m", "r1")

WIDE_TOKENS = list(range(1, 33))  # two blocks


def random_cache(n: int) -> list[KVCache]:
    """A per-layer cache of ``n`` positions of the wide shape, normal values, seed 0."""
    mx.random.seed(0)
    caches = []
    for _ in range(WIDE.layers):
        c = KVCache()
        c.keys = mx.random.normal((1, WIDE.kv_heads, n, WIDE.head_dim))
        c.values = mx.random.normal((1, WIDE.kv_heads, n, WIDE.head_dim))
        c.offset = n
        caches.append(c)
    return caches
