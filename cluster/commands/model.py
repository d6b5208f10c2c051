"""``orchard model forge``: write a local mlx-lm model directory with random float32 weights."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="local model directories")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION")
    f = sub.add_parser("forge", help="forge a model: random weights, real tokenizer, chat template")
    f.add_argument("--out", help="directory to write (default: the embedded default model)")
    f.add_argument("--arch", default="llama", help="llama, mistral, qwen2 or qwen3")
    f.add_argument("--layers", type=int, default=4)
    f.add_argument("--hidden", type=int, default=256)
    f.add_argument("--heads", type=int, default=4)
    f.add_argument("--kv-heads", type=int, default=2)
    f.add_argument("--intermediate", type=int, default=768)
    f.add_argument("--max-context", type=int, default=4096)
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(func=forge)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def forge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workers.forge import ForgeSpec, default_model_dir, forge as forge_model

    spec = ForgeSpec(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     kv_heads=args.kv_heads, intermediate=args.intermediate,
                     max_context=args.max_context, seed=args.seed)
    out = forge_model(Path(args.out) if args.out else default_model_dir(), spec)
    print(f"forged {spec.arch} model ({spec.layers} layers, hidden {spec.hidden}, "
          f"{spec.heads} heads / {spec.kv_heads} kv heads) in {out}")
    return 0
