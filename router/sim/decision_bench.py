"""The routing-decision micro-benchmark: one 8k-token prompt among many workers, big index.

It fills a ``Router`` through its public interface (block events, as workers send them) with
``indexed_blocks`` blocks spread over ``workers`` workers, then times, per prompt:

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
from array import array
import time
from dataclasses import dataclass

from router.kv.events import BlockStored, EventBatch
from router.kv.key import Namespace, hash_blocks
from router.router import Router


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


def _fill(router: Router, workers: list[str], blocks: int, block_size: int,
          prompt_tokens: int, rng: random.Random, ns: Namespace) -> list[array]:
    """Store chains of prompt length until ``blocks`` blocks are indexed; return their tokens."""
    chain_blocks = prompt_tokens // block_size
    stored: list[array] = []
    seqs = {w: 0 for w in workers}
    total = 0
    while total < blocks:
        tokens = _tokens(rng, chain_blocks * block_size)
        hashes = hash_blocks(tokens, block_size, ns)
        holders = rng.sample(workers, rng.choice((1, 1, 2, 3)))
        parent = ns.root()
        events = []
        for h in hashes:
            events.append(BlockStored(h, parent, block_size, ns.label()))
            parent = h
        for w in holders:
            router.apply_events(EventBatch(w, seqs[w], tuple(events)))
            seqs[w] += 1
        total += len(hashes)
        if len(stored) < 512:
            stored.append(tokens)
    return stored


def run_decision_bench(workers: int = 32, indexed_blocks: int = 1_000_000,
                       block_size: int = 16, prompt_tokens: int = 8192,
                       iterations: int = 2000, seed: int = 0) -> BenchResult:
    if workers < 1 or indexed_blocks < 0 or iterations < 1 or prompt_tokens < 2:
        raise ValueError("need workers >= 1, indexed blocks >= 0, iterations >= 1 and "
                         "prompt tokens >= 2")
    rng = random.Random(seed)
    ns = Namespace("bench", "model")
    router = Router(block_size, clock=time.monotonic, seed=seed,
                    max_index_blocks=max(indexed_blocks * 2, 1024))
    ids = [f"w{i}" for i in range(workers)]
    for w in ids:
        router.add_worker(w)
    stored = _fill(router, ids, indexed_blocks, block_size, prompt_tokens, rng, ns)
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
        hashes = hash_blocks(prompt, block_size, ns)
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
    return BenchResult(workers, router.indexed_blocks(), block_size,
                       prompt_tokens, iterations, _q(hash_us, .5), _q(hash_us, .99),
                       _q(route_us, .5), _q(route_us, .99), _q(total_us, .5), _q(total_us, .99),
                       _q(route_cpu, .5), _q(route_cpu, .99), _q(total_cpu, .5), _q(total_cpu, .99))


def _tokens(rng: random.Random, n: int) -> array:
    # ids in [0, 65536), like a 64k vocabulary; kept as one uint32 buffer, as a tokenizer's
    # output would be on the hot path (``hash_blocks`` hashes it without a per-item copy)
    return array("I", array("H", rng.randbytes(2 * n)))


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
