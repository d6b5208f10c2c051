"""Read a llama-family GGUF file into the parts of an mlx-lm model directory.

MLX reads GGUF itself (``mx.load(path, return_metadata=True)``): float tensors come back as
arrays, Q4_0 / Q4_1 / Q8_0 tensors as MLX's affine quantization (packed ``uint32`` weights
plus float16 ``scales`` and ``biases``, group size 32; the bit width follows from the packed
width: 4 bits for Q4_*, 8 for Q8_0); Q2_K, Q4_K, Q6_K and BF16 tensors are dequantized to
float16 as they are read. Other types (Q5_*, Q3_K, the IQ* family, ternary and MXFP4) MLX
either refuses or silently skips, so the tensor table is read first (``_tensor_types``) and such
a file is refused by name. What this module adds on top:

- ``config.json`` from the ``llama.*`` hyperparameters;
- the tensor names: GGUF's (``blk.0.attn_q``) mapped back to mlx-lm's
  (``model.layers.0.self_attn.q_proj``) by running mlx-lm's own exporter naming
  (``mlx_lm.gguf.translate_weight_names``) over the parameters of the mlx-lm model;
- the rows of Q and K put back in Hugging Face order. llama.cpp's converter interleaves each
  head's two rotary halves for its rope kernel::

      HF rows of one head:   [r0 r1 ... r31 | r32 ... r63]      (first half, second half)
      GGUF rows of one head: [r0 r32 r1 r33 ... r31 r63]        (pairs)

  Undone with ``reshape(heads, rows/heads/2, 2, ...).swapaxes(1, 2)`` (K uses the KV head
  count). Left permuted, the model runs but emits only newlines;
- the tokenizer: ``tokenizer.ggml.*`` handed to transformers' GGUF tokenizer builder, saved as
  ``tokenizer.json`` + ``tokenizer_config.json`` with ``tokenizer.chat_template``.

``dtype`` is ``float32`` (dequantize; the fast choice on a Linux CPU), ``float16``,
``bfloat16`` or ``keep`` (quantized tensors stay MLX-quantized, the rest as stored).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

SUPPORTED_ARCHITECTURES = ("llama",)
DTYPES = ("float32", "float16", "bfloat16", "keep")
GROUP_SIZE = 32  # MLX's GGUF reader uses llama.cpp's block of 32 for every quantized type
_MLX_BITS = (2, 3, 4, 5, 6, 8)
# GGML tensor types MLX's reader handles, by id (ggml.h's enum ggml_type).
_READABLE = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 10: "Q2_K", 12: "Q4_K",
             14: "Q6_K", 30: "BF16"}
_OTHER = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K", 16: "IQ2_XXS",
          17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
          23: "IQ4_XS", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """What a GGUF file holds, in mlx-lm's terms."""

    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    quantization: dict[str, Any] | None  # mlx-lm's config["quantization"] when dtype is keep


def read_gguf(path: Path, dtype: str = "float32") -> GGUFModel:
    """Everything needed to write an mlx-lm directory from the GGUF file at ``path``."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    tensors, meta = _load(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported; orchard imports GGUF files of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}-family models (convert others from their "
            f"Hugging Face safetensors directory instead)")
    config = _config(path, meta, tensors)
    tensors = _rename(path, tensors, config)
    _unpermute_qk(tensors, config)
    weights, quantization = _cast(path, tensors, dtype)
    return GGUFModel(config=config, weights=weights, tokenizer=_tokenizer(path, meta, config),
                     quantization=quantization)


def _load(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a .gguf file or a model directory")
    for name, kind in _tensor_types(path).items():
        if kind not in _READABLE:
            raise ValueError(
                f"{path}: tensor {name} uses quantization type {_OTHER.get(kind, kind)}, which "
                f"orchard cannot import (readable: {', '.join(_READABLE.values())}); use a "
                f"Q4_0, Q4_1, Q8_0 or F16 file of the model")
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"{path} cannot be read as GGUF: {exc}. The file may be truncated (compare its size "
            f"with the original) or corrupt") from None
    return tensors, meta


def _tensor_types(path: Path) -> dict[str, int]:
    """The tensor table of a GGUF file: name -> GGML type id, read from the header.

    Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, KV count u64,
    the KVs (key string, value type u32, value), then per tensor: name string, n_dims u32,
    dims u64 x n_dims, type u32, offset u64. Strings are a u64 length and UTF-8 bytes.
    """
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    size = path.stat().st_size
    with open(path, "rb") as fh:
        def read(n: int) -> bytes:
            data = fh.read(n) if n <= size - fh.tell() else b""  # a corrupt length: no huge read
            if len(data) < n:
                raise ValueError(f"{path} is truncated: its GGUF header is cut short")
            return data

        def u32() -> int:
            return struct.unpack("<I", read(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", read(8))[0]

        def skip(kind: int) -> None:
            if kind in scalar:
                read(scalar[kind])
            elif kind == 8:
                read(u64())
            elif kind == 9:
                inner, count = u32(), u64()
                if inner in scalar:
                    read(scalar[inner] * count)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                raise ValueError(f"{path}: unknown GGUF metadata value type {kind}: corrupt file?")

        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")
        if u32() not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version (orchard reads versions 2 and 3)")
        tensors, kvs = u64(), u64()
        for _ in range(kvs):
            read(u64())
            skip(u32())
        types = {}
        for _ in range(tensors):
            name = read(u64()).decode("utf-8", "replace")
            read(8 * u32())
            types[name] = u32()
            u64()
    return types


def _scalar(path: Path, meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"{path} has no {key} in its metadata: it is not a complete llama GGUF")
    return value.item() if isinstance(value, mx.array) else value


def _config(path: Path, meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor: it is not a complete llama GGUF")
    hidden = int(_scalar(path, meta, "llama.embedding_length"))
    heads = int(_scalar(path, meta, "llama.attention.head_count"))
    kv_heads = int(_scalar(path, meta, "llama.attention.head_count_kv", heads))
    if meta.get("llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path} uses rope scaling, which orchard's GGUF import does not read "
                         f"yet: import the model from its Hugging Face directory instead")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(path, meta, "llama.block_count")),
        "intermediate_size": int(_scalar(path, meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_scalar(path, meta, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_scalar(path, meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(path, meta, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_scalar(path, meta, "llama.context_length")),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _optional_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _optional_int(meta, "tokenizer.ggml.eos_token_id"),
    }


def _optional_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value.item())


def _rename(path: Path, tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensor names to mlx-lm's, by mlx-lm's own (HF -> GGUF) naming run backwards."""
    from mlx.utils import tree_flatten
    from mlx_lm.gguf import translate_weight_names
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    names = [n for n, _ in tree_flatten(model_class(args_class.from_dict(config)).parameters())]
    to_mlx = {}
    for name in names:
        stem = name.removesuffix(".weight")
        for suffix in (".weight", ".scales", ".biases") if stem != name else ("",):
            to_mlx[translate_weight_names(stem + suffix if suffix else name)] = stem + suffix
    unknown = sorted(set(tensors) - set(to_mlx))
    if unknown:
        raise ValueError(f"{path} holds tensors a llama model does not have: "
                         f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    renamed = {to_mlx[k]: v for k, v in tensors.items()}
    missing = sorted(n for n in names if n not in renamed
                     and not (n == "lm_head.weight" and config["tie_word_embeddings"]))
    if missing:
        raise ValueError(f"{path} is missing tensors: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return renamed


def _unpermute_qk(tensors: dict[str, mx.array], config: dict[str, Any]) -> None:
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, w in list(tensors.items()):
        match = re.search(r"self_attn\.([qk]_proj)\.", name)
        if match is None:
            continue
        n = heads[match.group(1)]
        rows = w.shape[0]
        tensors[name] = (w.reshape(n, rows // n // 2, 2, *w.shape[1:]).swapaxes(1, 2)
                         .reshape(w.shape))


def _bits(path: Path, name: str, w: mx.array, scales: mx.array) -> int:
    in_features = scales.shape[-1] * GROUP_SIZE
    bits = w.shape[-1] * 32 // in_features
    if bits not in _MLX_BITS or bits * in_features != w.shape[-1] * 32:
        raise ValueError(f"{path}: tensor {name} has a packed width ({w.shape[-1]} words for "
                         f"{in_features} columns) that is no MLX quantization")
    return bits


def _cast(path: Path, tensors: dict[str, mx.array],
          dtype: str) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Dequantize and cast to ``dtype``, or keep the quantized layers (``keep``)."""
    out: dict[str, mx.array] = {}
    layer_bits: dict[str, int] = {}
    quantized = any(name.endswith(".scales") for name in tensors)
    # keep: the float tensors (norms) follow the float16 scales, so the whole model computes
    # (and caches K/V) in float16, like mlx-lm's own quantized models.
    plain = getattr(mx, dtype) if dtype != "keep" else mx.float16 if quantized else None
    for name, w in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" not in tensors:
            out[name] = w if plain is None else w.astype(plain)
            continue
        scales, biases = tensors[f"{stem}.scales"], tensors[f"{stem}.biases"]
        bits = _bits(path, name, w, scales)
        if dtype == "keep":
            out.update({name: w, f"{stem}.scales": scales, f"{stem}.biases": biases})
            layer_bits[stem] = bits
        else:
            # In float32: dequantizing with the float16 scales would round every weight to
            # float16 (errors of 1e-4 against ggml's own dequantization).
            full = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                 group_size=GROUP_SIZE, bits=bits)
            out[name] = full.astype(getattr(mx, dtype))
    if not layer_bits:
        return out, None
    # mlx-lm's layout: one default, and a per-layer entry for layers that differ from it
    # (SmolLM2's Q4_1 file has 4-bit layers and an 8-bit embedding).
    common = max(set(layer_bits.values()), key=list(layer_bits.values()).count)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    for stem, bits in sorted(layer_bits.items()):
        if bits != common:
            quantization[stem] = {"group_size": GROUP_SIZE, "bits": bits}
    return out, quantization


def _tokenizer(path: Path, meta: dict[str, Any], config: dict[str, Any]):
    """A Hugging Face fast tokenizer built by transformers from ``tokenizer.ggml.*``."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path} has no tokenizer (no tokenizer.ggml.tokens in its metadata)")
    grouped = {group: {name: _plain(meta[f"tokenizer.{key}"]) for key, name in renames.items()
                       if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    try:
        backend, _ = convert_gguf_tokenizer(config["model_type"], tokenizer_dict)
    except ValueError as exc:
        raise ValueError(f"{path}: cannot build its tokenizer: {exc}") from None
    split = _PRE_TOKENIZERS.get(tokenizer_dict.get("pre_tokenizer_type"))
    if split is not None:
        backend.pre_tokenizer = split(pre_tokenizers)
    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        if key in tokenizer_dict:
            tokenizer_config[name] = tokens[tokenizer_dict[key]]
    tokenizer_config.pop("add_prefix_space", None)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


def _plain(value: Any) -> Any:
    """An mx metadata value as plain Python (ints, floats, bools, strings, lists)."""
    if isinstance(value, mx.array):
        return value.tolist() if value.ndim else value.item()
    return value


# Pre-tokenizers for ``tokenizer.ggml.pre`` values transformers' table does not know.
# "smollm" (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM): each digit alone, then GPT-2's split,
# which is what SmolLM2's own tokenizer.json does.
_PRE_TOKENIZERS = {
    "smollm": lambda pt: pt.Sequence([
        pt.Digits(individual_digits=True),
        pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]),
}
