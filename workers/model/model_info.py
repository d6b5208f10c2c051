"""What a model directory holds, read from its files without loading the weights.

``inspect_model(DIR)`` reads ``config.json``, the safetensors headers (tensor names, dtypes and
shapes: the 8-byte length and JSON header that start every ``.safetensors`` file) and the
provenance record, and returns a ``ModelInfo``: architecture, sizes, parameter count, weight
dtype, the K/V bytes one token costs in the prefix store, and where the directory came from.
``list_models()`` does it for every directory under ``$ORCHARD_HOME/models``.
"""
from __future__ import annotations

import collections
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.model.default_model import models_dir
from workers.model.model_dir import check_model_dir
from workers.model.model_import import read_provenance

_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F64": 8, "I64": 8, "U8": 1,
             "I8": 1, "BOOL": 1}
_ACTIVATION_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: Path
    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    max_context: int
    parameters: int
    dtype: str                # the float dtype of the weights (and so of the K/V cache)
    quantization: str | None  # e.g. "4-bit, group 32 (model.embed_tokens 8-bit)"
    weight_bytes: int
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, in the weights' float dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * _ACTIVATION_BYTES[self.dtype]

    def as_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "architecture": self.architecture, "layers": self.layers,
                "hidden": self.hidden, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "intermediate": self.intermediate,
                "vocab_size": self.vocab_size, "max_context": self.max_context,
                "parameters": self.parameters, "dtype": self.dtype,
                "quantization": self.quantization, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "provenance": self.provenance}


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated: no safetensors header")
        (length,) = struct.unpack("<Q", raw)
        body = fh.read(length)
    if len(body) < length:
        raise ValueError(f"{path} is truncated: its safetensors header is cut short")
    header = json.loads(body)
    header.pop("__metadata__", None)
    return header


def _bits(config: dict[str, Any], layer: str) -> int:
    quant = config.get("quantization") or {}
    return int((quant.get(layer) or quant).get("bits", 32))


def _weights(path: Path, config: dict[str, Any]) -> tuple[int, str, int]:
    """(parameter count, dominant float dtype, bytes on disk) from the safetensors headers."""
    params, bytes_total = 0, 0
    float_counts: collections.Counter[str] = collections.Counter()
    for f in sorted(path.glob("*.safetensors")):
        bytes_total += f.stat().st_size
        for name, t in _header(f).items():
            n = 1
            for d in t["shape"]:
                n *= d
            if name.endswith((".scales", ".biases")):
                continue
            if t["dtype"] == "U32":  # packed quantized weights: 32 / bits values per word
                n = n * 32 // _bits(config, name.removesuffix(".weight"))
            else:
                float_counts[t["dtype"]] += n
            params += n
    dominant = float_counts.most_common(1)[0][0] if float_counts else "F16"
    return params, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dominant], bytes_total


def _quantization(config: dict[str, Any]) -> str | None:
    quant = config.get("quantization")
    if not quant:
        return None
    text = f"{quant['bits']}-bit, group {quant['group_size']}"
    others = [f"{k} {v['bits']}-bit" for k, v in quant.items() if isinstance(v, dict)]
    return text + (f" ({', '.join(others)})" if others else "")


def inspect_model(path: Path | str) -> ModelInfo:
    path = Path(path).expanduser().resolve()
    config = check_model_dir(path)
    text = config.get("text_config", config)  # multimodal configs nest the language model
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    params, dtype, weight_bytes = _weights(path, config)
    return ModelInfo(
        path=path, architecture=str(config["model_type"]),
        layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        intermediate=int(text.get("intermediate_size", 0)),
        vocab_size=int(text.get("vocab_size", 0)),
        max_context=int(text.get("max_position_embeddings", 0)),
        parameters=params, dtype=dtype, quantization=_quantization(config),
        weight_bytes=weight_bytes, provenance=read_provenance(path))


def list_models(root: Path | None = None) -> list[ModelInfo | tuple[Path, str]]:
    """Every model directory under ``root`` (default ``$ORCHARD_HOME/models``), by name.

    A directory that cannot be read is listed as ``(path, reason)`` rather than hidden.
    """
    root = root or models_dir()
    found: list[ModelInfo | tuple[Path, str]] = []
    if not root.is_dir():
        return found
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            found.append(inspect_model(d))
        except (ValueError, KeyError, FileNotFoundError) as exc:
            found.append((d, str(exc)))
    return found
