"""A store whose disk tier is always writing, for a process the test kills with SIGKILL.

Run as ``python -m tests.support.killed_writer DIRECTORY`` (from the repository root), it
stores prompt after prompt in a store whose memory tier holds one prompt, so every new prompt
spills the previous one to disk and the writer thread is always busy, until it is killed.
``store_on`` opens the same store on the directory again, as the next start does.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.key import Namespace
from workers.cache.blocks import KVShape
from workers.cache.open_store import open_store

BS = 16
SHAPE = KVShape(layers=8, kv_heads=8, head_dim=64, dtype=mx.float32)  # 512 KB per block
NS = Namespace("t", "m", "r1")
TTL = 3600.0


def prompt(i: int) -> list[int]:
    return list(range(i * 100, i * 100 + 2 * BS))  # two full blocks


def kv(tokens: list[int]) -> list[KVCache]:
    n = len(tokens)
    caches = []
    for layer in range(SHAPE.layers):
        c = KVCache()
        c.keys = mx.full((1, SHAPE.kv_heads, n, SHAPE.head_dim), float(layer))
        c.values = mx.full((1, SHAPE.kv_heads, n, SHAPE.head_dim), float(-layer))
        c.offset = n
        caches.append(c)
    return caches


def store_on(directory: Path):
    block = BS * SHAPE.bytes_per_token
    return open_store(SHAPE, BS, TTL, time.monotonic, memory_bytes=2 * block, eviction="lru",
                      disk_dir=directory, disk_bytes=4096 * block, model="m", revision="r1")


def child(directory: str) -> None:
    store = store_on(Path(directory))
    i = 0
    while True:  # killed by the parent
        store.write(NS, prompt(i), kv(prompt(i)))
        i += 1


if __name__ == "__main__":
    child(sys.argv[1])
