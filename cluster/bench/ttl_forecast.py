"""The job forecast's error when a job's requests mix cache TTLs: ``orchard bench ttl-forecast``.

Each job is a few agent sessions (``router.sim.agent_trace``, scaled to a small model: blocks
of the engine's size, a few hundred tokens a prompt), their volatile line after a breakpoint
(the client's fix), each session's writes kept 5 minutes, 1 hour or the store's own TTL in
turn, so every job mixes the three. Before a job runs it is forecast as a frontend forecasts
it (``router.forecast.forecast_job``: one cache of the store's capacity, TTL and eviction,
each request's breakpoint and TTL); then its requests run, one at a time at their arrival
times, through a real ``Engine`` (its prefix store, on a clock the bench sets to each
arrival, so an hour of think time takes no time), and each result's cached and written
tokens are its measured usage (``router.cost.measured_usage``). Both sides are priced alike:
each request's writes at its own TTL's rate. A job's error is ``|forecast M - measured M|``
(target <= 0.05); jobs live in namespaces of their own, so one job reads nothing of another.

Prompt tokens are drawn per block id from the seed, so equal ids are equal tokens and the
engine's chained hashes see the trace's sharing exactly.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from router.cost import Rates, TokenUsage, measured_usage
from router.forecast import CacheModel, PlannedRequest, forecast_job
from router.sim.agent_trace import AgentShape, AgentVariant, agent_calls, render
from router.sim.simulator import to_requests
from router.sim.trace import TraceRequest
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.messages import CacheControls, GenerateRequest, GenerateResult, SamplingParams

TTL_MIX = (300.0, 3600.0, None)  # 5 minutes, 1 hour, the store's own; by session in turn


@dataclass(frozen=True, slots=True)
class TtlRequest:
    """One request of a job and the TTL its writes ask (None: the store's)."""

    trace: TraceRequest
    ttl_s: float | None


@dataclass(frozen=True, slots=True)
class JobFigures:
    job: int
    requests: int
    ttl_mix: dict[str, int]   # requests per TTL asked: 5m, 1h, default
    forecast: TokenUsage
    measured: TokenUsage
    forecast_m: float
    measured_m: float

    @property
    def error(self) -> float:
        return abs(self.forecast_m - self.measured_m)

    def as_json(self) -> dict:
        return {"job": self.job, "requests": self.requests, "ttl_mix": self.ttl_mix,
                "input_tokens": self.measured.input_tokens,
                "forecast_cached_tokens": self.forecast.cached_tokens,
                "measured_cached_tokens": self.measured.cached_tokens,
                "forecast_written_tokens": self.forecast.written_tokens,
                "measured_written_tokens": self.measured.written_tokens,
                "forecast_multiplier": round(self.forecast_m, 4),
                "measured_multiplier": round(self.measured_m, 4),
                "forecast_error": round(self.error, 4)}


def small_shape(sessions: int, block_size: int) -> AgentShape:
    """Agent sessions that fit a small model's context (under about 1,600 tokens)."""
    return AgentShape(sessions=sessions, session_rate_per_s=0.02, agents=2,
                      system_blocks=(4, 8), volatile_tokens=4, turns=(1, 4), tool_calls=(0, 3),
                      user_tokens=(5, 40), call_tokens=(5, 20), tool_tokens=(10, 80),
                      answer_tokens=(5, 30), block_size=block_size)


def mixed_job(shape: AgentShape, seed: int) -> list[TtlRequest]:
    """A job of ``shape``'s sessions, the volatile line after a breakpoint, the TTLs mixed."""
    calls = agent_calls(shape, seed)
    trace = render(calls, shape, AgentVariant.BREAKPOINT, session_keys=True)
    return [TtlRequest(t, TTL_MIX[c.session % len(TTL_MIX)]) for c, t in zip(calls, trace)]


def _tokens(request: TraceRequest, block: int, vocab: int, seed: int) -> tuple[int, ...]:
    out: list[int] = []
    for block_id in request.hash_ids:
        rng = random.Random(seed * 1_000_003 + block_id)
        out.extend(rng.randrange(10, vocab) for _ in range(block))
    return tuple(out[:request.input_length])


def _price(usages: Sequence[TokenUsage], ttls: Sequence[float], rates: Rates) -> float:
    total = sum(u.input_tokens for u in usages)
    return sum(u.cost(rates, ttl) for u, ttl in zip(usages, ttls)) / total


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def run_jobs(model_dir: Path | str, jobs: Sequence[Sequence[TtlRequest]],
             store_ttl_s: float = 300.0, rates: Rates = Rates(), seed: int = 0,
             store_bytes: int = 256 << 20) -> list[JobFigures]:
    """Forecast each job, run it through one engine, and compare (module doc)."""
    clock = _Clock()
    engine = Engine.open(model_dir, EngineConfig(store_bytes=store_bytes, ttl_s=store_ttl_s,
                                                 kept_bytes=0), clock=clock)
    try:
        block = engine.config.block_size
        model = CacheModel(block, store_bytes // engine.kv_bytes_per_token, store_ttl_s,
                           engine.config.eviction)
        out, start = [], 0.0
        for k, job in enumerate(jobs):
            if not job:
                raise ValueError(f"job {k} has no requests")
            start = max(start, clock.now) + 1.0
            out.append(_run_job(engine, k, job, model, clock, start, rates, seed))
        return out
    finally:
        engine.close()


def _run_job(engine: Engine, k: int, job: Sequence[TtlRequest], model: CacheModel,
             clock: _Clock, start: float, rates: Rates, seed: int) -> JobFigures:
    block = model.block_size
    traces = [r.trace for r in job]
    sims = to_requests(traces, block, block)
    first = traces[0].arrival_s
    plans = [PlannedRequest(s.hashes, s.input_length, t.arrival_s - first, 0.0, 1,
                            write_limit=None if s.write_blocks is None else s.write_blocks * block,
                            ttl_s=r.ttl_s)
             for s, t, r in zip(sims, traces, job)]
    forecast = forecast_job(plans, {}, model)
    ns = engine.namespace(f"ttl-job-{k}")
    measured = []
    for i, (r, s) in enumerate(zip(job, sims)):
        clock.now = start + r.trace.arrival_s - first
        cache = CacheControls(write_limit=None if s.write_blocks is None
                              else s.write_blocks * block, ttl_s=r.ttl_s)
        prompt = _tokens(r.trace, block, engine.vocab_size, seed + k)
        (result,) = engine.generate([GenerateRequest(f"j{k}-{i}", ns, prompt,
                                                     SamplingParams(max_tokens=1), cache=cache)])
        if not isinstance(result, GenerateResult):
            raise RuntimeError(f"job {k} request {i} failed: {result.error}")
        measured.append(measured_usage(result.input_tokens, result.cached_tokens,
                                       result.written_tokens, block))
    ttls = [r.ttl_s if r.ttl_s is not None else model.ttl_s for r in job]
    mix = {"5m": sum(r.ttl_s == 300.0 for r in job), "1h": sum(r.ttl_s == 3600.0 for r in job),
           "default": sum(r.ttl_s is None for r in job)}
    total = sum(measured, TokenUsage(0, 0, 0))
    return JobFigures(k, len(job), mix, sum(forecast, TokenUsage(0, 0, 0)), total,
                      _price(forecast, ttls, rates), _price(measured, ttls, rates))


def register_bench(sub) -> None:
    b = sub.add_parser("ttl-forecast", help="job forecast M against an engine's measured M, "
                                            "jobs mixing 5-minute, 1-hour and default TTLs")
    b.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    b.add_argument("--jobs", type=int, default=6)
    b.add_argument("--sessions", type=int, default=6, help="agent sessions per job")
    b.add_argument("--store-ttl-s", type=float, default=300.0, help="the store's own TTL")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    if args.jobs < 1 or args.sessions < 1:
        raise ValueError("--jobs and --sessions must each be >= 1")
    block = EngineConfig().block_size
    jobs = [mixed_job(small_shape(args.sessions, block), args.seed + k) for k in range(args.jobs)]
    model = args.model or ensure_default_model()
    figures = run_jobs(model, jobs, args.store_ttl_s, seed=args.seed)
    out = {"model": str(model), "store_ttl_s": args.store_ttl_s, "jobs": len(figures),
           "forecast_error_max": round(max(f.error for f in figures), 4),
           "per_job": [f.as_json() for f in figures]}
    if args.json:
        print(json.dumps(out))
        return 0
    for f in figures:
        print(f"job {f.job}: {f.requests} requests (5m {f.ttl_mix['5m']}, 1h {f.ttl_mix['1h']}, "
              f"default {f.ttl_mix['default']}), forecast M {f.forecast_m:.4f}, measured M "
              f"{f.measured_m:.4f}, |error| {f.error:.4f}")
    print(f"forecast_error_max {out['forecast_error_max']:.4f} (target <= 0.05)")
    return 0
