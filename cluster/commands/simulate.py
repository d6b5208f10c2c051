"""``orchard simulate``: trace replay of routing policies side by side, and two helpers.

    orchard simulate [--trace FILE] [--workers N] [--capacity-tokens C] [--block-size B]
                     [--policies LIST] [--eviction lru|reuse] [--ttft-slo-s 2] [--json] ...
    orchard simulate --decision-bench [--bench-workers 32] [--indexed-blocks 1000000] ...
                     [--index-bytes N]                # 18M blocks: --indexed-blocks 18000000
    orchard simulate --synthesize FILE [--seed S] [--shape hot-documents|agent-loop]
                     [--requests N]
                                                       # write a differently shaped trace

Without a mode it replays the conversation trace shipped in ``router/sim/traces/``. The replay
itself lives in ``router.sim.simulator``; this module parses, validates and prints.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from router.index import DEFAULT_INDEX_BYTES
from router.kv.ledger import DEFAULT_EVICTION, EVICTION_POLICIES
from router.policy import PolicyConfig
from router.pull_cost import DEFAULT_FIXED_S
from router.sim.policies import POLICY_NAMES

_DEFAULTS = PolicyConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="replay a Mooncake trace through orchard's router and baselines",
        description="Replay a Mooncake-format trace through orchard's router and baseline "
                    "policies on simulated workers (same store accounting as the cluster).")
    mode = p.add_argument_group("what to run (one of)")
    mode.add_argument("--trace", help="Mooncake-format JSONL trace to replay (default: the "
                                      "shipped conversation trace, router/sim/traces/)")
    mode.add_argument("--decision-bench", action="store_true",
                      help="time routing decisions (8k-token prompt, many workers, big index)")
    mode.add_argument("--synthesize", metavar="FILE",
                      help="write a synthetic trace of a different shape to FILE and exit")
    p.add_argument("--shape", choices=("conversations", "hot-documents", "agent-loop"),
                   default="conversations",
                   help="with --synthesize: conversations on shared system prompts, a few "
                        "long documents with many short questions (router.sim.hot_trace), or "
                        "agents' tool loops with session keys, half with a volatile system "
                        "prompt line (router.sim.agent_trace)")
    p.add_argument("--requests", type=int,
                   help="with --synthesize: how many requests (default: the shape's own, "
                        "12,000 conversations' or 6,000 hot-document questions; an agent "
                        "loop is sized by its sessions)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-tokens", type=int, default=1_000_000,
                   help="cache capacity per worker, in tokens")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help=f"comma-separated, from: {', '.join(POLICY_NAMES)}")
    p.add_argument("--eviction", default=DEFAULT_EVICTION.value, choices=EVICTION_POLICIES,
                   help="the workers' store eviction policy (default: reuse; lru is the plain one)")
    p.add_argument("--ttl-s", type=float, default=3600.0, help="store TTL from last use")
    p.add_argument("--prefill-tps", type=float, default=6000.0,
                   help="prefill throughput per worker, tokens/s")
    p.add_argument("--decode-tps", type=float, default=30.0,
                   help="decode speed per request, tokens/s")
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="time workers by this measured engine profile (`orchard bench profile`) "
                        "instead of --prefill-tps/--decode-tps; --block-size must match it")
    p.add_argument("--spec", metavar="WIDTH:ACCEPTED",
                   help="with --profile: every decode step a verify pass of WIDTH drafts a "
                        "request, ACCEPTED of them taken on average (e.g. 4:2.5)")
    p.add_argument("--trace-block", type=int, default=512,
                   help="tokens per hash id in the trace (512 in Mooncake traces; less in a "
                        "trace scaled down by `orchard replay --write-scaled`)")
    p.add_argument("--ttft-slo-s", type=float, default=2.0,
                   help="goodput counts the requests whose TTFT is within this many seconds")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disk-capacity-tokens", type=int, default=0,
                   help="per worker disk tier of the prefix store (0: memory only)")
    p.add_argument("--disk-read-gbps", type=float, default=2.0,
                   help="disk tier read bandwidth in GB/s (a disk hit costs its load time)")
    p.add_argument("--kv-bytes-per-token", type=int, default=46_080,
                   help="K/V bytes per cached token (the default model's, float32)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="orchard pulls prefixes between workers over links of this many "
                        "Gbit/s when that beats waiting or recomputing (0: no pulls)")
    p.add_argument("--link-fixed-ms", type=float, default=DEFAULT_FIXED_S * 1e3,
                   help="each pull's fixed cost, ms")
    p.add_argument("--cache-weight", type=float, default=_DEFAULTS.cache_weight,
                   help="orchard: prefill tokens of queue one cached token is worth")
    p.add_argument("--cold-spill-tokens", type=int, default=_DEFAULTS.cold_spill_tokens,
                   help="orchard: most queue gap a cold prompt waits at its hash home "
                        "(less for a prompt whose own new prefill is shorter)")
    p.add_argument("--balance-weight", type=float, default=_DEFAULTS.balance_weight,
                   help="orchard: weight of recent prefill work above the least-worked worker")
    p.add_argument("--index-bytes", type=int, default=DEFAULT_INDEX_BYTES,
                   help="orchard: the router's prefix index budget in bytes ([router] "
                        "index_bytes; past it the least recently used blocks are forgotten)")
    p.add_argument("--bench-workers", type=int, default=32)
    p.add_argument("--indexed-blocks", type=int, default=1_000_000,
                   help="blocks the decision bench indexes before timing (18000000: 32 Macs "
                        "x 9M tokens at block 16)")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    chosen = [bool(args.trace), args.decision_bench, bool(args.synthesize)]
    if sum(chosen) > 1:
        raise ValueError("pass at most one of --trace FILE, --decision-bench, --synthesize FILE")
    if args.requests is not None and not args.synthesize:
        raise ValueError("--requests is for --synthesize: a replay takes the whole trace")
    if args.synthesize:
        return _synthesize(args)
    if args.decision_bench:
        return _decision_bench(args)
    return _replay(args)


def _replay(args: argparse.Namespace) -> int:
    from router.sim.service import EngineProfile
    from router.sim.simulator import SimConfig, simulate
    from router.sim.trace import DEFAULT_TRACE, load_trace

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(unknown) or '(none given)'}: "
                         f"choose from {', '.join(POLICY_NAMES)}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    config = SimConfig(workers=args.workers, capacity_tokens=args.capacity_tokens,
                       block_size=args.block_size, ttl_s=args.ttl_s, eviction=args.eviction,
                       prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, seed=args.seed,
                       ttft_slo_s=args.ttft_slo_s, trace_block=args.trace_block,
                       profile=EngineProfile.read(args.profile) if args.profile else None,
                       disk_capacity_tokens=args.disk_capacity_tokens,
                       disk_read_gbps=args.disk_read_gbps,
                       kv_bytes_per_token=args.kv_bytes_per_token,
                       index_bytes=args.index_bytes, speculation=_speculation(args.spec),
                       link_gbps=args.link_gbps, link_fixed_s=args.link_fixed_ms / 1e3)
    policy = PolicyConfig(cache_weight=args.cache_weight,
                          cold_spill_tokens=args.cold_spill_tokens,
                          balance_weight=args.balance_weight)
    trace = load_trace(args.trace or DEFAULT_TRACE, args.limit)
    summary = simulate(trace, names, config, policy, quiet=args.quiet)
    if args.json:
        print(json.dumps(summary))
        return 0
    _print_table(summary)
    return 0


def _print_table(summary: dict) -> None:
    """One row per policy, goodput first: the share of requests that met the TTFT target."""
    print(f"{summary['requests']} requests, {summary['workers']} workers x "
          f"{summary['capacity_tokens']} tokens, block {summary['block_size']}, eviction "
          f"{summary['eviction']}; offered load {summary['offered_load']:.2f} (nothing "
          f"cached); ideal hit ratio {summary['ideal_hit_ratio']:.4f}")
    slo = f"ttft<={summary['ttft_slo_s']:g}s"
    print(f"{'policy':<28}{slo:>11}{'hit':>8}{'prefill Mtok':>13}{'imbal':>7}"
          f"{'ttft mean':>10}{'ttft p50':>10}{'ttft p99':>10}{'dec p50':>10}{'dec p99':>10}"
          f"{'cpu p99':>10}")
    for r in summary["policies"]:
        print(f"{r['name']:<28}{r['goodput']:>11.1%}{r['hit_ratio']:>8.4f}"
              f"{r['prefill_tokens'] / 1e6:>13.1f}{r['imbalance']:>7.3f}"
              f"{r['ttft_mean_s']:>9.2f}s{r['ttft_p50_s']:>9.2f}s{r['ttft_p99_s']:>9.2f}s"
              f"{r['decision_p50_us']:>8.1f}us{r['decision_p99_us']:>8.1f}us"
              f"{r['decision_cpu_p99_us']:>8.1f}us")
    if summary["pulls"] is not None:
        print(f"pulls over {summary['pulls']['link_gbps']:g} Gbit/s links: " + ", ".join(
            f"{r['name']} {r['pulled_tokens']} tokens pulled" for r in summary["policies"]))
    if summary["service"] == "profile":
        print("service: the measured engine profile; ITL p99 per policy: " + ", ".join(
            f"{r['name']} {r['itl_p99_s'] * 1e3:.1f} ms" for r in summary["policies"]))


def _decision_bench(args: argparse.Namespace) -> int:
    from router.sim.decision_bench import run_decision_bench

    result = run_decision_bench(workers=args.bench_workers, indexed_blocks=args.indexed_blocks,
                                block_size=args.block_size, prompt_tokens=args.prompt_tokens,
                                iterations=args.iterations, seed=args.seed,
                                index_bytes=args.index_bytes)
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    print(f"{result.prompt_tokens}-token prompt, block {result.block_size}, "
          f"{result.workers} workers, {result.indexed_blocks} indexed blocks, "
          f"{result.iterations} decisions")
    print(f"  index: {result.bytes_per_block:.1f} bytes per block (resident memory grown "
          f"over the fill), filled in {result.fill_s:.1f} s, budget {result.index_bytes} bytes")
    rows = (("hash", result.hash_p50_us, result.hash_p99_us),
            ("route", result.route_p50_us, result.route_p99_us),
            ("total", result.total_p50_us, result.total_p99_us),
            ("route (thread CPU time)", result.route_cpu_p50_us, result.route_cpu_p99_us),
            ("total (thread CPU time)", result.total_cpu_p50_us, result.total_cpu_p99_us))
    for part, p50, p99 in rows:
        print(f"  {part:<24} p50 {p50:>8.1f} us   p99 {p99:>8.1f} us")
    return 0


def _synthesize(args: argparse.Namespace) -> int:
    from router.sim.trace import SynthShape, synthesize, write_trace

    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be at least 1, got {args.requests}")
    if args.shape == "hot-documents":
        from router.sim.hot_trace import HotShape, hot_documents
        shape = HotShape() if args.requests is None else HotShape(requests=args.requests)
        requests = hot_documents(shape, seed=args.seed)
    elif args.shape == "agent-loop":
        from router.sim.agent_trace import AgentShape, agent_loop
        if args.requests is not None:
            raise ValueError("--requests does not size an agent-loop trace: its sessions do "
                             "(orchard bench agent-loop --sessions N)")
        requests = agent_loop(AgentShape(), seed=args.seed)
    else:
        synth = SynthShape() if args.requests is None else SynthShape(requests=args.requests)
        requests = synthesize(synth, seed=args.seed)
    write_trace(requests, args.synthesize)
    print(f"wrote {len(requests)} requests to {args.synthesize}", file=sys.stderr)
    return 0


def _speculation(value: str | None):
    """``--spec WIDTH:ACCEPTED`` as the simulator's ``Speculation`` (None without it)."""
    from router.sim.steps import Speculation

    if value is None:
        return None
    width, _, accepted = value.partition(":")
    try:
        width_n, accepted_n = int(width), float(accepted)
    except ValueError:
        raise ValueError(f"--spec must be WIDTH:ACCEPTED (e.g. 4:2.5), got {value!r}") from None
    try:
        return Speculation(width_n, accepted_n)
    except ValueError as exc:
        raise ValueError(f"--spec {value}: {exc}") from None
