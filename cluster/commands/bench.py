"""``orchard bench ...``: benchmarks that print measured figures.

``orchard bench engine [--json]`` runs the engine benchmark (``workers.bench``) on the embedded
default model (forged on first use) or ``--model DIR``.
"""
from __future__ import annotations

import argparse
import json

from cluster.bench.telemetry import add_parsers as add_telemetry_benches


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks that print measured figures")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    e = sub.add_parser("engine", help="chat TTFT with and without the prefix store")
    e.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    e.add_argument("--turns", type=int, default=8)
    e.add_argument("--reply-tokens", type=int, default=32)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=engine)
    add_telemetry_benches(sub)  # telemetry (tracing overhead), forecast (job forecast error)
    from cluster.bench.api import register_bench  # `orchard bench api`: the gRPC path overhead
    register_bench(sub)
    from cluster.bench.cluster import register_bench as register_cluster_bench
    register_cluster_bench(sub)  # `orchard bench cluster`: routing vs round robin on Ray
    from cluster.bench.spans import register_bench as register_span_bench
    register_span_bench(sub)  # `orchard bench spans`: span cost in the router and workers
    from cluster.bench.profile import register_bench as register_profile_bench
    register_profile_bench(sub)  # `orchard bench profile`: the engine's service profile
    p.set_defaults(func=lambda args: p.print_help() or 2)


def engine(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.bench import bench_engine
    from workers.forge import ensure_default_model

    if args.turns < 1 or args.reply_tokens < 1 or args.block_size < 1:
        raise ValueError("--turns, --reply-tokens and --block-size must be positive")
    result = bench_engine(args.model or ensure_default_model(), turns=args.turns,
                          reply_tokens=args.reply_tokens, block_size=args.block_size)
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
        return 0
    print(f"model {result.model}, system prompt {result.system_prompt_tokens} tokens")
    print("turn  prompt  cached  computed  ttft_warm  ttft_cold  ttft_floor")
    for t in result.turns:
        print(f"{t.turn:>4}  {t.prompt_tokens:>6}  {t.cached_tokens:>6}  {t.computed_tokens:>8}  "
              f"{t.ttft_warm_s * 1e3:>7.1f}ms {t.ttft_cold_s * 1e3:>7.1f}ms {t.ttft_floor_s * 1e3:>8.1f}ms")
    print(f"ttft_warm_over_floor {result.ttft_warm_over_floor:.3f} (target <= 1.2)")
    print(f"ttft_cold_over_warm  {result.ttft_cold_over_warm:.2f}")
    print(f"bytes_per_cached_token {result.bytes_per_cached_token:.0f} "
          f"(theoretical {result.theoretical_bytes_per_token}, target <= 1.1x)")
    return 0
