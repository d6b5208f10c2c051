"""The job-level forecast: what a job's requests will read, compute and write, before it runs.

A job is forecast at submission from three things:

* its own block chains: a later request reuses what an earlier one of the same job wrote,
  once that earlier request has been prefilled (siblings running at the same time both
  compute a new shared prefix, and only the first stores it);
* what the cluster holds now (the router's index), each block with the TTL it has left;
* the store's TTL, eviction policy and the cluster's capacity in tokens.

The cluster is modelled as one cache of the summed capacity (memory and disk tiers together:
a block read back from a worker's disk tier is read, not computed, like one in memory), kept by the stores' own
``BlockLedger`` (same eviction policy, TTL from last use): cache-aware routing sends a
prefix to the worker that holds it, so the union of the workers' stores is what a request
can reuse. Time is modelled by the arrival pattern: each planned request starts at
``arrival_s`` and its blocks are stored ``service_s`` later. ``batch_arrivals`` gives the
pattern of a batch run ``concurrency`` at a time; a trace replay passes real timestamps.

Events are processed in time order; at equal times writes come before lookups::

    t=0  A looks up [a0 a1 a2]: miss, will write 3 blocks at t=s
    t=0  B looks up [a0 a1 b2]: miss, a0 a1 pending from A (computed, not written), writes b2
    t=s  A's and B's blocks are stored
    t=s  C looks up [a0 a1 a2 c3]: reads 3 blocks, writes c3

A request's cache controls change what it reads and writes (``PlannedRequest``): ``read``
off, it reads nothing (and touches nothing); ``write_limit`` (its last breakpoint; 0 when it
writes nothing), only the full blocks before it are stored, so only those can later requests
read; ``ttl_s``, its blocks stay that long idle (a block's TTL is the longest any writer
asked for, as in the stores' ledger).

The output is a ``TokenUsage`` per request (``router.cost``), priced like the measured ones.

What the cluster holds when a job is submitted comes from ``ClusterHoldings``: one
``router.kv.tiers.TieredLedger`` per serving worker (its memory tier and, with ``[cache]
disk_bytes``, its disk tier, each with its capacity in tokens), mirroring that worker's store
from the requests it finished (the blocks it read and wrote, at the time it did). Because the
mirror is the stores' own ledger with their capacity, TTL and policy, what the forecast
believes is held follows the events that empty a store::

    eviction      another job's blocks filled the worker's memory mirror: LRU leaves went
                  to its disk mirror (held still: a disk hit is a cache read), or were gone
                  without a disk tier; the disk mirror evicts the same way
    TTL expiry    a block unused for ``ttl_s`` is not held (``BlockLedger.peek``)
    invalidation  ``invalidated(tenant)`` drops the tenant's namespaces from every mirror
    worker loss,  ``serving(workers)`` drops the mirror of a worker that left (dead or
    drain, scale  draining: no request will read it) and sizes the capacity by the rest
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

from router.cost import TokenUsage
from router.kv.key import BlockHash, Namespace, reusable_tokens
from router.kv.ledger import DEFAULT_EVICTION, BlockLedger, Eviction
from router.kv.tiers import TieredLedger


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a job as the forecast sees it."""

    block_hashes: tuple[BlockHash, ...]  # chained hashes of the prompt's full blocks
    input_tokens: int
    arrival_s: float   # seconds after submission when its lookup happens
    service_s: float   # seconds from its lookup until its new blocks are stored
    output_tokens: int = 1  # expected; the block the output completes holds the prompt's tail
    read: bool = True                # False: reads nothing from cache
    write_limit: int | None = None   # tokens: only full blocks before it are written
    ttl_s: float | None = None       # its writes' TTL (None: the model's)


@dataclass(frozen=True, slots=True)
class CacheModel:
    block_size: int
    capacity_tokens: int     # summed over the workers that will serve the job, both tiers
    ttl_s: float
    eviction: Eviction = DEFAULT_EVICTION    # the stores' policy

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.capacity_tokens < 0 or self.ttl_s <= 0:
            raise ValueError(f"cache model needs block_size > 0, capacity_tokens >= 0 and "
                             f"ttl_s > 0, got {self}")


class ClusterHoldings:
    """What each serving worker's store holds, as the frontend can know it (see the header).

    ``stored`` is called for every finished request, ``invalidated`` and ``serving`` when
    the operator or the pool changes the cluster; ``held`` and ``capacity_tokens`` are what
    a job's forecast starts from. Time comes from ``clock`` (the stores' clock).
    """

    def __init__(self, block_size: int, worker_capacity_tokens: int, ttl_s: float,
                 clock: Callable[[], float], workers: int = 1, eviction: str = "lru",
                 worker_disk_tokens: int = 0) -> None:
        if (block_size <= 0 or worker_capacity_tokens < 0 or ttl_s <= 0 or workers < 0
                or worker_disk_tokens < 0):
            raise ValueError("cluster holdings need block_size > 0, worker_capacity_tokens "
                             ">= 0, worker_disk_tokens >= 0, ttl_s > 0 and workers >= 0")
        self.block_size = block_size
        self.worker_capacity_tokens = worker_capacity_tokens  # memory tier
        self.worker_disk_tokens = worker_disk_tokens
        self.ttl_s = ttl_s
        self.eviction = eviction
        self._clock = clock
        self._workers = workers  # serving workers, until the first ``serving`` call names them
        self._mirrors: dict[str, TieredLedger] = {}
        self._serving: set[str] | None = None
        self._tenants: dict[str, str] = {}  # namespace label -> its tenant

    def _mirror(self, worker: str) -> TieredLedger:
        mirror = self._mirrors.get(worker)
        if mirror is None:
            mirror = TieredLedger(self.worker_capacity_tokens, self.worker_disk_tokens,
                                  self.ttl_s, self._clock, self.eviction)
            self._mirrors[worker] = mirror
            if self._serving is not None:
                self._serving.add(worker)  # a result from a worker the last poll missed
        return mirror

    def stored(self, worker: str, namespace: Namespace, chain: Sequence[BlockHash],
               blocks: int) -> None:
        """``worker`` read or wrote the first ``blocks`` blocks of ``chain`` just now (those
        read from its disk tier are touched there and promoted to memory, as its store does)."""
        if blocks > 0:
            self._tenants[namespace.label()] = namespace.tenant
            mirror = self._mirror(worker)
            mirror.match(chain[:blocks])
            mirror.insert(list(chain[:blocks]), self.block_size, namespace.label(),
                          namespace.root())

    def invalidated(self, tenant: str) -> None:
        """Every worker dropped ``tenant``'s cached blocks (the admin API's invalidate)."""
        for mirror in self._mirrors.values():
            for label in mirror.namespaces():
                if self._tenants.get(label) == tenant:
                    mirror.invalidate_namespace(label)

    def serving(self, workers: Collection[str]) -> None:
        """The workers requests can be routed to now; any other worker's blocks are lost
        to the forecast (a dead worker's store is gone, a draining one is not routed to)."""
        for gone in set(self._mirrors) - set(workers):
            del self._mirrors[gone]
        self._serving = set(workers)

    def capacity_tokens(self) -> int:
        """The summed capacity of the serving workers, both tiers: the one-cache model's
        (a block read back from disk is read, not computed)."""
        memory, disk = self.capacity_by_tier()
        return memory + disk

    def capacity_by_tier(self) -> tuple[int, int]:
        """(memory, disk) tokens summed over the serving workers."""
        count = max(1, len(self._serving) if self._serving is not None else self._workers)
        return self.worker_capacity_tokens * count, self.worker_disk_tokens * count

    def held_by_tier(self, worker: str, chain: Sequence[BlockHash]) -> tuple[int, int]:
        """Leading blocks of ``chain`` in ``worker``'s memory mirror, then how many more in
        its disk mirror (nothing touched)."""
        mirror = self._mirrors.get(worker)
        return mirror.peek(chain) if mirror is not None else (0, 0)

    def held(self, chain: Sequence[BlockHash], as_of: float | None = None
             ) -> dict[BlockHash, float]:
        """The leading blocks of ``chain`` some serving worker holds, each with its longest
        TTL left (the one-cache model of ``forecast_job``); with ``as_of``, only blocks that
        were already stored then (a request in flight could not read what its concurrent
        siblings stored after it was sent)."""
        newest = None if as_of is None else self._clock() - as_of   # minimum age
        out: dict[BlockHash, float] = {}
        for block in chain:
            left = max((m.ttl_left(block) for m in self._mirrors.values()
                        if m.holds(block) and (newest is None or m.age(block) >= newest)),
                       default=0.0)
            if left <= 0:
                break
            out[block] = left
        return out


def batch_arrivals(n: int, concurrency: int, request_s: float) -> list[float]:
    """Start times of ``n`` requests run ``concurrency`` at a time, ``request_s`` each."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    return [(i // concurrency) * request_s for i in range(n)]


class _Cache:
    """The one-cache model: a ``BlockLedger`` (the stores' own accounting, so the same
    eviction policy and TTL-from-last-use rules) on the forecast's own clock."""

    _NS = Namespace("forecast", "forecast")

    def __init__(self, model: CacheModel, held: Mapping[BlockHash, float]) -> None:
        self.now = 0.0
        self._block_size = model.block_size
        self._ledger = BlockLedger(model.capacity_tokens, model.ttl_s, lambda: self.now,
                                   bytes_per_token=1, policy=model.eviction)
        self._root = self._NS.root()
        # Held blocks enter oldest first, each as last used ``ttl - left`` seconds ago.
        for block, left in sorted(held.items(), key=lambda kv: kv[1]):
            if left > 0:
                self.now = left - model.ttl_s
                self._ledger.insert([block], model.block_size, self._NS.label(), self._root)
        self.now = 0.0

    def match(self, chain: Sequence[BlockHash], now: float) -> int:
        self.now = now
        return self._ledger.match(chain)

    def holds(self, block: BlockHash, now: float) -> bool:
        self.now = now
        return self._ledger.peek([block]) == 1

    def store(self, chain: Sequence[BlockHash], now: float, ttl_s: float | None = None) -> None:
        if chain:
            self.now = now
            self._ledger.insert(chain, self._block_size, self._NS.label(), self._root, ttl_s)


def _writable(req: PlannedRequest, block_size: int) -> int:
    """Leading blocks of ``req``'s chain it may write (all, without a breakpoint)."""
    if req.write_limit is None:
        return len(req.block_hashes)
    return min(len(req.block_hashes), req.write_limit // block_size)


def _tail_written(req: PlannedRequest, block_size: int) -> int:
    """Prompt tokens of the partial last block, stored once the output completes it."""
    tail = req.input_tokens % block_size
    completed = (req.input_tokens + max(1, req.output_tokens) - 1) // block_size
    return tail if completed > req.input_tokens // block_size else 0


def forecast_job(
    plan: Sequence[PlannedRequest],
    held: Mapping[BlockHash, float],
    model: CacheModel,
    realisation: float = 1.0,
) -> list[TokenUsage]:
    """Forecast each planned request's usage; ``held`` maps a block to its TTL left (s).

    ``realisation`` is the share of the one-cache model's reuse that the cluster's routing
    has recently realised (measured cached over what this model would have read; 1.0 when
    unknown): that share of each request's modelled cached tokens is read, the rest is
    computed and stored again, on the worker the request went to instead.
    """
    if not 0.0 <= realisation <= 1.0:
        raise ValueError(f"realisation must be in [0, 1], got {realisation}")
    cache = _Cache(model, held)
    # Heap of (time, kind, order, index): kind 0 = store (writes first), 1 = lookup.
    events: list[tuple[float, int, int, int]] = [
        (req.arrival_s, 1, i, i) for i, req in enumerate(plan)]
    heapq.heapify(events)
    pending: set[BlockHash] = set()
    to_write: dict[int, list[BlockHash]] = {}
    usages: list[TokenUsage | None] = [None] * len(plan)
    while events:
        now, kind, order, index = heapq.heappop(events)
        if kind == 0:  # the whole chain it may write, as a worker does
            done = plan[index]
            cache.store(done.block_hashes[:_writable(done, model.block_size)], now, done.ttl_s)
            pending.difference_update(to_write.pop(index))
            continue
        req = plan[index]
        if usages[index] is not None:
            raise RuntimeError(f"planned request {index} was looked up twice")
        if req.input_tokens <= 0:
            raise ValueError(f"planned request {index} has no input tokens; drop empty prompts")
        matched = cache.match(req.block_hashes, now) if req.read else 0
        writable = _writable(req, model.block_size)
        new = [b for b in req.block_hashes[matched:writable]
               if b not in pending and not cache.holds(b, now)]
        pending.update(new)
        to_write[index] = new
        heapq.heappush(events, (now + req.service_s, 0, order, index))
        modelled = reusable_tokens(req.input_tokens, matched, model.block_size)
        cached = round(modelled * realisation)
        if req.write_limit is None:
            written = min(len(new) * model.block_size + _tail_written(req, model.block_size)
                          + modelled - cached, req.input_tokens - cached)
        else:  # nothing past its breakpoint: no tail, no output block
            written = max(0, min(len(new) * model.block_size + modelled - cached,
                                 writable * model.block_size - cached))
        usages[index] = TokenUsage(req.input_tokens, cached, written)
    return [u for u in usages if u is not None]
