"""Open a local mlx-lm model directory, or say exactly what is wrong with it.

Any mlx-lm model directory works (forged or not) as long as its architecture uses the standard
``KVCache`` in every layer: the prefix store slices and re-joins K/V along the sequence axis,
which is meaningless for rotating (sliding-window) caches, state-space (Mamba) caches or
quantized caches. Those are refused with a message instead of producing wrong reuse.

The directory's identity for cache keys is ``model_id`` (its name) and ``revision`` (a hash of
its config and weight files' sizes and first megabyte), so cached K/V never outlive a change
of weights.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import xxhash

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from workers.cache.blocks import KVShape

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Architectures whose logits are exactly the vocabulary projection of the body's output
# (``Model.__call__`` is ``lm_head(model(x))``, or the tied embedding): nothing after it.
_PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]
    kv_shape: KVShape
    model_id: str
    revision: str
    vocab_size: int
    max_context: int

    @property
    def body(self) -> nn.Module:
        """The model without its vocabulary projection (hidden states out)."""
        return getattr(self.model, "model", self.model)

    @property
    def head(self) -> Callable[[mx.array], mx.array] | None:
        """The vocabulary projection, hidden states to logits, where ``model(x)`` is exactly
        ``head(body(x))``; None for an architecture where it may not be (run ``model``)."""
        if self.config.get("model_type") not in _PLAIN_HEAD or self.body is self.model:
            return None
        if getattr(self.model, "lm_head", None) is not None:
            return self.model.lm_head
        return self.body.embed_tokens.as_linear


def check_model_dir(path: Path) -> dict[str, Any]:
    """Validate that ``path`` looks like a complete mlx-lm model directory; return its config."""
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist: pass an mlx-lm model directory, or make "
            f"one with `orchard model forge --out {path}`")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model directory {path} is incomplete: config.json is missing")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"model directory {path} is incomplete: no *.safetensors weights")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"model directory {path} is incomplete: no tokenizer "
            f"(expected one of {', '.join(_TOKENIZER_FILES)})")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
    if "model_type" not in config:
        raise ValueError(f"{config_file} has no model_type: it is not an mlx-lm model config")
    return config


def _revision(path: Path) -> str:
    digest = xxhash.xxh3_64()
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        digest.update(weights.name.encode())
        digest.update(str(weights.stat().st_size).encode())
        with open(weights, "rb") as fh:
            digest.update(fh.read(1 << 20))
    return digest.hexdigest()


def _kv_shape(model: nn.Module, model_type: str) -> KVShape:
    """Refuse non-standard caches; measure K/V geometry with one real forward step."""
    caches = make_prompt_cache(model)
    odd = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if odd:
        raise ValueError(
            f"architecture {model_type!r} uses {', '.join(odd)} caches, which orchard's prefix "
            f"store cannot reuse: use a model with the standard KVCache in every layer "
            f"(llama, mistral, qwen2, qwen3 without sliding-window layers)")
    model(mx.array([[0]]), cache=caches)
    keys = caches[0].keys
    return KVShape(layers=len(caches), kv_heads=keys.shape[1], head_dim=keys.shape[3],
                   dtype=keys.dtype)


def open_model_dir(path: Path | str) -> LoadedModel:
    """Load ``path`` with ``mlx_lm.load`` (no network) after checking it is complete."""
    path = Path(path).expanduser().resolve()
    config = check_model_dir(path)
    try:
        model, tokenizer = mlx_load(str(path))
    except ValueError as exc:
        raise ValueError(f"cannot load {path} with mlx-lm: {exc}") from None
    kv_shape = _kv_shape(model, str(config["model_type"]))
    vocab = int(config.get("vocab_size") or len(tokenizer.vocab))
    context = config.get("max_position_embeddings") or config.get("max_sequence_length")
    if not context:
        raise ValueError(
            f"{path / 'config.json'} gives no max_position_embeddings: add the model's context "
            f"length there")
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, kv_shape=kv_shape,
                       model_id=path.name, revision=_revision(path), vocab_size=vocab,
                       max_context=int(context))
