"""``orchard model ...``: import, list, inspect and forge local mlx-lm model directories.

- ``import SRC --out DIR [--dtype float32|float16|bfloat16|keep]``: a GGUF file (llama family)
  or a Hugging Face safetensors directory to an mlx-lm directory (``workers.model.model_import``);
- ``list``: the directories under ``$ORCHARD_HOME/models`` (the default model among them);
- ``inspect DIR [--json]``: architecture, sizes, dtype, K/V bytes per token, provenance;
- ``forge --out DIR``: a model with random weights, for tests and shape experiments.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="local model directories")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION")
    i = sub.add_parser("import", help="import a GGUF file or a Hugging Face directory")
    i.add_argument("src", type=Path, help="a .gguf file (llama family) or a Hugging Face "
                   "safetensors directory")
    i.add_argument("--out", type=Path, required=True, help="the model directory to write")
    i.add_argument("--dtype", default="float32",
                   choices=("float32", "float16", "bfloat16", "keep"),
                   help="weight dtype (default float32, the fast one on a Linux CPU; keep: "
                        "leave quantized layers quantized)")
    i.set_defaults(func=import_)
    ls = sub.add_parser("list", help="model directories under $ORCHARD_HOME/models")
    ls.set_defaults(func=list_)
    ins = sub.add_parser("inspect", help="architecture, sizes, dtype, K/V bytes, provenance")
    ins.add_argument("dir", type=Path, nargs="?", help="a model directory (default: the "
                     "embedded default model)")
    ins.add_argument("--json", action="store_true", help="print one JSON object")
    ins.set_defaults(func=inspect)
    f = sub.add_parser("forge", help="forge a model: random weights, real tokenizer, chat template")
    f.add_argument("--out", required=True, help="directory to write")
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


def import_(args: argparse.Namespace) -> int:
    from rich.console import Console

    from workers.model.model_import import import_model

    console = Console(stderr=True)
    started = time.monotonic()
    with console.status(f"importing {args.src} ({args.dtype})"):
        out = import_model(args.src, args.out, args.dtype)
    print(f"imported {args.src} into {out} in {time.monotonic() - started:.1f} s")
    return 0


def list_(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from workers.model.default_model import models_dir
    from workers.model.model_info import list_models

    found = list_models()
    if not found:
        print(f"no model directories under {models_dir()} (the default model is imported "
              f"there on first use; `orchard model import SRC --out DIR` adds others)")
        return 0
    table = Table("name", "architecture", "layers", "parameters", "dtype", "K/V per token",
                  "source", title=str(models_dir()))
    for m in found:
        if isinstance(m, tuple):
            table.add_row(m[0].name, "[red]unreadable[/red]", "", "", "", "", m[1])
            continue
        table.add_row(m.path.name, m.architecture, str(m.layers), f"{m.parameters / 1e6:.0f} M",
                      m.dtype + (" q" if m.quantization else ""),
                      f"{m.kv_bytes_per_token:,} B", _source(m.provenance))
    Console().print(table)
    return 0


def _source(provenance: dict) -> str:
    if "shipped_in" in provenance:
        return f"{provenance['shipped_in']} ({provenance['format']})"
    if "source" in provenance:
        return f"{provenance['source']} ({provenance['format']})"
    return provenance.get("format", "unknown")


def inspect(args: argparse.Namespace) -> int:
    from workers.model.default_model import ensure_default_model
    from workers.model.model_info import inspect_model

    info = inspect_model(args.dir or ensure_default_model())
    if args.json:
        print(json.dumps(info.as_json(), indent=2))
        return 0
    rows = [
        ("path", str(info.path)),
        ("architecture", info.architecture),
        ("layers", str(info.layers)),
        ("hidden", f"{info.hidden} (intermediate {info.intermediate})"),
        ("heads", f"{info.heads} query, {info.kv_heads} K/V, head dim {info.head_dim}"),
        ("vocabulary", f"{info.vocab_size:,} tokens"),
        ("context", f"{info.max_context:,} tokens"),
        ("parameters", f"{info.parameters:,}"),
        ("dtype", info.dtype + (f", quantized {info.quantization}" if info.quantization else "")),
        ("weights", f"{info.weight_bytes / 2**20:.1f} MiB"),
        ("K/V per token", f"{info.kv_bytes_per_token:,} bytes"),
    ]
    rows.append(("provenance", "" if info.provenance else "unknown (no record)"))
    rows += [(f"  {k}", str(v)) for k, v in info.provenance.items()]
    for key, value in rows:
        print(f"{key:<16} {value}")
    return 0


def forge(args: argparse.Namespace) -> int:
    from workers.model.forge import ForgeSpec, forge as forge_model

    spec = ForgeSpec(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     kv_heads=args.kv_heads, intermediate=args.intermediate,
                     max_context=args.max_context, seed=args.seed)
    out = forge_model(Path(args.out), spec)
    print(f"forged {spec.arch} model ({spec.layers} layers, hidden {spec.hidden}, "
          f"{spec.heads} heads / {spec.kv_heads} kv heads) in {out}")
    return 0
