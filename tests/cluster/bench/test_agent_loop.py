"""``orchard bench agent-loop``: on one worker with room for everything, orchard's realised
figures are the one-cache figures, computed here independently; the fixes beat the trace as
sent; the command prints every key."""
from __future__ import annotations

import json

import pytest

from cluster.bench.agent_loop import VARIANTS, run_agent_loop_bench
from cluster.cli import main
from router.cost import Rates
from router.kv.key import reusable_tokens
from router.sim.agent_trace import AgentShape, agent_calls, render
from router.sim.simulator import SimConfig

SHAPE = AgentShape(sessions=12, session_rate_per_s=0.05, agents=2, turns=(1, 3),
                   tool_calls=(0, 3), tool_tokens=(50, 1500))
ONE = SimConfig(workers=1, capacity_tokens=10_000_000, ttl_s=1e6)


def one_cache_m(trace, rates: Rates, ttl_s: float) -> tuple[float, float]:
    """(hit ratio, M) of one unlimited cache that stores each request's writable blocks."""
    seen: set[int] = set()
    cost = cached_all = total = 0.0
    for r in trace:
        full = r.input_length // 512
        held = 0
        while held < full and r.hash_ids[held] in seen:
            held += 1
        cached = reusable_tokens(r.input_length, held, 512)
        writable = full if r.write_blocks is None else r.write_blocks
        written = max(0, writable - held) * 512
        cost += (rates.uncached * (r.input_length - cached - written)
                 + rates.write_rate(ttl_s) * written + rates.cache_read * cached)
        cached_all += cached
        total += r.input_length
        seen.update(r.hash_ids[:writable])
    return cached_all / total, cost / total


def test_one_worker_realises_the_one_cache_figures_and_the_fix_pays():
    out = run_agent_loop_bench(SHAPE, ONE, seed=2)
    calls = agent_calls(SHAPE, seed=2)
    assert out["requests"] == len(calls) and out["write_rate"] == 2.0
    for name, variant, keys in VARIANTS:
        hit, m = one_cache_m(render(calls, SHAPE, variant, keys), Rates(), ONE.ttl_s)
        assert out[f"hit_ratio_{name}"] == round(hit, 4) == out[f"ideal_hit_ratio_{name}"]
        assert out[f"m_{name}"] == round(m, 4)
    assert out["hit_ratio_with_breakpoint"] > out["hit_ratio_as_sent"]
    assert out["m_with_breakpoint"] < out["m_as_sent"]
    # one worker: a session key has nowhere else to send a request
    assert out["hit_ratio_with_session_keys"] == out["hit_ratio_as_sent"]


def test_the_command_prints_every_variant(capsys):
    assert main(["bench", "agent-loop", "--sessions", "6", "--workers", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name, _, _ in VARIANTS:
        assert {f"hit_ratio_{name}", f"m_{name}", f"goodput_{name}"} <= set(out)
    assert out["sessions"] == 6 and out["ttl_s"] == 300.0 and out["write_rate"] == 1.25
    assert main(["bench", "agent-loop", "--sessions", "0"]) == 2
    assert "at least one session" in capsys.readouterr().err
