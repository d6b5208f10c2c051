"""Trace replay: routing policies side by side on simulated workers with real store accounting.

Each simulated worker is a ``BlockLedger`` (the same class a worker's prefix store runs, with
the tensors taken out) plus a service model from ``router.sim.service``:

- **the linear model** (no profile, ``router.sim.linear``): prefill is one FIFO server per
  worker; a request starts when the worker's previous prefill ends, looks up its full blocks in the ledger at that
  moment (the realised hit), prefills the rest at ``prefill_tps`` (slowed by
  ``decode_share`` per running decode) and stores its full blocks when its prefill ends;
  decode runs beside it at ``decode_tps`` tokens/s per request;
- **with an engine profile** (``profile``): each worker runs the engine's own step loop
  (``router.sim.steps``): admission up to ``max_batch``, one batched decode step, then
  chunked prefill under the per-step token budget, every part timed by the profile.

- **disk tier** (``disk_capacity_tokens > 0``): each worker also has a disk ledger
  (``router.kv.tiers``, as ``workers.cache.disk_tier`` gives the stores): blocks evicted from memory
  go there, a lookup continues its chain on disk where memory ends, and the disk part of a
  hit costs its load time, ``tokens x kv_bytes_per_token / disk_read_gbps``, before the
  prefill of the rest.

- **pulls** (``link_gbps > 0``, linear model): orchard's router may plan a pull from a peer
  (``router.sim.pulls``): the receiver stores the blocks the source holds after
  ``fixed + bytes / link`` seconds, then queues the request.

TTFT = pull + queueing + disk load + prefill. The workers' block events reach the policy
``event_delay_s`` after they are stored; the policy also hears when each request started,
produced its first token and finished, as a real router would. Only full blocks are stored (the partial tail of a
prompt never is), as in the workers' stores.

Figures per policy: ``goodput`` (the share of requests whose TTFT is within ``ttft_slo_s``,
the headline: what users feel), ``hit_ratio`` (cached input tokens over input tokens, as
realised on the workers), ``prefill_tokens`` (input tokens computed on all workers),
``ttft_mean_s``, ``imbalance`` (max over mean of prefilled tokens per worker), TTFT p50/p99
(service model), ``itl_p99_s`` (with a profile), decision p50/p99 (wall-clock time of the policy's choice, measured; also on the
thread's CPU clock, which a busy shared machine does not inflate with time spent descheduled).
"""
from __future__ import annotations

import heapq
import itertools
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from router.index import DEFAULT_INDEX_BYTES
from router.kv.key import BlockHash, Namespace, reusable_tokens
from router.kv.ledger import DEFAULT_EVICTION, Eviction
from router.policy import PolicyConfig
from router.pull_cost import DEFAULT_FIXED_S, LinkRate, PeerLinks
from router.sim.linear import SimWorker, serve_linear
from router.sim.service import EngineProfile, LinearService, ProfileService
from router.sim.policies import SimPolicy, SimRequest, make_policy
from router.sim.steps import EngineWorker, Speculation
from router.kv.stats import percentile
from router.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int = 8
    capacity_tokens: int = 1_000_000
    block_size: int = 512
    ttl_s: float = 3600.0
    eviction: Eviction = DEFAULT_EVICTION
    prefill_tps: float = 6000.0
    decode_tps: float = 30.0
    decode_share: float = 0.01
    event_delay_s: float = 0.05
    seed: int = 0
    ttft_slo_s: float = 2.0  # goodput counts the requests whose TTFT is within this
    trace_block: int = 512  # tokens per hash id in the trace (512 in Mooncake traces)
    profile: EngineProfile | None = None  # the measured engine instead of the linear model
    prefill_budget: int = 512   # with a profile: the engine's per-step prefill tokens and
    decode_stall: float = 1.8   # decode stall (``workers.engine.engine.EngineConfig``'s defaults)
    disk_capacity_tokens: int = 0  # per worker disk tier; 0: memory only
    disk_read_gbps: float = 2.0    # disk tier read bandwidth, GB/s
    kv_bytes_per_token: int = 46_080  # K/V per token: the default model's (float32)
    index_bytes: int = DEFAULT_INDEX_BYTES  # orchard's prefix index budget ([router])
    speculation: Speculation | None = None  # with a profile: verify passes (router.sim.steps)
    link_gbps: float = 0.0         # pulls between workers over links of this rate; 0: none
    link_fixed_s: float = DEFAULT_FIXED_S   # each pull's fixed cost

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.capacity_tokens < self.block_size:
            raise ValueError(f"--capacity-tokens must hold at least one block "
                             f"({self.block_size} tokens), got {self.capacity_tokens}")
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.prefill_tps <= 0 or self.decode_tps <= 0:
            raise ValueError("--prefill-tps and --decode-tps must be positive tokens/s")
        if self.ttl_s <= 0:
            raise ValueError(f"--ttl-s must be positive seconds, got {self.ttl_s}")
        if self.ttft_slo_s <= 0:
            raise ValueError(f"--ttft-slo-s must be positive seconds, got {self.ttft_slo_s}")
        big, small = max(self.block_size, self.trace_block), min(self.block_size, self.trace_block)
        if small <= 0 or big % small:
            raise ValueError(f"--block-size {self.block_size} and the trace's "
                             f"{self.trace_block}-token blocks must divide one another")
        if self.profile is not None:
            self.profile.check(self.block_size)
        if self.speculation is not None and (self.profile is None
                                             or not self.profile.draft_widths):
            raise ValueError("speculation is simulated on a profile with verify passes: "
                             "measure one with `orchard bench profile`")
        if self.link_gbps < 0 or self.link_fixed_s < 0:
            raise ValueError("--link-gbps and --link-fixed-ms must be >= 0 (0 Gbit/s: no pulls)")
        if self.link_gbps and self.profile is not None:
            raise ValueError("--link-gbps needs the linear service model: drop --profile")
        if self.disk_capacity_tokens < 0 or self.disk_read_gbps <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("--disk-capacity-tokens must be >= 0, --disk-read-gbps and "
                             "--kv-bytes-per-token positive")

    def disk_load_s(self, tokens: int) -> float:
        """Seconds to read ``tokens`` tokens of K/V from a worker's disk tier."""
        return tokens * self.kv_bytes_per_token / (self.disk_read_gbps * 1e9)

    def link(self) -> LinkRate | None:
        """Every pair's link when pulls are on (None: off)."""
        return LinkRate(self.link_gbps * 1e9 / 8, self.link_fixed_s) if self.link_gbps else None

    def service(self) -> LinearService | ProfileService:
        if self.profile is not None:
            return ProfileService(self.profile)
        return LinearService(self.prefill_tps, self.decode_tps, self.decode_share)


@dataclass(frozen=True, slots=True)
class PolicyResult:
    name: str
    goodput: float  # share of requests whose TTFT is within ``ttft_slo_s``
    hit_ratio: float
    prefill_tokens: int  # tokens prefilled on all workers (input less cached)
    imbalance: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    decision_p50_us: float
    decision_p99_us: float
    decision_cpu_p50_us: float  # the same decisions on the thread's CPU clock
    decision_cpu_p99_us: float
    reasons: dict[str, int] = field(default_factory=dict)
    itl_p99_s: float | None = None  # with a profile: decode modelled per step
    index_dropped: int | None = None  # orchard: blocks its index forgot (over index_bytes)
    ttft_at_share_s: float | None = None  # with ``ttft_share``: the TTFT that share of requests met
    pulled_tokens: int = 0  # tokens pulled from a peer before their requests ran


TRACE_BLOCK = 512  # tokens per hash id in Mooncake traces


def to_requests(trace: Sequence[TraceRequest], block_size: int,
                trace_block: int = TRACE_BLOCK) -> list[SimRequest]:
    """Trace lines as simulator requests: one hash per full block of ``block_size`` tokens.

    A block larger than the trace's (a multiple of it) is named by the id of its last trace
    block (ids are chain-unique, so that id names the whole prefix up to there); a smaller
    one (a divisor) by its trace block's id and its place inside it. A request's session
    key carries over, and its breakpoint (``write_blocks``) as the full blocks before it.
    """
    if block_size % trace_block and trace_block % block_size:
        raise ValueError(f"--block-size must be a multiple or a divisor of the trace's "
                         f"{trace_block}-token blocks, got {block_size}")
    out = []
    for rid, t in enumerate(trace):
        full = min(len(t.hash_ids) * trace_block, t.input_length) // block_size
        if block_size >= trace_block:
            k = block_size // trace_block
            hashes = tuple(BlockHash(t.hash_ids[(i + 1) * k - 1] + 1) for i in range(full))
        else:
            k = trace_block // block_size
            hashes = tuple(BlockHash((t.hash_ids[i // k] + 1) * k + i % k) for i in range(full))
        writes = None if t.write_blocks is None else min(
            full, t.write_blocks * trace_block // block_size)
        out.append(SimRequest(rid, t.input_length, t.output_length, hashes, t.session, writes))
    return out


def ideal_hit_ratio(trace: Sequence[TraceRequest], trace_block: int = TRACE_BLOCK) -> float:
    """One cache of unlimited size, every listed block id stored (the trace's own figure)."""
    seen: set[int] = set()
    hit = total = 0
    for t in trace:
        n = 0
        for h in t.hash_ids:
            if h not in seen:
                break
            n += 1
        hit += reusable_tokens(t.input_length, n, trace_block)
        total += t.input_length
        seen.update(t.hash_ids)
    return hit / total if total else 0.0


def offered_load(trace: Sequence[TraceRequest], config: SimConfig) -> float:
    """The trace's prefill work over the workers' prefill capacity, with nothing cached.

    Above 1 the queues grow without bound under any policy that cannot cache enough: a
    service rate there measures collapse, not routing. Caching lowers the real load.
    """
    if len(trace) < 2:
        return 0.0
    span = trace[-1].arrival_s - trace[0].arrival_s
    prefill = config.service().prefill_s
    work = sum(prefill(t.input_length, 0, 0, t.input_length) for t in trace)
    return work / (span * config.workers) if span > 0 else float("inf")


def replay(trace: Sequence[TraceRequest], name: str, config: SimConfig,
           policy_config: PolicyConfig = PolicyConfig(),
           progress: Callable[[str], None] | None = None,
           on_served: Callable[[int, str, int, int], None] | None = None,
           ttft_share: float | None = None) -> PolicyResult:
    """Replay ``trace`` through policy ``name`` on ``config.workers`` fresh workers.

    ``ttft_share`` (in (0, 1]) asks for the TTFT that share of the requests met (the planner's
    "what target would this cluster meet").

    ``on_served(index, worker, cached_tokens, written_tokens)`` hears every request as it is
    served (the cost forecast's measured side, ``router.sim.forecast_replay``; linear model only).
    """
    if on_served is not None and config.profile is not None:
        raise ValueError("on_served needs the linear service model (no profile)")
    ids = [f"w{i}" for i in range(config.workers)]
    link = config.link()
    links = PeerLinks(config.kv_bytes_per_token, link) if link is not None else None
    policy = make_policy(name, ids, config.block_size, config.seed, policy_config,
                         config.index_bytes, links)
    root = Namespace("trace", "trace").root()
    workers = {w: SimWorker(w, config, root) for w in ids}
    timeline: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
    order = itertools.count()

    def emit(when: float, kind: str, payload: object) -> None:
        heapq.heappush(timeline, (when, next(order), kind, payload))

    engines = _engines(workers, config) if config.profile is not None else {}
    hit = total = pulled = 0
    ttfts, itls, decisions, decisions_cpu = [], [], [], []
    service = config.service()
    requests = to_requests(trace, config.block_size, config.trace_block)
    for i, (t, req) in enumerate(zip(trace, requests)):
        now = t.arrival_s
        for engine in engines.values():
            engine.advance(now, emit)
        while timeline and timeline[0][0] <= now:
            _, _, kind, payload = heapq.heappop(timeline)
            _deliver(policy, kind, payload)
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        wid = policy.choose(req, now)
        pull = policy.planned_pull()
        decisions.append((time.perf_counter_ns() - started) / 1000.0)
        decisions_cpu.append((time.thread_time_ns() - started_cpu) / 1000.0)
        policy.started(req, wid, now)
        total += req.input_length
        if engines:
            engines[wid].submit(req, now)
        else:
            stored_before = workers[wid].written_blocks() if on_served else 0
            source = workers[pull.source] if pull is not None else None
            served = serve_linear(workers[wid], req, now, config, service, source, pull)
            pulled += served.pulled
            if on_served is not None:
                stored = workers[wid].written_blocks() - stored_before
                on_served(i, wid, served.cached, stored * config.block_size)
            hit += served.cached
            ttfts.append(served.first - now)
            itls.append(served.step_s)
            emit(served.first, "prefilled", req.rid)
            emit(served.end, "finished", req.rid)
            if served.events is not None:
                emit(served.first + config.event_delay_s, "events", served.events)
        if progress is not None and (i + 1) % 2000 == 0:
            progress(f"{name}: {i + 1}/{len(trace)} requests")
    for engine in engines.values():
        engine.advance(float("inf"), emit)
        hit += sum(o.cached for o in engine.outcomes.values())
        ttfts.extend(o.first - o.arrival for o in engine.outcomes.values())
        itls.extend(engine.gaps)
    result = _result(name, config, workers, policy, hit / total if total else 0.0, ttfts,
                     itls if engines else None, decisions, decisions_cpu, pulled)
    if ttft_share is None:
        return result
    return replace(result, ttft_at_share_s=percentile(ttfts, ttft_share))


def _result(name: str, config: SimConfig, workers: dict[str, "SimWorker"], policy: SimPolicy,
            hit_ratio: float, ttfts: list[float], itls: list[float] | None,
            decisions: list[float], decisions_cpu: list[float], pulled: int) -> PolicyResult:
    prefilled = [w.prefilled_tokens for w in workers.values()]
    mean = sum(prefilled) / len(prefilled)
    within = sum(1 for t in ttfts if t <= config.ttft_slo_s)
    return PolicyResult(
        name=name,
        goodput=within / len(ttfts) if ttfts else 0.0,
        hit_ratio=hit_ratio,
        prefill_tokens=sum(prefilled),
        imbalance=max(prefilled) / mean if mean else 1.0,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p50_s=percentile(ttfts, 0.50), ttft_p99_s=percentile(ttfts, 0.99),
        decision_p50_us=percentile(decisions, 0.50), decision_p99_us=percentile(decisions, 0.99),
        decision_cpu_p50_us=percentile(decisions_cpu, 0.50),
        decision_cpu_p99_us=percentile(decisions_cpu, 0.99),
        reasons=dict(policy.reasons),
        itl_p99_s=percentile(itls, 0.99) if itls is not None else None,
        index_dropped=policy.index_dropped(), pulled_tokens=pulled)


def _engines(workers: dict[str, "SimWorker"], config: SimConfig) -> dict[str, EngineWorker]:
    """Each worker's engine step loop on the profile (``router.sim.steps``)."""
    service = ProfileService(config.profile)
    return {w: EngineWorker(store, service, config.block_size, config.prefill_budget,
                            config.decode_stall, config.disk_load_s, config.event_delay_s,
                            config.speculation)
            for w, store in workers.items()}


def _deliver(policy: SimPolicy, kind: str, payload: object) -> None:
    if kind == "events":
        policy.on_events(payload)
    elif kind == "prefilled":
        policy.prefilled(payload)
    else:
        policy.finished(payload)


def simulate(trace: Sequence[TraceRequest], names: Sequence[str], config: SimConfig,
             policy_config: PolicyConfig = PolicyConfig(), quiet: bool = False) -> dict:
    """Every policy in ``names`` on the same trace and workers: the JSON-ready summary."""
    def progress(line: str) -> None:
        if not quiet:
            print(f"orchard simulate: {line}", file=sys.stderr, flush=True)

    results = [replay(trace, n, config, policy_config, progress) for n in names]
    return {
        "requests": len(trace),
        "workers": config.workers,
        "capacity_tokens": config.capacity_tokens,
        "disk_capacity_tokens": config.disk_capacity_tokens,
        "disk_read_gbps": config.disk_read_gbps,
        "block_size": config.block_size,
        "eviction": config.eviction,
        "index_bytes": config.index_bytes,
        "ttft_slo_s": config.ttft_slo_s,
        "offered_load": round(offered_load(trace, config), 3),
        "ideal_hit_ratio": round(ideal_hit_ratio(trace, config.trace_block), 4),
        "service": "profile" if config.profile is not None else "linear",
        "pulls": ({"link_gbps": config.link_gbps, "link_fixed_s": config.link_fixed_s}
                  if config.link_gbps else None),
        "policies": [_row(r) for r in results],
    }


def _row(r: PolicyResult) -> dict:
    return {"name": r.name, "goodput": round(r.goodput, 4), "hit_ratio": round(r.hit_ratio, 4),
            "prefill_tokens": r.prefill_tokens, "imbalance": round(r.imbalance, 3),
            "ttft_mean_s": round(r.ttft_mean_s, 3), "ttft_p50_s": round(r.ttft_p50_s, 3),
            "ttft_p99_s": round(r.ttft_p99_s, 3), "decision_p50_us": round(r.decision_p50_us, 1),
            "decision_p99_us": round(r.decision_p99_us, 1),
            "decision_cpu_p50_us": round(r.decision_cpu_p50_us, 1),
            "decision_cpu_p99_us": round(r.decision_cpu_p99_us, 1), "reasons": r.reasons,
            "pulled_tokens": r.pulled_tokens,
            **({"itl_p99_s": round(r.itl_p99_s, 4)} if r.itl_p99_s is not None else {}),
            **({"index_dropped": r.index_dropped} if r.index_dropped is not None else {})}
