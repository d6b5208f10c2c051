"""What agent clients' volatile system prompt line costs, and what fixes it: ``orchard bench
agent-loop``.

The agent-loop trace (``router.sim.agent_trace``: tool loops, half the sessions with a
per-message line near the top of their system prompt) is replayed through orchard's own
router and the workers' store accounting (``router.sim.simulator.replay``, the ``orchard``
policy), the same sessions four ways:

- ``as_sent``: the line inside the system prompt, no session keys;
- ``with_breakpoint``: the client's fix, the line moved after a cache breakpoint at the end
  of the prompt (what follows the breakpoint is not written);
- ``with_session_keys``: as sent, each request naming its session (``prompt_cache_key``);
- ``with_breakpoint_and_session_keys``: both.

For each: the hit ratio (cached input tokens over input tokens, realised on the simulated
workers), the effective input multiplier ``M`` (``router.cost``: the tokens each request read
and wrote, writes priced at the store TTL's rate), goodput within ``ttft_slo_s`` and TTFT p99.
The figures are the decision code's on a simulated clock: they do not depend on the machine.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from router.cost import Rates, TokenUsage, total_usage
from router.sim.agent_trace import AgentShape, AgentVariant, agent_calls, render
from router.sim.simulator import SimConfig, ideal_hit_ratio, replay
from router.sim.trace import TraceRequest

VARIANTS = (("as_sent", AgentVariant.AS_SENT, False),
            ("with_breakpoint", AgentVariant.BREAKPOINT, False),
            ("with_session_keys", AgentVariant.AS_SENT, True),
            ("with_breakpoint_and_session_keys", AgentVariant.BREAKPOINT, True))


@dataclass(frozen=True, slots=True)
class VariantFigures:
    name: str
    hit_ratio: float
    multiplier: float
    ideal_hit_ratio: float  # one unlimited cache: what no routing can beat
    goodput: float
    ttft_p99_s: float


def replay_variant(trace: list[TraceRequest], name: str, config: SimConfig,
                   rates: Rates) -> VariantFigures:
    """One rendering of the trace through orchard's router, its M from what each request
    read and wrote."""
    usages: list[TokenUsage] = []

    def served(index: int, worker: str, cached: int, written: int) -> None:
        n = trace[index].input_length
        usages.append(TokenUsage(n, cached, min(written, n - cached)))

    result = replay(trace, "orchard", config, on_served=served)
    usage = total_usage(usages)
    return VariantFigures(name, result.hit_ratio, usage.multiplier(rates, config.ttl_s),
                          ideal_hit_ratio(trace, config.trace_block), result.goodput,
                          result.ttft_p99_s)


def run_agent_loop_bench(shape: AgentShape, config: SimConfig, rates: Rates = Rates(),
                         seed: int = 0) -> dict:
    """Every variant of one seed's sessions; the JSON-ready figures."""
    calls = agent_calls(shape, seed)
    figures = [replay_variant(render(calls, shape, variant, keys), name, config, rates)
               for name, variant, keys in VARIANTS]
    out: dict = {"requests": len(calls), "sessions": shape.sessions,
                 "volatile_share": shape.volatile_share, "workers": config.workers,
                 "capacity_tokens": config.capacity_tokens, "ttl_s": config.ttl_s,
                 "write_rate": rates.write_rate(config.ttl_s), "seed": seed}
    for f in figures:
        out[f"hit_ratio_{f.name}"] = round(f.hit_ratio, 4)
        out[f"m_{f.name}"] = round(f.multiplier, 4)
        out[f"ideal_hit_ratio_{f.name}"] = round(f.ideal_hit_ratio, 4)
        out[f"goodput_{f.name}"] = round(f.goodput, 4)
        out[f"ttft_p99_s_{f.name}"] = round(f.ttft_p99_s, 3)
    return out


def register_bench(sub) -> None:
    b = sub.add_parser("agent-loop", help="agent tool loops with a volatile system prompt "
                                          "line: as sent, with a breakpoint, with session keys")
    b.add_argument("--sessions", type=int, default=AgentShape().sessions)
    b.add_argument("--workers", type=int, default=4)
    b.add_argument("--capacity-tokens", type=int, default=1_000_000,
                   help="cache per worker, tokens")
    b.add_argument("--ttl-s", type=float, default=300.0,
                   help="the store's TTL (writes priced at its rate)")
    b.add_argument("--ttft-slo-s", type=float, default=5.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    shape = AgentShape(sessions=args.sessions)
    config = SimConfig(workers=args.workers, capacity_tokens=args.capacity_tokens,
                       ttl_s=args.ttl_s, ttft_slo_s=args.ttft_slo_s, seed=args.seed)
    figures = run_agent_loop_bench(shape, config, seed=args.seed)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{figures['requests']} requests in {figures['sessions']} sessions "
          f"({figures['volatile_share']:.0%} with a volatile line), {figures['workers']} "
          f"workers x {figures['capacity_tokens']} tokens, TTL {figures['ttl_s']:g} s")
    print(f"{'':<34}{'hit':>8}{'M':>8}{'ideal hit':>11}{'goodput':>9}{'ttft p99':>10}")
    for name, _, _ in VARIANTS:
        print(f"{name:<34}{figures[f'hit_ratio_{name}']:>8.4f}{figures[f'm_{name}']:>8.4f}"
              f"{figures[f'ideal_hit_ratio_{name}']:>11.4f}{figures[f'goodput_{name}']:>9.1%}"
              f"{figures[f'ttft_p99_s_{name}']:>9.2f}s")
    return 0
