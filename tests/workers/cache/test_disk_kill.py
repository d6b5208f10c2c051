"""A worker killed (SIGKILL) while its disk tier is writing: the next start on its directory
drops exactly the files the kill left half-written and serves every other block, verified.

A child process stores prompt after prompt in a store whose memory tier holds one prompt, so
every new prompt spills the previous one to disk and the writer thread is always busy; once
enough files exist the parent kills it with SIGKILL (no cleanup runs) and looks at what is
left, then opens a store on the directory.
"""
from __future__ import annotations

from tests.support.paths import REPO

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from router.kv.key import Namespace, hash_blocks
from workers.cache.disk_files import SUFFIX, TMP_SUFFIX, block_path
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


def test_blocks_torn_by_a_kill_are_dropped_and_the_rest_served(tmp_path):
    directory = tmp_path / "w0"
    proc = subprocess.Popen([sys.executable, "-m", "tests.workers.cache.test_disk_kill",
                             str(directory)], cwd=REPO)  # from the root: ``tests`` imports
    try:
        deadline = time.monotonic() + 120
        while len(list(directory.glob(f"*/*{SUFFIX}"))) < 12:
            assert proc.poll() is None, "the writing process ended before it was killed"
            assert time.monotonic() < deadline, "no block files appeared within 120 s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    torn = len(list(directory.glob(f"*/*{TMP_SUFFIX}")))
    files = len(list(directory.glob(f"*/*{SUFFIX}")))
    again = store_on(directory)
    start = again.stats().disk.start
    assert (start.restored, start.torn) == (files, torn)
    assert not list(directory.glob(f"*/*{TMP_SUFFIX}"))
    served = reachable = 0
    for i in range(files):  # the prompts the child stored (at most one per file)
        chain = hash_blocks(prompt(i), BS, NS)
        # a block is served when its chain from the root is on disk: a leaf whose parent's
        # write was torn waits for the parent to be computed again
        on_disk = [block_path(directory, h).exists() for h in chain]
        reachable += BS * (on_disk.index(False) if False in on_disk else len(on_disk))
        served += again.lookup(NS, prompt(i) + [1]).report.disk_tokens
    disk = again.stats().disk
    assert (served, disk.read_blocks, disk.corrupt) == (reachable, reachable // BS, 0)
    # blocks are written in queue order (each prompt's leaf first): only the one being
    # written or next at the kill can be a parent whose child made it to disk
    assert files - reachable // BS <= 1
    again.close()


if __name__ == "__main__":
    child(sys.argv[1])
