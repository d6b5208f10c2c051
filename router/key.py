"""The cache key: chained 64-bit block hashes, shared by the router, the workers and the cluster.

A prompt is split into full blocks of ``block_size`` tokens. Each block's hash covers its
parent's hash and its own token ids, so equal hashes mean equal prefixes::

    namespace ──► root
                   │
    tokens  [ b0 ][ b1 ][ b2 ][ tail ]      (the partial tail is never hashed)
              │     │     │
    hashes   h0 ◄─ h1 ◄─ h2                 h(i) = P·h(i-1) + D(tokens(i))   (mod 2**64)

``D`` digests one block's tokens: each pair of token ids, read as one 64-bit word, is
multiplied and xor-shifted, the words are summed with a fixed odd weight per position (so
two swapped ids give different values), and the sum, with the block's length, is multiplied
and xor-shifted again. ``P`` is an odd 64-bit constant.

Why this form: the chain is linear in the parent, so a whole prompt's chain is a prefix sum
that NumPy computes without a Python call per block::

    h(i) = P^(i+1)·root + Σ_{j<=i} P^(i-j)·D(j) = P^i · (P·root + Σ_{j<=i} D(j)·P^-j)

(``P`` is odd, so ``P^-1`` exists mod 2**64): digests of every block at once, one
``cumsum``, one multiply. An 8k-token prompt at block 16 (512 blocks) costs tens of
microseconds instead of a digest call per block.

The namespace (tenant, model id and weights revision, adapter) is folded into the root, so
nothing crosses a namespace: the same tokens under two roots ``r != r'`` differ at every
block by ``P^(i+1)·(r - r')``, never 0 mod 2**64 because ``P`` is odd.

The hash is not cryptographic and need not be: a hit is always checked against the block's
stored token ids (``workers.store``), so a collision costs a miss, never a wrong answer. It
is stable across processes, machines and ``PYTHONHASHSEED`` (Python's ``hash()`` is never
used; every constant is fixed below).
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)

_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # the chain's multiplier (odd: invertible mod 2**64)
_P_INV = pow(_P, -1, 1 << 64)
_MIX = np.uint64(0xFF51AFD7ED558CCD)   # per-word multiplier (murmur3's fmix64 constants)
_FOLD = np.uint64(0xC4CEB9FE1A85EC53)  # per-block finalizer multiplier
_SHIFT = np.uint64(29)
_NATIVE_U32 = ("I", "L", "=I", "<I", "@I")  # buffer formats read as uint32
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that changes what cached K/V mean or who may read them."""

    tenant: str
    model: str
    revision: str = ""
    adapter: str = ""

    def __post_init__(self) -> None:
        # The root joins the fields with NUL: a NUL inside a field would let two namespaces
        # share a root (tenant "a\0b" + model "c" against tenant "a" + model "b\0c").
        fields = {"tenant": self.tenant, "model": self.model, "revision": self.revision,
                  "adapter": self.adapter}
        for name, value in fields.items():
            if "\x00" in value:
                raise ValueError(f"namespace {name} {value!r} contains a NUL character; "
                                 "remove it")

    def root(self) -> BlockHash:
        """The parent hash of a prompt's first block."""
        fields = (self.tenant, self.model, self.revision, self.adapter)
        encoded = b"\x00".join(f.encode("utf-8") for f in fields)
        return BlockHash(xxhash.xxh3_64_intdigest(b"orchard-ns\x00" + encoded))

    def label(self) -> str:
        """A short human-readable form for logs and traces."""
        parts = [self.tenant, self.model]
        if self.revision:
            parts.append(self.revision)
        if self.adapter:
            parts.append(self.adapter)
        return "/".join(parts)


def _token_array(token_ids: Sequence[int] | memoryview) -> np.ndarray:
    """The prompt as one contiguous uint32 array.

    A buffer that already is one (``array('I')``, a contiguous NumPy ``uint32`` array, a
    ``memoryview`` of either) is read in place; anything else (a list) is converted item by
    item, which costs more than hashing an 8k-token prompt: callers on a hot path should keep
    their token ids in a buffer.
    """
    if not isinstance(token_ids, (list, tuple, range)):
        try:
            view = memoryview(token_ids)  # type: ignore[arg-type]
        except TypeError:
            view = None
        if (view is not None and view.format in _NATIVE_U32 and view.itemsize == 4
                and view.c_contiguous and _LITTLE_ENDIAN):
            return np.frombuffer(view.cast("B"), dtype=np.uint32)
    try:
        return np.frombuffer(array("I", token_ids), dtype=np.uint32)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None


class _Tables:
    """Constants that grow with the block size and the prompt: word weights, P's powers."""

    def __init__(self) -> None:
        self.weights = np.zeros(0, dtype=np.uint64)
        self.powers = np.ones(1, dtype=np.uint64)       # P^i
        self.inverses = np.ones(1, dtype=np.uint64)     # P^-i

    def word_weights(self, words: int) -> np.ndarray:
        if len(self.weights) < words:
            # splitmix64 of the position, made odd: fixed, distinct, well spread
            z = np.arange(1, words + 1, dtype=np.uint64) * np.uint64(_P)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            self.weights = (z ^ (z >> np.uint64(31))) | np.uint64(1)
        return self.weights[:words]

    def chain_powers(self, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        while len(self.powers) < blocks:  # doubling: P^(n+i) = P^i · P^n, vectorized
            # P^n = P^(n-1) · P: the table's last entry times P, wrapping mod 2**64
            step, back = self.powers[-1:] * np.uint64(_P), self.inverses[-1:] * np.uint64(_P_INV)
            self.powers = np.concatenate([self.powers, self.powers * step])
            self.inverses = np.concatenate([self.inverses, self.inverses * back])
        return self.powers[:blocks], self.inverses[:blocks]


_TABLES = _Tables()


def _digests(blocks: np.ndarray) -> np.ndarray:
    """``D`` of every row of ``blocks`` (uint32, one block per row), as uint64.

    Two tokens make one little-endian 64-bit word (an odd-sized block is padded with a zero
    id; its length, mixed in at the end, keeps ``[x]`` apart from ``[x, 0]``).
    """
    size = blocks.shape[1]
    if size % 2:
        padded = np.zeros((blocks.shape[0], size + 1), dtype="<u4")
        padded[:, :size] = blocks
        blocks = padded
    words = np.ascontiguousarray(blocks, dtype="<u4").view("<u8")
    x = words * _MIX
    x ^= x >> _SHIFT
    d = x @ _TABLES.word_weights(words.shape[1])
    d += np.uint64(size * _P & _MASK)
    d *= _FOLD
    d ^= d >> _SHIFT
    return d


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one block from its parent's hash and its token ids. Pure and stable."""
    tokens = _token_array(token_ids)
    digest = int(_digests(tokens.reshape(1, len(tokens)))[0]) if len(tokens) else 0
    return BlockHash((_P * parent + digest) & _MASK)


def hash_blocks(
    token_ids: Sequence[int] | memoryview, block_size: int, namespace: Namespace
) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids`` under ``namespace``.

    ``token_ids`` is a sequence of ints or, faster, a buffer of uint32 (see ``_token_array``).
    Exactly ``block_hash`` applied block after block, computed for all blocks at once.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = _token_array(token_ids)
    count = len(tokens) // block_size
    if count == 0:
        return []
    d = _digests(tokens[: count * block_size].reshape(count, block_size))
    powers, inverses = _TABLES.chain_powers(count)
    d *= inverses
    chain = np.cumsum(d, dtype=np.uint64)
    chain += np.uint64(_P * namespace.root() & _MASK)
    chain *= powers
    return chain.tolist()


def reusable_tokens(prompt_len: int, matched_blocks: int, block_size: int) -> int:
    """Tokens a lookup may take from cache: matched full blocks, never the whole prompt.

    At least one token is always left to compute, so a prompt that is an exact multiple of
    the block size and fully cached still reuses at most ``prompt_len - 1`` tokens (the
    engine then reuses the last block partially).
    """
    return max(0, min(matched_blocks * block_size, prompt_len - 1))
