"""``orchard replay``: a scaled slice of a trace sent to a real local cluster on its timestamps.

    orchard replay [--trace FILE] [--start 0] [--requests 150] [--scale 32] [--time-scale 1]
                   [--workers 2] [--model DIR] [--profile PROFILE.json] [--write-scaled FILE]
                   [--json]

With ``--profile`` the same slice also runs through the simulator on that engine profile, and
the two are printed side by side (hit ratio within 0.02 and TTFT p50 within 25% is the bar).
The replay lives in ``cluster.bench.replay``; this module parses, validates and prints.
"""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay", help="send a scaled slice of a trace to a local cluster on its timestamps",
        description="Replay a slice of a Mooncake-format trace, token counts divided by "
                    "--scale, as Generate requests to a fresh local cluster; with --profile, "
                    "beside the simulator's figures for the same slice.")
    p.add_argument("--trace", help="Mooncake-format JSONL (default: the shipped conversation "
                                   "trace, router/sim/traces/)")
    p.add_argument("--start", type=int, default=0, help="first trace line of the slice (0-based)")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--scale", type=int, default=32,
                   help="divide token counts by this (a divisor of 512)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the gaps between arrivals by this")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="also simulate the slice on this engine profile and compare")
    p.add_argument("--write-scaled", metavar="FILE",
                   help="write the scaled slice as a trace (for `orchard simulate --trace FILE "
                        "--trace-block 512/scale`)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from cluster.bench.replay import ReplaySlice, replay_on_cluster, scale_slice
    from router.sim.service import EngineProfile
    from router.sim.trace import DEFAULT_TRACE, load_trace, write_trace

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    part = ReplaySlice(args.start, args.requests, args.scale, args.time_scale)
    profile = EngineProfile.read(args.profile) if args.profile else None
    lines = scale_slice(load_trace(args.trace or DEFAULT_TRACE, args.start + args.requests), part)
    if args.write_scaled:
        write_trace(lines, args.write_scaled)

    def check(info) -> None:
        if profile is not None:
            profile.check(info.block_size, info.model_id)  # model_id None: not known yet
        if part.block_tokens % info.block_size:
            raise ValueError(f"--scale {part.scale} makes {part.block_tokens}-token trace "
                             f"blocks, not a multiple of the cluster's {info.block_size}-token "
                             f"blocks: use a smaller --scale")

    def say(line: str) -> None:
        print(f"orchard replay: {line}", file=sys.stderr, flush=True)

    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.engine.engine import EngineConfig
    from workers.model.default_model import ensure_default_model

    check(_Planned(EngineConfig().block_size))  # before any process starts

    model = args.model or str(ensure_default_model())
    say(f"{len(lines)} requests over {lines[-1].arrival_s:.1f} s on {args.workers} workers")
    measured = replay_on_cluster(model, args.workers, lines, part, say=say, check=check)
    summary = {"slice": asdict(part), "cluster": asdict(measured)}
    if profile is not None:
        summary["simulator"] = _simulate(lines, part, profile, args.workers)
    if args.json:
        print(json.dumps(summary))
        return 0
    _print(summary)
    return 0


class _Planned:
    """The cluster's block size before it starts; its model id is known once it runs."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.model_id = block_size, None


def _simulate(lines, part, profile, workers: int) -> dict:
    from router.sim.simulator import SimConfig, replay
    from workers.engine.engine import EngineConfig

    engine = EngineConfig()
    config = SimConfig(workers=workers, block_size=profile.block_size,
                       capacity_tokens=engine.store_bytes // max(1, profile.kv_bytes_per_token),
                       ttl_s=engine.ttl_s, eviction=engine.eviction,
                       trace_block=part.block_tokens, profile=profile,
                       prefill_budget=engine.prefill_budget, decode_stall=engine.decode_stall)
    r = replay(lines, "orchard", config)
    return {"hit_ratio": r.hit_ratio, "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s,
            "goodput": r.goodput, "itl_p99_s": r.itl_p99_s}


def _print(summary: dict) -> None:
    c = summary["cluster"]
    print(f"{c['requests']} requests on {c['workers']} workers in {c['wall_s']:.1f} s; "
          f"per worker {c['per_worker']}")
    s = summary.get("simulator")
    print(f"{'':<12}{'cluster':>10}" + (f"{'simulator':>11}{'difference':>13}" if s else ""))
    for key, label in (("hit_ratio", "hit ratio"), ("ttft_p50_s", "TTFT p50"),
                       ("ttft_p99_s", "TTFT p99")):
        line = f"{label:<12}{c[key]:>10.4f}"
        if s:
            diff = (f"{s[key] - c[key]:+.4f}" if key == "hit_ratio"
                    else f"{(s[key] / c[key] - 1) if c[key] else 0.0:+.1%}")
            line += f"{s[key]:>11.4f}{diff:>13}"
        print(line)
    if s:
        print("bar: hit ratio within 0.02, TTFT p50 within 25%")
