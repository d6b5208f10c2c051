"""Forecast against measured ``M`` on a replayed trace: the job forecast's benchmark.

The trace's arrivals are cut into windows (``window_s``, 10 minutes by default); each window
is one job, forecast at its start (``router.forecast.forecast_job``) from what a frontend
would know then and nothing later:

* the window's own block chains and arrival times;
* what the cluster holds: the blocks earlier requests read or wrote (their measured
  outcomes), with the TTL they have left;
* the store's TTL, eviction policy and the cluster's total capacity (one cache of the
  summed capacity, kept by the stores' own ``BlockLedger``);
* ``realisation``: the share of that one-cache model's reuse that routing realised in the
  earlier windows (1.0 for the first), since a real cluster spreads prefixes over workers.

The measured side is the simulator (``router.sim.simulator.replay``) running the real routing
policy on per-worker ``BlockLedger`` stores with its service model. Both are priced by one
price table; the figures are ``|forecast M - measured M|`` over all windows and per window.
A single window as long as the trace is the forecast with no history at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router.cost import Rates, TokenUsage, job_multiplier
from router.forecast import CacheModel, PlannedRequest, forecast_job
from router.sim.simulator import SimConfig, replay, to_requests
from router.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class WindowForecast:
    start_s: float
    requests: int
    forecast_m: float
    measured_m: float

    @property
    def error(self) -> float:
        return abs(self.forecast_m - self.measured_m)


@dataclass(frozen=True, slots=True)
class ReplayForecast:
    policy: str
    requests: int
    write_rate: float
    forecast_m: float
    measured_m: float
    forecast_hit_ratio: float
    measured_hit_ratio: float
    windows: tuple[WindowForecast, ...]

    @property
    def error(self) -> float:
        return abs(self.forecast_m - self.measured_m)

    def as_json(self) -> dict:
        return {"policy": self.policy, "requests": self.requests, "write_rate": self.write_rate,
                "forecast_multiplier": self.forecast_m, "measured_multiplier": self.measured_m,
                "forecast_error": self.error, "forecast_hit_ratio": self.forecast_hit_ratio,
                "measured_hit_ratio": self.measured_hit_ratio,
                "window_error_max": max((w.error for w in self.windows), default=0.0),
                "windows": [{"start_s": w.start_s, "requests": w.requests,
                             "forecast_multiplier": w.forecast_m,
                             "measured_multiplier": w.measured_m, "forecast_error": w.error}
                            for w in self.windows]}


def _hit_ratio(usages: Sequence[TokenUsage]) -> float:
    total = sum(u.input_tokens for u in usages)
    return sum(u.cached_tokens for u in usages) / total if total else 0.0


def _measure(trace: Sequence[TraceRequest], config: SimConfig, policy: str,
             requests: Sequence) -> list[TokenUsage]:
    measured: list[TokenUsage | None] = [None] * len(trace)

    def served(index: int, worker: str, cached: int, written: int) -> None:
        n = requests[index].input_length
        measured[index] = TokenUsage(n, cached, min(written, n - cached))

    replay(trace, policy, config, on_served=served)
    done = [m for m in measured if m is not None]
    if len(done) != len(trace):
        raise RuntimeError(f"the simulator served {len(done)} of {len(trace)} requests")
    return done


def _held(requests: Sequence, measured: Sequence[TokenUsage], arrivals: Sequence[float],
          upto: int, now: float, config: SimConfig) -> dict:
    """What the cluster holds at ``now`` as the frontend knows it from the outcomes of the
    requests before ``upto``: each one's read and written blocks, by last use (TTL only)."""
    last: dict = {}
    for i in range(upto):
        blocks = (measured[i].cached_tokens + measured[i].written_tokens) // config.block_size
        for block in requests[i].hashes[:blocks]:
            last[block] = arrivals[i]
    live = sorted((t, b) for b, t in last.items() if now - t < config.ttl_s)
    return {b: config.ttl_s - (now - t) for t, b in live}


def forecast_replay(trace: Sequence[TraceRequest], config: SimConfig, policy: str = "orchard",
                    rates: Rates = Rates(), window_s: float = 600.0) -> ReplayForecast:
    """Replay the trace, with each ``window_s`` of arrivals submitted as one job and forecast
    at its start from what earlier outcomes say: the blocks the cluster holds, and the share
    of the one-cache model's reuse that routing realised (``realisation``; 1.0 at first)."""
    if not trace:
        raise ValueError("the trace is empty: nothing to forecast")
    requests = to_requests(trace, config.block_size)
    measured = _measure(trace, config, policy, requests)
    arrivals = [t.arrival_s for t in trace]
    # both tiers: a block read back from a worker's disk is a hit like one from its memory
    tokens = config.capacity_tokens + config.disk_capacity_tokens
    model = CacheModel(config.block_size, config.workers * tokens, config.ttl_s, config.eviction)
    windows: dict[int, list[int]] = {}
    for i, t in enumerate(trace):
        windows.setdefault(int(t.arrival_s // window_s), []).append(i)
    forecast: list[TokenUsage] = []
    rows = []
    modelled_cached = realised_cached = 0
    for k, idx in sorted(windows.items()):
        start = k * window_s
        plans = [PlannedRequest(requests[i].hashes, requests[i].input_length,
                                arrivals[i] - start, requests[i].input_length / config.prefill_tps)
                 for i in idx]
        held = _held(requests, measured, arrivals, idx[0], start, config)
        realisation = realised_cached / modelled_cached if modelled_cached else 1.0
        job = forecast_job(plans, held, model, min(1.0, realisation))
        modelled_cached += sum(u.cached_tokens for u in forecast_job(plans, held, model))
        realised_cached += sum(measured[i].cached_tokens for i in idx)
        forecast.extend(job)
        rows.append(WindowForecast(start, len(idx), job_multiplier(job, rates, config.ttl_s),
                                   job_multiplier([measured[i] for i in idx], rates,
                                                  config.ttl_s)))
    return ReplayForecast(policy, len(trace), rates.write_rate(config.ttl_s),
                          job_multiplier(forecast, rates, config.ttl_s),
                          job_multiplier(measured, rates, config.ttl_s),
                          _hit_ratio(forecast), _hit_ratio(measured), tuple(rows))
