"""The peers' routers as the simulator replays them: SGLang, NVIDIA Dynamo and Ray Serve.

Each class follows one source file at one version, named in its docstring (and in
``router.sim.policies``'s header, with what it simplifies). They see what their originals
see: their own record of what they sent where, the request's block hashes and, for Dynamo,
the workers' block events; never the workers' stores.

Ties break at random from the run's seed (the originals break them by worker registration
order or hash-map order, which is arbitrary too; always taking ``w0`` would favour one worker).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Sequence

import xxhash

from router.kv.events import EventBatch
from router.index import PrefixIndex
from router.kv.key import BlockHash, reusable_tokens
from router.sim.base import SimPolicy, SimRequest


class PrefixHash(SimPolicy):
    """SGLang Model Gateway ``prefix_hash`` (``sgl-model-gateway/src/policies/prefix_hash.rs``
    at 065f331f): a hash ring keyed by the prompt's first 256 tokens; the ring's worker unless
    its in-flight load exceeds ``load_factor x (total + 1) / workers``, then the least loaded
    worker within that bound (the ring's worker if none is)."""

    name = "prefix_hash"
    virtual_nodes = 150
    prefix_tokens = 256
    load_factor = 1.25

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        ring = sorted((xxhash.xxh3_64_intdigest(f"{w}#{i}".encode()), w)
                      for w in self.workers for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [w for _, w in ring]

    def choose(self, req: SimRequest, now: float) -> str:
        # The first 256 tokens lie in the first trace block (512 tokens): its id names them.
        # A prompt shorter than one block has no block id; its own id keys it.
        key = req.hashes[0] if req.hashes else req.rid
        point = xxhash.xxh3_64_intdigest(int(key).to_bytes(16, "little"))
        home = self._owners[bisect.bisect(self._points, point) % len(self._points)]
        loads = self.in_flight
        bound = (sum(loads.values()) + 1) / len(self.workers) * self.load_factor
        if loads[home] <= bound:
            return home
        within = [w for w in self.workers if loads[w] <= bound]
        if not within:
            return home
        least = min(loads[w] for w in within)
        return self.rng.choice([w for w in within if loads[w] == least])


class _SglangCacheAware(SimPolicy):
    """The approximate-tree router shared by both SGLang variants; ``_fallback`` differs.

    If loads (in-flight requests) are imbalanced (``max - min > 64`` and ``max > 1.5 x min``)
    the least loaded worker; else the worker whose tree matches most if ``matched / input >
    0.3``, otherwise the fallback. The tree records what was *routed* (not what is held), per
    worker, LRU-trimmed every 120 s to 2**26 characters (~4 characters per token).
    """

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
            chosen = self._least(loads)
        else:
            depth = {w: _leading(self.trees[w], req.hashes) for w in self.workers}
            best_n = max(depth.values())
            matched = min(best_n * self.block_size, req.input_length)
            if req.input_length and matched / req.input_length > self.cache_threshold:
                chosen = self.rng.choice([w for w in self.workers if depth[w] == best_n])
            else:
                chosen = self._fallback()
        tree = self.trees[chosen]
        for h in req.hashes:
            tree[h] = None
            tree.move_to_end(h)
        return chosen

    def _fallback(self) -> str:
        raise NotImplementedError

    def _least(self, values: dict[str, int]) -> str:
        lowest = min(values.values())
        return self.rng.choice([w for w in self.workers if values[w] == lowest])

    def _evict(self) -> None:
        limit = self.max_tree_tokens // self.block_size
        for tree in self.trees.values():
            while len(tree) > limit:
                tree.popitem(last=False)


class SglangGatewayCacheAware(_SglangCacheAware):
    """Today's SGLang Model Gateway ``cache_aware``
    (``sgl-model-gateway/src/policies/cache_aware.rs`` at b93974f1): a low match falls back
    to the least loaded worker (its header comment still says the smallest tree)."""

    name = "sglang_gateway_cache_aware"

    def _fallback(self) -> str:
        return self._least(self.in_flight)


class SglangRouterCacheAware(_SglangCacheAware):
    """The older SGLang Router ``cache_aware`` (``sgl-router``, before the gateway): a low
    match falls back to the worker with the smallest tree (the most free cache, as it saw it)."""

    name = "sglang_router_cache_aware"

    def _fallback(self) -> str:
        return self._least({w: len(t) for w, t in self.trees.items()})


class DynamoKv(SimPolicy):
    """NVIDIA Dynamo's KV router (``lib/llm/src/kv_router/scheduler.rs`` and ``sequence.rs``,
    ``ActiveSequences``, 0.4-0.6): ``cost = overlap_score_weight x prefill blocks + decode
    blocks``, the minimum wins (temperature 0).

    - prefill blocks: ``(new tokens + active prefill tokens) / block size``, new tokens being
      the prompt less its overlap with the worker's cached blocks (from events);
    - decode blocks: the worker's *unique* active blocks (blocks of its in-flight requests,
      each counted once however many requests share it) plus the prompt's blocks not already
      active there (the partial tail is always new).
    """

    name = "dynamo_kv"
    overlap_score_weight = 1.0

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        super().__init__(workers, block_size, seed)
        self.index = PrefixIndex(pending_ttl_s=0)
        for w in self.workers:
            self.index.add_worker(w)
        self._overlap: dict[str, int] = {}
        self._active = {w: {} for w in self.workers}  # block -> in-flight requests using it
        self._unique = {w: 0 for w in self.workers}  # distinct active blocks incl. tails
        self._blocks: dict[int, tuple[str, tuple[BlockHash, ...], int]] = {}

    def on_events(self, batch: EventBatch) -> None:
        self.index.apply(batch)

    def active_blocks(self, worker: str) -> int:
        """Distinct blocks of the requests in flight on ``worker`` (tails included)."""
        return self._unique[worker]

    def expected_cached(self, req: SimRequest, worker: str) -> int:
        return reusable_tokens(req.input_length, self._overlap.get(worker, 0), self.block_size)

    def choose(self, req: SimRequest, now: float) -> str:
        self._overlap = self.index.match(req.hashes, now).blocks
        bs = self.block_size
        tail = 1 if req.input_length > len(req.hashes) * bs else 0
        costs = {}
        for w in self.workers:
            active = self._active[w]
            new_blocks = sum(1 for h in req.hashes if h not in active) + tail
            new_tokens = req.input_length - self.expected_cached(req, w)
            prefill_blocks = (new_tokens + self.prefill[w]) / bs
            costs[w] = self.overlap_score_weight * prefill_blocks + self._unique[w] + new_blocks
        lowest = min(costs.values())
        return self.rng.choice([w for w, c in costs.items() if c == lowest])

    def started(self, req: SimRequest, worker: str, now: float) -> None:
        super().started(req, worker, now)
        active = self._active[worker]
        for h in req.hashes:
            count = active.get(h, 0)
            active[h] = count + 1
            self._unique[worker] += count == 0
        tail = 1 if req.input_length > len(req.hashes) * self.block_size else 0
        self._unique[worker] += tail
        self._blocks[req.rid] = (worker, req.hashes, tail)

    def finished(self, rid: int) -> None:
        super().finished(rid)
        worker, hashes, tail = self._blocks.pop(rid)
        active = self._active[worker]
        for h in hashes:
            count = active[h] - 1
            if count:
                active[h] = count
            else:
                del active[h]
                self._unique[worker] -= 1
        self._unique[worker] -= tail


class RayPrefixAffinity(SimPolicy):
    """Ray Serve's ``PrefixCacheAffinityRouter`` (``python/ray/llm/_internal/serve/
    request_router/prefix_aware/prefix_aware_router.py``, the 2025 releases before its
    session and locality tiers) at its defaults (no
    imbalance check, ``match_rate_threshold 0.1``, no eviction): the replicas owning the
    longest routed prefix if it covers 10% of the input, otherwise the replicas with the
    smallest tree; among those, the fewest in-flight requests."""

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
