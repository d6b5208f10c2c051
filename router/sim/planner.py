"""The capacity planner: the smallest cluster that serves a workload within its TTFT target.

An operator asks: how many Macs, how much memory and disk for the prefix cache, at what TTL,
for this workload? The planner answers by replaying the workload (``router.sim.simulator``, the
same per-worker ``BlockLedger`` stores and service model as ``orchard simulate``) once per
point of a grid::

    workers x memory tokens per worker x disk tokens per worker x TTL

and keeps the points whose goodput (the share of requests with TTFT <= ``ttft_slo_s``) is at
least ``goodput``. Each point also carries its hit ratio and its effective input multiplier
``M`` (``router.cost``), priced by the price table with the write price of the point's TTL.

"Smallest" is lexicographic in what a Mac costs to add: fewer workers first, then less memory
per worker (unified memory is scarce beside the model), then less disk; among equal sizes the
lower ``M`` first (the TTL only changes the price and what is kept).

No cluster can do better than an ideal one: every token seen before is cached and every
request starts at once, so its TTFT is the prefill of the tokens nobody has seen
(``ideal_goodput``). When that bound is under the target the planner says so, and the TTFT
target at which it becomes reachable, and in every case, when no point meets the target, it
names the nearest points, what each misses by and the TTFT each would meet for the share.

Beside the grid, the workload is priced at a 5-minute and a 1-hour TTL on the ideal cluster
(``router.sim.ttl_compare``): the share of re-reads that arrive after 5 minutes, the
break-even between the two write prices, and the TTL of the lower ``M``.

A cluster's own requests become a trace with ``trace_from_spans``: each request span's
chained block hashes (``orchard.prompt.block_hashes``) are interned as the trace's block ids
(chained hashes name a whole prefix, as Mooncake ids do), its start time is the arrival.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

from router.kv.key import reusable_tokens
from router.kv.stats import percentile

from router.cost import Rates, TokenUsage
from router.sim.simulator import SimConfig, replay
from router.sim.trace import TraceRequest
from router.sim.ttl_compare import TtlComparison, compare_ttls


@dataclass(frozen=True, slots=True)
class Grid:
    """The configurations to try; every axis non-empty (the default takes about a minute)."""

    workers: tuple[int, ...] = (4, 8, 16)
    memory_tokens: tuple[int, ...] = (250_000, 1_000_000)
    disk_tokens: tuple[int, ...] = (0, 8_000_000)
    ttls_s: tuple[float, ...] = (300.0, 3600.0)

    def __post_init__(self) -> None:
        axes = (("--workers", self.workers), ("--memory-tokens", self.memory_tokens),
                ("--disk-tokens", self.disk_tokens), ("--ttls-s", self.ttls_s))
        for flag, values in axes:
            if not values:
                raise ValueError(f"{flag} is empty: give at least one value (comma-separated)")
        if min(self.workers) < 1:
            raise ValueError(f"--workers must all be at least 1, got {list(self.workers)}")
        if min(self.memory_tokens) < 1:
            raise ValueError(f"--memory-tokens must all be positive, got {list(self.memory_tokens)}")
        if min(self.disk_tokens) < 0:
            raise ValueError(f"--disk-tokens must all be >= 0 (0: no disk tier), "
                             f"got {list(self.disk_tokens)}")
        if min(self.ttls_s) <= 0:
            raise ValueError(f"--ttls-s must all be positive seconds, got {list(self.ttls_s)}")

    def points(self) -> list[Point]:
        return [Point(w, m, d, t) for w in sorted(set(self.workers))
                for m in sorted(set(self.memory_tokens)) for d in sorted(set(self.disk_tokens))
                for t in sorted(set(self.ttls_s))]


@dataclass(frozen=True, slots=True)
class Point:
    """One configuration: workers, and per worker memory and disk tokens; the store's TTL."""

    workers: int
    memory_tokens: int
    disk_tokens: int
    ttl_s: float

    @property
    def cache_tokens(self) -> int:
        """Cache size per worker, both tiers."""
        return self.memory_tokens + self.disk_tokens

    def size_key(self) -> tuple[int, int, int]:
        return (self.workers, self.memory_tokens, self.disk_tokens)


@dataclass(frozen=True, slots=True)
class Outcome:
    point: Point
    goodput: float
    hit_ratio: float
    multiplier: float
    ttft_p99_s: float
    meets: bool
    ttft_at_target_s: float  # the TTFT the target share of requests met on this point

    def as_json(self) -> dict:
        return {"workers": self.point.workers, "memory_tokens": self.point.memory_tokens,
                "disk_tokens": self.point.disk_tokens, "ttl_s": self.point.ttl_s,
                "goodput": round(self.goodput, 4), "hit_ratio": round(self.hit_ratio, 4),
                "multiplier": round(self.multiplier, 4),
                "ttft_p99_s": round(self.ttft_p99_s, 3), "meets": self.meets,
                "ttft_at_target_s": round(self.ttft_at_target_s, 3)}


@dataclass(frozen=True, slots=True)
class Bound:
    """What an ideal cluster reaches on the workload (see the module doc)."""

    goodput: float          # share of requests within the TTFT target
    ttft_at_target_s: float  # the TTFT target at which the goodput target becomes reachable

    def as_json(self) -> dict:
        return {"goodput": round(self.goodput, 4),
                "ttft_at_target_s": round(self.ttft_at_target_s, 3)}


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int
    ttft_slo_s: float
    goodput: float
    outcomes: tuple[Outcome, ...]  # every grid point, in grid order
    bound: Bound
    ttls: TtlComparison  # the workload's 5-minute against 1-hour writes (router.sim.ttl_compare)

    def feasible(self) -> list[Outcome]:
        """The points that meet the target, smallest first (see the module doc)."""
        met = [o for o in self.outcomes if o.meets]
        return sorted(met, key=lambda o: (o.point.size_key(), o.multiplier, o.point.ttl_s))

    def nearest(self, n: int = 3) -> list[Outcome]:
        """The ``n`` points closest to the target: the highest goodput, then the smallest."""
        return sorted(self.outcomes, key=lambda o: (-round(o.goodput, 4), o.point.size_key(),
                                                    o.multiplier))[:n]

    def as_json(self) -> dict:
        return {"requests": self.requests, "ttft_slo_s": self.ttft_slo_s,
                "goodput_target": self.goodput, "ideal": self.bound.as_json(),
                "smallest": [o.as_json() for o in self.feasible()],
                "nearest": [{**o.as_json(), "misses_by": round(self.goodput - o.goodput, 4)}
                            for o in self.nearest()] if not self.feasible() else [],
                "ttl_comparison": self.ttls.as_json(),
                "grid": [o.as_json() for o in self.outcomes]}


def check_goodput(goodput: float) -> None:
    if not 0 < goodput <= 1:
        raise ValueError(f"--goodput is a share of requests in (0, 1], got {goodput}")


def evaluate(trace: Sequence[TraceRequest], point: Point, base: SimConfig, rates: Rates,
             goodput: float, policy: str = "orchard") -> Outcome:
    """Replay ``trace`` on ``point``'s cluster; price its cached and written tokens."""
    config = replace(base, workers=point.workers, capacity_tokens=point.memory_tokens,
                     disk_capacity_tokens=point.disk_tokens, ttl_s=point.ttl_s)
    usage = [TokenUsage(0, 0, 0)]

    def served(index: int, worker: str, cached: int, written: int) -> None:
        n = trace[index].input_length
        usage[0] = usage[0] + TokenUsage(n, cached, min(written, n - cached))

    result = replay(trace, policy, config, on_served=served, ttft_share=goodput)
    return Outcome(point, result.goodput, result.hit_ratio,
                   usage[0].multiplier(rates, point.ttl_s), result.ttft_p99_s,
                   result.goodput >= goodput, result.ttft_at_share_s or 0.0)


def ideal_goodput(trace: Sequence[TraceRequest], base: SimConfig, goodput: float) -> Bound:
    """The ideal cluster's goodput: each request's TTFT is the prefill of its tokens that no
    earlier request had (``base.prefill_tps``), with no queue and no cache limit."""
    seen: set[int] = set()
    ttfts = []
    for r in trace:
        known = 0
        for block in r.hash_ids:
            if block not in seen:
                break
            known += 1
        known = min(known, r.input_length // base.trace_block)  # full blocks only, as stored
        new = r.input_length - reusable_tokens(r.input_length, known, base.trace_block)
        ttfts.append(new / base.prefill_tps)
        seen.update(r.hash_ids)
    within = sum(1 for t in ttfts if t <= base.ttft_slo_s)
    return Bound(within / len(ttfts), percentile(ttfts, goodput))


def plan(trace: Sequence[TraceRequest], grid: Grid, base: SimConfig, rates: Rates,
         goodput: float, policy: str = "orchard",
         progress: Callable[[Point], None] | None = None, jobs: int | None = None) -> Plan:
    """Every grid point replayed (``progress`` hears each as it finishes), in ``jobs``
    processes (default: one per CPU; 1: in this process)."""
    check_goodput(goodput)
    if not trace:
        raise ValueError("the workload has no requests: nothing to plan for")
    points = grid.points()
    jobs = min(len(points), jobs or os.cpu_count() or 1)
    by_point: dict[Point, Outcome] = {}
    if jobs == 1:
        for point in points:
            by_point[point] = evaluate(trace, point, base, rates, goodput, policy)
            if progress is not None:
                progress(point)
    else:
        # Spawned, not forked: a process forked after MLX has run (a test run, a notebook)
        # hangs on its first MLX operation, and the replay needs nothing the parent holds.
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = {pool.submit(evaluate, trace, point, base, rates, goodput, policy): point
                       for point in points}
            for done in as_completed(pending):
                by_point[pending[done]] = done.result()
                if progress is not None:
                    progress(pending[done])
    return Plan(len(trace), base.ttft_slo_s, goodput, tuple(by_point[p] for p in points),
                ideal_goodput(trace, base, goodput), compare_ttls(trace, rates, base.trace_block))


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """What a cluster's request span says about one request, as the planner needs it."""

    start_ns: int
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[str, ...]  # chained block hashes, hex, in prompt order
    block_size: int


def trace_from_spans(requests: Iterable[RecordedRequest]) -> tuple[list[TraceRequest], int]:
    """A cluster's recorded requests as a trace, and its block size (tokens per block id).

    Raises ``ValueError`` when there are none, or when they disagree on the block size
    (a run that changed ``[cache] block_size`` midway is two workloads).
    """
    rows = sorted(requests, key=lambda r: r.start_ns)
    rows = [r for r in rows if r.input_tokens > 0]
    if not rows:
        raise ValueError("the run's traces record no finished requests: run a workload "
                         "first, or pass --trace FILE")
    sizes = {r.block_size for r in rows if r.block_hashes}
    if len(sizes) > 1:
        raise ValueError(f"the run's requests use several block sizes {sorted(sizes)}: "
                         f"plan one run at a time")
    block_size = sizes.pop() if sizes else 512
    if block_size <= 0:
        raise ValueError("the run's request spans have block hashes but no block size")
    ids: dict[str, int] = {}
    first = rows[0].start_ns
    out = [TraceRequest((r.start_ns - first) / 1e9, r.input_tokens, r.output_tokens,
                        tuple(ids.setdefault(h, len(ids)) for h in r.block_hashes))
           for r in rows]
    return out, block_size
