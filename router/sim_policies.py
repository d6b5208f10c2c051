"""The policies the simulator replays side by side: orchard's ``Router`` and the baselines.

Every policy sees the same things a real router would: the request (block hashes, lengths),
its own record of what it sent where (``started``/``prefilled``/``finished``), and, for those
that consume them, the workers' block events. None of them sees the workers' stores.

Baselines, from their published designs and defaults:

- ``round_robin``; ``power_of_two``: two distinct random workers, fewer in-flight requests wins
  (Ray Serve's default router).
- ``consistent_hash``: a hash ring (160 virtual nodes per worker) keyed by the first block.
- ``sglang_cache_aware``: SGLang gateway ``cache_aware``: if loads (in-flight requests) are
  imbalanced (``max - min > 64`` and ``max > 1.5 x min``) the least loaded worker; else the
  worker whose approximate tree matches most if ``matched / input > 0.3``, otherwise the
  worker with the smallest tree. The tree records what was *routed* (not what is held),
  per worker, LRU-trimmed every 120 s to 2**26 characters (~4 characters per token).
- ``dynamo_kv``: NVIDIA Dynamo's KV router: an index fed by worker events; cost
  ``1.0 x prefill blocks + decode blocks`` (prefill blocks: the request's uncached blocks plus
  the worker's queued prefill; decode blocks: the KV blocks of its running requests), the
  minimum wins (temperature 0).
- ``ray_prefix_affinity``: Ray Serve's ``PrefixCacheAffinityRouter`` at its defaults (no
  imbalance check, ``match_rate_threshold 0.1``, no eviction): the replicas owning the longest
  routed prefix if it covers 10% of the input, otherwise the replicas with the smallest tree;
  among those, the fewest in-flight requests. (Its ``PrefixTree`` needs ``ray[serve]``; this
  is the same rule on a block-level tree, one tree character per block.)
"""
from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import xxhash

from router.events import EventBatch
from router.index import PrefixIndex
from router.key import BlockHash, Namespace, reusable_tokens
from router.policy import PolicyConfig, RoutingDecision
from router.router import Router


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    input_length: int
    output_length: int
    hashes: tuple[BlockHash, ...]  # full blocks only


@dataclass(slots=True)
class _Open:
    """A request a baseline has sent and not yet seen finish."""

    worker: str
    prefill: int
    blocks: int
    decoding: bool = False


class SimPolicy:
    """Base: per-worker in-flight, queued prefill tokens and running KV blocks, by request."""

    name = "base"

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        self.workers = list(workers)
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.in_flight = {w: 0 for w in self.workers}
        self.prefill = {w: 0 for w in self.workers}
        self.kv_blocks = {w: 0 for w in self.workers}
        self._open: dict[int, _Open] = {}
        self.reasons: dict[str, int] = {}  # why each request went where (orchard only)

    def choose(self, req: SimRequest, now: float) -> str:
        """The worker for ``req`` arriving at ``now`` (each policy defines it)."""
        raise NotImplementedError

    def expected_cached(self, req: SimRequest, worker: str) -> int:
        return 0

    def on_events(self, batch: EventBatch) -> None:
        """Block events from a worker; policies that do not use them ignore them."""

    def started(self, req: SimRequest, worker: str, now: float) -> None:
        prefill = req.input_length - self.expected_cached(req, worker)
        blocks = -(-req.input_length // self.block_size)
        self._open[req.rid] = _Open(worker, prefill, blocks)
        self.in_flight[worker] += 1
        self.prefill[worker] += prefill
        self.kv_blocks[worker] += blocks

    def prefilled(self, rid: int) -> None:
        entry = self._open[rid]
        self.prefill[entry.worker] -= entry.prefill
        entry.decoding = True

    def finished(self, rid: int) -> None:
        entry = self._open.pop(rid)
        if not entry.decoding:
            self.prefill[entry.worker] -= entry.prefill
        self.in_flight[entry.worker] -= 1
        self.kv_blocks[entry.worker] -= entry.blocks


class OrchardPolicy(SimPolicy):
    """orchard's ``Router``, exactly as the cluster runs it, on the simulated clock."""

    name = "orchard"

    def __init__(self, workers: Sequence[str], block_size: int, seed: int,
                 config: PolicyConfig = PolicyConfig()) -> None:
        super().__init__(workers, block_size, seed)
        self.now = 0.0
        self.router = Router(block_size, config, clock=lambda: self.now, seed=seed)
        for w in self.workers:
            self.router.add_worker(w)
        self.namespace = Namespace("trace", "trace")
        self._decision: RoutingDecision | None = None

    def choose(self, req: SimRequest, now: float) -> str:
        self.now = now
        self._decision = self.router.route(self.namespace, req.hashes, req.input_length)
        return self._decision.worker_id

    def on_events(self, batch: EventBatch) -> None:
        self.router.apply_events(batch)

    def started(self, req: SimRequest, worker: str, now: float) -> None:
        decision = self._decision
        if decision is None or decision.worker_id != worker:
            raise RuntimeError("started() must follow choose() for the same request")
        self.router.started(str(req.rid), decision)
        key = decision.reason.value
        self.reasons[key] = self.reasons.get(key, 0) + 1
        self._decision = None

    def prefilled(self, rid: int) -> None:
        self.router.prefilled(str(rid))

    def finished(self, rid: int) -> None:
        self.router.finished(str(rid))


class RoundRobin(SimPolicy):
    name = "round_robin"

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        self._next = 0

    def choose(self, req: SimRequest, now: float) -> str:
        chosen = self.workers[self._next % len(self.workers)]
        self._next += 1
        return chosen


class PowerOfTwo(SimPolicy):
    name = "power_of_two"

    def choose(self, req: SimRequest, now: float) -> str:
        a, b = self.rng.sample(self.workers, 2) if len(self.workers) > 1 else self.workers * 2
        return a if self.in_flight[a] <= self.in_flight[b] else b


class ConsistentHash(SimPolicy):
    name = "consistent_hash"
    virtual_nodes = 160

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        ring = sorted((xxhash.xxh3_64_intdigest(f"{w}#{i}".encode()), w)
                      for w in self.workers for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def choose(self, req: SimRequest, now: float) -> str:
        key = req.hashes[0] if req.hashes else req.rid
        point = xxhash.xxh3_64_intdigest(int(key).to_bytes(16, "little"))
        i = bisect.bisect(self._points, point) % len(self._points)
        return self._owners[i]


class SglangCacheAware(SimPolicy):
    name = "sglang_cache_aware"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5
    eviction_interval_s = 120.0
    max_tree_tokens = 2**26 // 4

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        self.trees = {w: OrderedDict() for w in self.workers}  # block -> None, LRU order
        self._next_eviction = self.eviction_interval_s

    def choose(self, req: SimRequest, now: float) -> str:
        if now >= self._next_eviction:
            self._evict()
            self._next_eviction = now + self.eviction_interval_s
        loads = self.in_flight
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen = min(self.workers, key=lambda w: loads[w])
        else:
            best, best_n = self.workers[0], -1
            for w in self.workers:
                n = _leading(self.trees[w], req.hashes)
                if n > best_n:
                    best, best_n = w, n
            matched = min(best_n * self.block_size, req.input_length)
            if req.input_length and matched / req.input_length > self.cache_threshold:
                chosen = best
            else:
                chosen = min(self.workers, key=lambda w: len(self.trees[w]))
        tree = self.trees[chosen]
        for h in req.hashes:
            tree[h] = None
            tree.move_to_end(h)
        return chosen

    def _evict(self) -> None:
        limit = self.max_tree_tokens // self.block_size
        for tree in self.trees.values():
            while len(tree) > limit:
                tree.popitem(last=False)


class DynamoKv(SimPolicy):
    name = "dynamo_kv"
    overlap_score_weight = 1.0

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        self.index = PrefixIndex(pending_ttl_s=0)
        for w in self.workers:
            self.index.add_worker(w)
        self._overlap: dict[str, int] = {}

    def on_events(self, batch: EventBatch) -> None:
        self.index.apply(batch)

    def expected_cached(self, req: SimRequest, worker: str) -> int:
        return reusable_tokens(req.input_length, self._overlap.get(worker, 0), self.block_size)

    def choose(self, req: SimRequest, now: float) -> str:
        self._overlap = self.index.match(req.hashes, now).blocks
        bs = self.block_size
        request_blocks = -(-req.input_length // bs)
        costs = {}
        for w in self.workers:
            prefill_blocks = request_blocks - self._overlap.get(w, 0) + self.prefill[w] / bs
            decode_blocks = self.kv_blocks[w] + request_blocks
            costs[w] = self.overlap_score_weight * prefill_blocks + decode_blocks
        lowest = min(costs.values())
        return self.rng.choice([w for w, c in costs.items() if c == lowest])


class RayPrefixAffinity(SimPolicy):
    name = "ray_prefix_affinity"
    match_rate_threshold = 0.1

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        self.owners: dict[BlockHash, set[str]] = {}
        self.size = {w: 0 for w in self.workers}

    def choose(self, req: SimRequest, now: float) -> str:
        matched, owners = 0, set(self.workers)
        for h in req.hashes:
            here = self.owners.get(h)
            if not here or not (here & owners):
                break
            owners &= here
            matched += 1
        rate = min(matched * self.block_size, req.input_length) / req.input_length
        if rate < self.match_rate_threshold:
            smallest = min(self.size.values())
            owners = {w for w in self.workers if self.size[w] == smallest}
        ranked = sorted(sorted(owners), key=lambda w: (self.in_flight[w], self.rng.random()))
        chosen = ranked[0]
        for h in req.hashes:
            holders = self.owners.setdefault(h, set())
            if chosen not in holders:
                holders.add(chosen)
                self.size[chosen] += 1
        return chosen


def _leading(tree: OrderedDict, hashes: Sequence[BlockHash]) -> int:
    n = 0
    for h in hashes:
        if h not in tree:
            break
        n += 1
    return n


BASELINES: dict[str, type[SimPolicy]] = {p.name: p for p in (
    RoundRobin, PowerOfTwo, SglangCacheAware, DynamoKv, RayPrefixAffinity, ConsistentHash)}
POLICY_NAMES = ("orchard",) + tuple(BASELINES)


def make_policy(name: str, workers: Sequence[str], block_size: int, seed: int,
                config: PolicyConfig = PolicyConfig()) -> SimPolicy:
    if name == "orchard":
        return OrchardPolicy(workers, block_size, seed, config)
    if name not in BASELINES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICY_NAMES)}")
    return BASELINES[name](workers, block_size, seed)
