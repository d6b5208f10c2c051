"""The cache key: chained 128-bit block hashes, shared by the router, the workers and the cluster.

A prompt is split into full blocks of ``block_size`` tokens. Each block's hash covers its
parent's hash and its own token ids, so equal hashes mean equal prefixes::

    namespace ──► root
                   │
    tokens  [ b0 ][ b1 ][ b2 ][ tail ]      (the partial tail is never hashed)
              │     │     │
    hashes   h0 ◄─ h1 ◄─ h2                 h(i) = xxh3_128(h(i-1) ‖ tokens(i))

The namespace (tenant, model id and weights revision, adapter) is folded into the root, so
nothing crosses a namespace: the same tokens under two tenants never share a hash.

The hash is ``xxh3_128`` over fixed-width little-endian bytes: stable across processes,
machines and ``PYTHONHASHSEED`` (Python's ``hash()`` is never used).
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import NewType, Sequence

import xxhash

BlockHash = NewType("BlockHash", int)

_HASH_BYTES = 16
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
        return BlockHash(xxhash.xxh3_128_intdigest(b"orchard-ns\x00" + encoded))

    def label(self) -> str:
        """A short human-readable form for logs and traces."""
        parts = [self.tenant, self.model]
        if self.revision:
            parts.append(self.revision)
        if self.adapter:
            parts.append(self.adapter)
        return "/".join(parts)


def _token_bytes(token_ids: Sequence[int] | memoryview) -> bytes:
    """The prompt as one contiguous run of little-endian uint32s.

    A buffer that already is one (``array('I')``, a contiguous NumPy ``uint32`` array, a
    ``memoryview`` of either) is copied in one go; anything else (a list) is converted item
    by item, which costs more than hashing an 8k-token prompt: callers on a hot path should
    keep their token ids in a buffer.
    """
    if not isinstance(token_ids, (list, tuple, range)):
        try:
            view = memoryview(token_ids)  # type: ignore[arg-type]
        except TypeError:
            view = None
        if (view is not None and view.format in _NATIVE_U32 and view.itemsize == 4
                and view.c_contiguous and _LITTLE_ENDIAN):
            return view.cast("B").tobytes()
    try:
        return array("I", token_ids).tobytes()
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one block from its parent's hash and its token ids. Pure and stable."""
    data = parent.to_bytes(_HASH_BYTES, "little") + _token_bytes(token_ids)
    return BlockHash(xxhash.xxh3_128_intdigest(data))


def hash_blocks(
    token_ids: Sequence[int] | memoryview, block_size: int, namespace: Namespace
) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids`` under ``namespace``.

    ``token_ids`` is a sequence of ints or, faster, a buffer of uint32 (see ``_token_bytes``).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = _token_bytes(token_ids)
    width = block_size * 4
    hashes: list[BlockHash] = []
    parent: int = namespace.root()
    digest = xxhash.xxh3_128_intdigest
    append = hashes.append
    # One buffer, sliced per block: the per-block work is one slice, one concatenation and
    # one digest. BlockHash is a NewType (the identity at run time): not calling it per block
    # keeps the values exactly ``block_hash``'s at one digest per block.
    for start in range(0, len(raw) - width + 1, width):
        parent = digest(parent.to_bytes(_HASH_BYTES, "little") + raw[start : start + width])
        append(parent)  # type: ignore[arg-type]
    return hashes


def reusable_tokens(prompt_len: int, matched_blocks: int, block_size: int) -> int:
    """Tokens a lookup may take from cache: matched full blocks, never the whole prompt.

    At least one token is always left to compute, so a prompt that is an exact multiple of
    the block size and fully cached still reuses at most ``prompt_len - 1`` tokens (the
    engine then reuses the last block partially).
    """
    return max(0, min(matched_blocks * block_size, prompt_len - 1))
