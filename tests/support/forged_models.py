"""Tiny forged models shared by the engine tests: made once per test process, in a temp dir.

With ``ORCHARD_FORGED_MODELS`` set to a directory (``./run.sh mutants`` sets it), a model is
forged once into it and reused by every process after, under a name that changes with the
forge's source and the model's spec: mutation testing starts a process per mutant, and
forging costs seconds (and a process ended by ``os._exit`` never removes its temp dir).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import workers.model.forge
from workers.model.forge import ForgeSpec, forge

_SHARED = os.environ.get("ORCHARD_FORGED_MODELS", "")
_ROOT = Path(_SHARED) if _SHARED else Path(tempfile.mkdtemp(prefix="orchard-models-"))
if not _SHARED:
    atexit.register(shutil.rmtree, _ROOT, True)

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_context=2048)


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str = "llama", sliding: bool = False, template: str = "plain") -> Path:
    """A 2-layer, hidden-64 model of ``arch`` (``sliding`` adds sliding-window layers;
    ``template="tools"`` a chat template that renders tools and tool calls)."""
    extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8} if sliding else {}
    name = f"{arch}-sliding" if sliding else arch
    name += "" if template == "plain" else f"-{template}"
    return _forged(name, ForgeSpec(arch=arch, extra=extra, template=template, **TINY))


@functools.lru_cache(maxsize=None)
def tiny_draft(vocab_size: int = 0) -> Path:
    """A 1-layer, hidden-32 llama with ``tiny_model``'s tokenizer (another seed): a draft
    model for it. ``vocab_size``: an embedding of another size, same tokenizer."""
    extra = {"vocab_size": vocab_size} if vocab_size else {}
    name = f"draft-{vocab_size}" if vocab_size else "draft"
    return _forged(name, ForgeSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                   max_context=2048, seed=1, extra=extra))


def _forged(name: str, spec: ForgeSpec) -> Path:
    if not _SHARED:
        return forge(_ROOT / name, spec)
    source = Path(workers.model.forge.__file__).read_bytes() + repr(spec).encode()
    out = _ROOT / f"{name}-{hashlib.sha256(source).hexdigest()[:16]}"
    if not out.exists():
        staged = forge(_ROOT / f".{name}-{os.getpid()}", spec)
        try:
            staged.rename(out)  # atomic; another process may have published it first
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
    return out


@functools.lru_cache(maxsize=None)
def near_draft(scale: float = 0.1) -> Path:
    """``tiny_model``'s llama with every weight moved by ``scale`` of its own spread
    (seeded noise): a draft that agrees with it often, not always (0.1: about 4 drafts in 10
    accepted, greedy, on ``tests/support/spec_runs``'s batch)."""
    import workers  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx

    source = tiny_model("llama")
    out = _ROOT / f"{source.name}-near-{scale}"
    if out.exists():
        return out
    staged = _ROOT / f".{out.name}-{os.getpid()}"
    shutil.copytree(source, staged)
    weights = mx.load(str(source / "model.safetensors"))
    key = mx.random.key(7)
    moved = {}
    for name in sorted(weights):
        key, sub = mx.random.split(key)
        w = weights[name]
        moved[name] = w + scale * mx.std(w) * mx.random.normal(w.shape, key=sub)
    mx.save_safetensors(str(staged / "model.safetensors"), moved, metadata={"format": "mlx"})
    try:
        staged.rename(out)
    except OSError:  # another process published it first
        shutil.rmtree(staged, ignore_errors=True)
    return out
