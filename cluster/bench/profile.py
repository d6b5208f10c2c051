"""``orchard bench profile``: measure the engine's service profile for the simulator.

    orchard bench profile [--model DIR] --out PROFILE.json [--block-size 16] [--max-batch 8]
                          [--new-tokens 16,128,512,1024] [--cached-tokens 0,512,2048]
                          [--batch-sizes 1,2,4,8] [--contexts 128,1024,2048] [--repeats 2]

The measurement lives in ``workers.lab.profile``; ``orchard simulate --profile PROFILE.json``
uses its answer instead of the linear service model.
"""
from __future__ import annotations

import argparse
import sys

_GRID_FIELDS = ("new_tokens", "cached_tokens", "batch_sizes", "contexts", "draft_widths")


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Add ``profile`` to the ``orchard bench`` subcommands."""
    from workers.lab.profile import ProfileGrid

    p = sub.add_parser("profile", help="measure the engine's prefill, decode and load times "
                                       "for `orchard simulate --profile`")
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoding at once")
    defaults = ProfileGrid()
    for name in _GRID_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}",
                       default=",".join(map(str, getattr(defaults, name))),
                       help="comma-separated grid points")
    p.add_argument("--decode-steps", type=int, default=defaults.decode_steps)
    p.add_argument("--repeats", type=int, default=defaults.repeats,
                   help="timed runs per point (the best is kept)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model
    from workers.lab.profile import ProfileGrid, measure_profile

    if args.block_size < 1 or args.max_batch < 1:
        raise ValueError("--block-size and --max-batch must be positive")
    axes = {name: _ints(getattr(args, name), name) for name in _GRID_FIELDS}
    grid = ProfileGrid(**axes, decode_steps=args.decode_steps, repeats=args.repeats)
    if grid.batch_sizes[-1] > args.max_batch:
        raise ValueError(f"--batch-sizes goes to {grid.batch_sizes[-1]} but --max-batch is "
                         f"{args.max_batch}: the engine never runs a bigger batch")
    profile = measure_profile(args.model or ensure_default_model(), args.block_size,
                              args.max_batch, grid,
                              progress=lambda line: print(f"orchard bench profile: {line}",
                                                          file=sys.stderr, flush=True))
    profile.write(args.out)
    print(f"wrote the profile of {profile.model} (block {profile.block_size}) to {args.out}")
    return 0


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} must be comma-separated integers, "
                         f"got {text!r}") from None
