"""Tiny forged models shared by the engine tests: made once per test process, in a temp dir."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from workers.forge import ForgeSpec, forge

_ROOT = Path(tempfile.mkdtemp(prefix="orchard-models-"))
atexit.register(shutil.rmtree, _ROOT, True)

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_context=2048)


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str = "llama", sliding: bool = False) -> Path:
    """A 2-layer, hidden-64 model of ``arch`` (``sliding`` adds sliding-window layers)."""
    extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8} if sliding else {}
    name = f"{arch}-sliding" if sliding else arch
    return forge(_ROOT / name, ForgeSpec(arch=arch, extra=extra, **TINY))
