"""The routing-decision micro-benchmark: one 8k-token prompt among many workers, big index.

It fills a ``Router`` through its public interface (block events, as workers send them) with
``indexed_blocks`` blocks spread over ``workers`` workers (each chain on 1 to 3 of them), and
reports what the fill cost: ``fill_s`` and ``bytes_per_block``, the process's resident memory
grown over the fill divided by the blocks indexed (the prompts it keeps to draw from are made
before the first reading, so only the router's state is counted). Then it times, per prompt:

- ``hash``: ``hash_blocks`` over the prompt's token ids, one uint32 buffer (the cache key);
- ``route``: ``Router.route`` on the pre-hashed chain (index match, policy, pending entry);
- ``total``: both, as the cluster pays them.

Each is timed by the wall clock and by the thread's CPU clock: on a shared machine the wall
clock also counts time the process spent descheduled, the CPU clock only the decision's work.

Half of the prompts extend a stored chain (a partial hit on one or a few workers), half are
new (cold). Loads are kept non-zero with ``started``/``finished``. Wall-clock, one process.
"""
from __future__ import annotations

import random
import resource
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from router.index import DEFAULT_INDEX_BYTES
from router.kv.events import BlockStored, EventBatch
from router.kv.key import Namespace, hash_blocks
from router.router import Router

KEPT_PROMPTS = 512  # stored chains the timed prompts extend


@dataclass(frozen=True, slots=True)
class BenchResult:
    workers: int
    indexed_blocks: int
    block_size: int
    prompt_tokens: int
    iterations: int
    hash_p50_us: float
    hash_p99_us: float
    route_p50_us: float
    route_p99_us: float
    total_p50_us: float
    total_p99_us: float
    route_cpu_p50_us: float  # thread CPU time: what the decision costs, without preemption
    route_cpu_p99_us: float
    total_cpu_p50_us: float
    total_cpu_p99_us: float
    bytes_per_block: float  # resident memory grown over the fill, per indexed block
    fill_s: float           # wall time of the fill (hashing, events, index)
    index_bytes: int        # the index's budget


def _fill(router: Router, workers: list[str], blocks: int, block_size: int,
          kept: list[array], rng: random.Random, ns: Namespace) -> None:
    """Store chains of prompt length until ``blocks`` blocks are indexed, ``kept`` first."""
    seqs = {w: 0 for w in workers}
    total, chains = 0, 0
    while total < blocks:
        tokens = kept[chains] if chains < len(kept) else _tokens(rng, len(kept[0]))
        chains += 1
        hashes = hash_blocks(tokens, block_size, ns)
        holders = rng.sample(workers, rng.choice((1, 1, 2, 3)))
        parents = [ns.root()] + hashes[:-1]
        events = tuple(BlockStored(h, p, block_size, ns.label())
                       for h, p in zip(hashes, parents))
        for w in holders:
            router.apply_events(EventBatch(w, seqs[w], events))
            seqs[w] += 1
        total += len(hashes)


def run_decision_bench(workers: int = 32, indexed_blocks: int = 1_000_000,
                       block_size: int = 16, prompt_tokens: int = 8192,
                       iterations: int = 2000, seed: int = 0,
                       index_bytes: int = DEFAULT_INDEX_BYTES) -> BenchResult:
    if workers < 1 or indexed_blocks < 0 or iterations < 1 or prompt_tokens < block_size + 1:
        raise ValueError("need workers >= 1, indexed blocks >= 0, iterations >= 1 and "
                         "a prompt longer than one block")
    rng = random.Random(seed)
    ns = Namespace("bench", "model")
    router = Router(block_size, clock=time.monotonic, seed=seed, index_bytes=index_bytes)
    ids = [f"w{i}" for i in range(workers)]
    for w in ids:
        router.add_worker(w)
    chain_tokens = prompt_tokens // block_size * block_size
    kept = [_tokens(rng, chain_tokens) for _ in range(KEPT_PROMPTS)]
    rss, t0 = resident_bytes(), time.perf_counter()
    _fill(router, ids, indexed_blocks, block_size, kept, rng, ns)
    fill_s = time.perf_counter() - t0
    grown = resident_bytes() - rss
    stored = kept[:max(1, min(len(kept), indexed_blocks // (chain_tokens // block_size)))]
    timed = _time_decisions(router, stored if indexed_blocks else [], prompt_tokens,
                            iterations, rng, ns)
    blocks = router.indexed_blocks()
    return BenchResult(workers, blocks, block_size, prompt_tokens, iterations,
                       *(_q(values, q) for values in timed for q in (.5, .99)),
                       round(grown / blocks, 1) if blocks else 0.0, round(fill_s, 1),
                       index_bytes)


def _time_decisions(router: Router, stored: list[array], prompt_tokens: int, iterations: int,
                    rng: random.Random, ns: Namespace) -> tuple[list[float], ...]:
    """Hash and route ``iterations`` prompts, half of them extending a ``stored`` chain; the
    times in us: hash, route, total (wall), route, total (thread CPU)."""
    hash_us, route_us, total_us, route_cpu, total_cpu = [], [], [], [], []
    cpu = time.thread_time_ns
    for i in range(iterations):
        if stored and i % 2 == 0:
            base = stored[rng.randrange(len(stored))]
            keep = rng.randrange(1, len(base))
            prompt = base[:keep] + _tokens(rng, prompt_tokens - keep)
        else:
            prompt = _tokens(rng, prompt_tokens)
        c0, t0 = cpu(), time.perf_counter_ns()
        hashes = hash_blocks(prompt, router.block_size, ns)
        c1, t1 = cpu(), time.perf_counter_ns()
        decision = router.route(ns, hashes, len(prompt))
        c2, t2 = cpu(), time.perf_counter_ns()
        route_cpu.append((c2 - c1) / 1000)
        total_cpu.append((c2 - c0) / 1000)
        hash_us.append((t1 - t0) / 1000)
        route_us.append((t2 - t1) / 1000)
        total_us.append((t2 - t0) / 1000)
        router.started(str(i), decision)
        if i >= 64:
            router.finished(str(i - 64))  # keep about 64 requests in flight
    return hash_us, route_us, total_us, route_cpu, total_cpu


def resident_bytes() -> int:
    """The process's resident memory now (Linux); elsewhere its peak so far (``ru_maxrss``)."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _tokens(rng: random.Random, n: int) -> array:
    # ids in [0, 65536), like a 64k vocabulary; kept as one uint32 buffer, as a tokenizer's
    # output would be on the hot path (``hash_blocks`` hashes it without a per-item copy)
    return array("I", array("H", rng.randbytes(2 * n)))


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
