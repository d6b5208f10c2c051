"""How a tier holds a block's K/V: at the model's precision, or quantized to 8 or 4 bits.

A ``KVCodec`` turns one block's keys (or values), ``[layers, kv_heads, block_size, head_dim]``,
into the arrays a tier keeps, and back. Quantization is MLX's affine ``mx.quantize`` over
groups of ``GROUP_SIZE = 64`` elements along ``head_dim`` (the group size mlx-lm's quantized
K/V cache uses); each group carries a scale and a bias, kept as float16::

    bits = 0   data    [L, H, B, D]        model dtype (float32 here: 4 bytes/element)
    bits = 8   packed  [L, H, B, D/4]      uint32 (4 elements per word)
               scales  [L, H, B, D/64]     float16
               biases  [L, H, B, D/64]     float16

so one element costs ``bits/8 + 2 x 2/64`` bytes: with D = 64 that is 68 bytes per head and
token at 8 bits (0.27x of float32, 0.53x of float16) and 36 at 4 bits (0.14x / 0.28x).
Scales and biases are float16 because float32 ones would cost 4 of the 36 bytes more (11%)
and the per-group range they encode needs no more than float16's precision.

A tier decodes on load: the engine always extends a plain ``KVCache`` in the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

GROUP_SIZE = 64
KV_BITS = (0, 8, 4)  # 0: unquantized, at the model's dtype
_SCALE_DTYPE = mx.float16


@dataclass(frozen=True, slots=True)
class KVCodec:
    """Encode/decode one tier's K/V at ``bits`` (0, 8 or 4) for a model of dtype ``dtype``."""

    bits: int
    dtype: mx.Dtype

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"kv bits must be one of {', '.join(map(str, KV_BITS))} "
                             f"(0 keeps the model's precision), got {self.bits}")

    def check(self, head_dim: int) -> None:
        """``ValueError`` when this model's heads cannot be quantized in groups of 64."""
        if self.bits and head_dim % GROUP_SIZE:
            raise ValueError(
                f"{self.bits}-bit K/V needs head_dim divisible by {GROUP_SIZE}, this model has "
                f"head_dim {head_dim}: set the tier's kv bits to 0")

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int) -> int:
        """What one cached token costs in this tier, scales and biases included."""
        if not self.bits:
            per_head = head_dim * self.dtype.size
        else:
            per_head = head_dim * self.bits // 8 + 2 * _SCALE_DTYPE.size * head_dim // GROUP_SIZE
        return 2 * layers * kv_heads * per_head

    def encode(self, x: mx.array) -> tuple[mx.array, ...]:
        """The arrays a tier keeps for ``x`` (lazy: the caller evaluates them)."""
        if not self.bits:
            return (x,)
        packed, scales, biases = mx.quantize(x, group_size=GROUP_SIZE, bits=self.bits)
        return packed, scales.astype(_SCALE_DTYPE), biases.astype(_SCALE_DTYPE)

    def decode(self, parts: tuple[mx.array, ...]) -> mx.array:
        """``x`` again (exactly when unquantized), in the model's dtype."""
        if not self.bits:
            return parts[0]
        packed, scales, biases = parts
        return mx.dequantize(packed, scales.astype(self.dtype), biases.astype(self.dtype),
                             group_size=GROUP_SIZE, bits=self.bits)

    def recode(self, parts: tuple[mx.array, ...], held_in: KVCodec) -> tuple[mx.array, ...]:
        """``parts``, held in ``held_in``, as this codec holds them (lazy; the very same parts
        when the two codecs agree)."""
        return parts if held_in == self else self.encode(held_in.decode(parts))

    def label(self) -> str:
        return f"{self.bits}-bit" if self.bits else str(self.dtype).removeprefix("mlx.core.")


def nbytes(parts: tuple[mx.array, ...]) -> int:
    return sum(p.nbytes for p in parts)
