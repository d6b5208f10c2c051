"""The policies the simulator replays side by side: orchard's ``Router`` and the baselines.

Every policy sees the same things a real router would (``router.sim.base``); none of them
sees the workers' stores. Ties between equally good workers break at random from the run's
seed, never always to ``w0``.

Baselines, each following one peer's source at one version (the classes are in
``router.sim.peers``, round robin and power of two here):

- ``round_robin``; ``power_of_two``: two distinct random workers, fewer in-flight requests wins
  (Ray Serve's default router, ``python/ray/serve/_private/request_router/pow_2_router.py``).
- ``prefix_hash``: SGLang Model Gateway ``prefix_hash``
  (``sgl-model-gateway/src/policies/prefix_hash.rs`` at commit 065f331f): a ring of 150
  virtual nodes per worker keyed by the first 256 tokens, bounded load: when the ring's
  worker carries more than ``1.25 x (total in-flight + 1) / workers`` the least loaded worker
  within that bound takes the request. Simplified: the key is the first 512-token block's id
  (the trace's finest unit), and a prompt shorter than a block is keyed by its own id.
- ``sglang_gateway_cache_aware``: today's SGLang Model Gateway ``cache_aware``
  (``sgl-model-gateway/src/policies/cache_aware.rs`` at commit b93974f1): imbalanced loads
  (in-flight ``max - min > 64`` and ``max > 1.5 x min``) go to the least loaded worker; else
  the best-matching worker of its approximate trees if ``matched / input > 0.3``, otherwise
  the least loaded worker. ``sglang_router_cache_aware``: the older SGLang Router (``sgl-router``,
  before the gateway), the same but a low match goes to the worker with the smallest tree.
  Simplified: the trees are per block (one character per token in the originals, LRU-trimmed
  every 120 s to 2**26 characters, taken as ~4 characters per token); they record what was
  routed, as the originals do.
- ``dynamo_kv``: NVIDIA Dynamo's KV router (``lib/llm/src/kv_router/scheduler.rs`` and
  ``sequence.rs``, 0.4-0.6): ``cost = 1.0 x prefill blocks + decode blocks``, minimum wins
  (temperature 0). Prefill blocks: the prompt less its overlap with the worker's cached blocks
  (an index fed by worker events), plus the worker's queued prefill, over the block size.
  Decode blocks: the worker's distinct active blocks (each block of its in-flight requests
  counted once) plus the prompt's blocks not already active there. Simplified: a request's
  active blocks do not grow as it decodes.
- ``ray_prefix_affinity``: Ray Serve's ``PrefixCacheAffinityRouter``
  (``python/ray/llm/_internal/serve/request_router/prefix_aware/prefix_aware_router.py``, 2025)
  at its defaults (no imbalance check, ``match_rate_threshold 0.1``, no eviction): the
  replicas owning the longest routed prefix if it covers 10% of the input, otherwise the
  replicas with the smallest tree; among those, the fewest in-flight requests. Simplified: its
  character ``PrefixTree`` becomes a block-level tree, one tree character per block.

``consistent_hash`` (first block on a plain ring, no load bound) is gone: no production prefix
hash routes that way, and on the conversation trace it sent every request to one worker.
"""
from __future__ import annotations

from typing import Sequence

from router.index import DEFAULT_INDEX_BYTES
from router.kv.events import EventBatch
from router.kv.key import Namespace
from router.policy import PolicyConfig, RoutingDecision
from router.pull_cost import PeerLinks, PullChoice
from router.router import Router
from router.sim.base import SimPolicy, SimRequest
from router.sim.peers import (DynamoKv, PrefixHash, RayPrefixAffinity,
                              SglangGatewayCacheAware, SglangRouterCacheAware)

__all__ = ["BASELINES", "POLICY_NAMES", "SimPolicy", "SimRequest", "make_policy"]


class OrchardPolicy(SimPolicy):
    """orchard's ``Router``, exactly as the cluster runs it, on the simulated clock."""

    name = "orchard"

    def __init__(self, workers: Sequence[str], block_size: int, seed: int,
                 config: PolicyConfig = PolicyConfig(),
                 index_bytes: int = DEFAULT_INDEX_BYTES, links: PeerLinks | None = None) -> None:
        super().__init__(workers, block_size, seed)
        self.now = 0.0
        self.router = Router(block_size, config, clock=lambda: self.now, seed=seed,
                             index_bytes=index_bytes, links=links)
        for w in self.workers:
            self.router.add_worker(w)
        self.namespace = Namespace("trace", "trace")
        self._decision: RoutingDecision | None = None

    def choose(self, req: SimRequest, now: float) -> str:
        self.now = now
        self._decision = self.router.route(self.namespace, req.hashes, req.input_length,
                                           session=req.session)
        return self._decision.worker_id

    def planned_pull(self) -> PullChoice | None:
        return self._decision.pull if self._decision is not None else None

    def on_events(self, batch: EventBatch) -> None:
        self.router.apply_events(batch)

    def index_dropped(self) -> int:
        return self.router.index_counters().dropped

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


BASELINES: dict[str, type[SimPolicy]] = {p.name: p for p in (
    RoundRobin, PowerOfTwo, SglangGatewayCacheAware, SglangRouterCacheAware, DynamoKv,
    RayPrefixAffinity, PrefixHash)}
POLICY_NAMES = ("orchard",) + tuple(BASELINES)


def make_policy(name: str, workers: Sequence[str], block_size: int, seed: int,
                config: PolicyConfig = PolicyConfig(),
                index_bytes: int = DEFAULT_INDEX_BYTES,
                links: PeerLinks | None = None) -> SimPolicy:
    """A policy by name; ``config``, ``index_bytes`` (its index's budget) and ``links`` (pulls
    between workers; None: none) are orchard's."""
    if name == "orchard":
        return OrchardPolicy(workers, block_size, seed, config, index_bytes, links)
    if name not in BASELINES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICY_NAMES)}")
    return BASELINES[name](workers, block_size, seed)
