"""The cache key: chained, keyed 128-bit block hashes, shared by the router, the workers and
the cluster.

A prompt is split into full blocks of ``block_size`` tokens. Each block's hash covers its
parent's hash and its own token ids, so equal hashes mean equal prefixes under one root::

    cluster secret, namespace ──► root = BLAKE2b-128(key=secret, "orchard-ns" | fields)
                                   │
    tokens   [ b0 ][ b1 ][ b2 ][ tail ]     (the partial tail is never hashed)
               │     │     │
    hashes    h0 ◄─ h1 ◄─ h2                h(i) = XXH3-128(h(i-1) | tokens(i))

``h(i-1)`` enters as its 16 little-endian bytes, the block's ids as little-endian uint32.

Who can compute a hash: only a holder of the cluster's secret (``CacheSecret``: 32 random
bytes made at the first ``orchard up``, kept 0600 in the run directory and handed to the
workers with their engine configuration). The root is a keyed BLAKE2b of the namespace, a
pseudo-random function: without the secret nobody can tell one tenant's root from random,
and every block hash inherits that 128-bit unknown state. An earlier key chained a 64-bit
hash that was linear in its parent, with an invertible digest: from public facts alone a
tenant could build a block whose chain landed on another tenant's root. Here there is no
public state to aim at, and a chance collision needs about 2**64 blocks.

Why XXH3-128 for the chain rather than BLAKE2b throughout: an 8k-token prompt at block 16 is
512 blocks, and the router hashes every prompt on its decision path. One XXH3 call on 80
bytes costs about 70 ns; a keyed BLAKE2b call about 700 ns (0.38 ms a prompt, more than the
whole routing decision). The chain of an 8k-token prompt at block 16 takes 69 us here, above
the 60 us aimed at: 512 sequential C calls and 512 int conversions are what it costs in Python. The per-block bytes are cut in one NumPy pass; only the chaining,
one C call per block, is sequential. XXH3 alone is not a cryptographic hash, which is why the
secret sits in the root (an attacker never sees the chain's input state) and why a hash is
never trusted on its own: every hit verifies the block's identity (``BlockIdentity``: its
namespace, parent, position and token ids) against what the lookup expects, in the memory
tier, the disk tier and the engine's kept caches, so a collision costs a miss, never another
tenant's K/V. The threat model is in ``docs/design-notes.md``.

The namespace (tenant, model id and weights revision, adapter) is folded into the root, so
nothing crosses a namespace. Hashes are stable across processes, machines and
``PYTHONHASHSEED`` for one secret (Python's ``hash()`` is never used).
"""
from __future__ import annotations

import hashlib
import os
import sys
from array import array
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Callable, NewType, Sequence
from urllib.parse import quote

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)

SECRET_BYTES = 32
MAX_SALT_BYTES = 256
HASH_BYTES = 16
_NATIVE_U32 = ("I", "L", "=I", "<I", "@I")  # buffer formats read as uint32
_LITTLE_ENDIAN = sys.byteorder == "little"
_XXH3_128 = xxhash.xxh3_128_digest


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that changes what cached K/V mean or who may read them.

    ``secret`` is the cluster's cache-key secret (empty: unkeyed, for tools that hash their
    own traces); it enters the root and never a label, a log line or a repr.

    ``salt`` is a request's ``cache_salt`` (vLLM's name): it enters the root beside the tenant,
    so requests of one tenant with different salts never share a block (users behind one key
    with different document permissions). Like the secret it is never in a label or a repr;
    an empty salt leaves the root as it was.
    """

    tenant: str
    model: str
    revision: str = ""
    adapter: str = ""
    secret: bytes = field(default=b"", repr=False)
    salt: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        # The root joins the fields with NUL: a NUL inside a field would let two namespaces
        # share a root (tenant "a\0b" + model "c" against tenant "a" + model "b\0c").
        fields = {"tenant": self.tenant, "model": self.model, "revision": self.revision,
                  "adapter": self.adapter}
        for name, value in fields.items():
            if "\x00" in value:
                raise ValueError(f"namespace {name} {value!r} contains a NUL character; "
                                 "remove it")
        if len(self.salt.encode("utf-8")) > MAX_SALT_BYTES:
            raise ValueError(f"a cache salt is at most {MAX_SALT_BYTES} bytes, got "
                             f"{len(self.salt.encode('utf-8'))}")
        if len(self.secret) > 64:
            raise ValueError(f"a cache secret is at most 64 bytes, got {len(self.secret)}")

    def root(self) -> BlockHash:
        """The parent hash of a prompt's first block."""
        fields = (self.tenant, self.model, self.revision, self.adapter)
        encoded = b"\x00".join(f.encode("utf-8") for f in fields)
        if self.salt:  # last, behind its own tag: no field can end where a salt begins
            encoded += b"\x00salt\x00" + self.salt.encode("utf-8")
        digest = hashlib.blake2b(b"orchard-ns\x00" + encoded, key=self.secret,
                                 digest_size=HASH_BYTES).digest()
        return BlockHash(int.from_bytes(digest, "little"))

    def label(self) -> str:
        """A short human-readable form for logs, traces and the ledgers' namespace counts.

        One label is one namespace: a ``/`` or ``%`` inside a field is percent-escaped, so
        tenant ``a/b`` of model ``c`` never shares a label with tenant ``a`` of model ``b/c``.
        """
        parts = [self.tenant, self.model]
        if self.revision:
            parts.append(self.revision)
        if self.adapter:
            parts.append(self.adapter)
        return "/".join(quote(p, safe="") if ("/" in p or "%" in p) else p for p in parts)


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """What a block's hash stands for. A cached block is served only where all four equal
    what the lookup expects: a hash alone is never trusted."""

    namespace: str            # the namespace's label
    parent: BlockHash         # the previous block's hash, or the namespace's root
    position: int             # the block's index in its chain (0: the first block)
    tokens: tuple[int, ...]


class ChainIdentities:
    """The identities of a chain's blocks over ``tokens``, each made when asked: a write that
    stores only a long prompt's last blocks builds only theirs."""

    def __init__(self, namespace: Namespace, hashes: Sequence[BlockHash],
                 tokens: Sequence[int], block_size: int) -> None:
        self._label, self._root = namespace.label(), namespace.root()
        self._hashes, self._tokens, self._bs = hashes, tokens, block_size

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, i: int) -> BlockIdentity:
        bs = self._bs
        return BlockIdentity(self._label, self._hashes[i - 1] if i else self._root, i,
                             tuple(self._tokens[i * bs:(i + 1) * bs]))


def identities(namespace: Namespace, hashes: Sequence[BlockHash], tokens: Sequence[int],
               block_size: int, start: int = 0, stop: int | None = None
               ) -> list[BlockIdentity]:
    """The identities of blocks ``start`` to ``stop`` of a chain over ``tokens``."""
    chain = ChainIdentities(namespace, hashes, tokens, block_size)
    return [chain[i] for i in range(start, len(hashes) if stop is None else stop)]


class CacheSecret:
    """The cluster's cache-key secret in a run directory: made once, then read."""

    NAME = "cache.key"

    @classmethod
    def load_or_create(cls, run_dir: Path | str) -> bytes:
        """The secret of ``run_dir`` (``cache.key``, mode 0600), made at first use."""
        path = Path(run_dir) / cls.NAME
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return cls._read(path)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(SECRET_BYTES))
        return cls._read(path)

    @staticmethod
    def _read(path: Path) -> bytes:
        if path.stat().st_mode & 0o077:
            raise ValueError(f"{path} is readable by others (mode "
                             f"{path.stat().st_mode & 0o777:o}): chmod 600 it")
        secret = path.read_bytes()
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"{path} holds {len(secret)} bytes, not a {SECRET_BYTES}-byte "
                             "cache secret: delete it to make a new one (the cache restarts "
                             "cold)")
        return secret


def _token_array(token_ids: Sequence[int] | memoryview) -> np.ndarray:
    """The prompt as one contiguous little-endian uint32 array.

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
            return np.frombuffer(view.cast("B"), dtype="<u4")
    try:
        return np.frombuffer(array("I", token_ids), dtype=np.uint32).astype("<u4", copy=False)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None


def _chain(parent: BlockHash, blocks: list[bytes]) -> list[BlockHash]:
    """``h(i) = XXH3-128(h(i-1) | block i)`` over ``blocks``, from ``parent``."""
    p = parent.to_bytes(HASH_BYTES, "little")
    digest = _XXH3_128
    chain = [p := digest(p + b) for b in blocks]  # a comprehension: no call per append
    return list(map(int.from_bytes, chain, repeat("little")))


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one block from its parent's hash and its token ids. Pure and stable."""
    return _chain(parent, [_token_array(token_ids).tobytes()])[0]


def hash_blocks(
    token_ids: Sequence[int] | memoryview, block_size: int, namespace: Namespace
) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids`` under ``namespace``.

    ``token_ids`` is a sequence of ints or, faster, a buffer of uint32 (see ``_token_array``).
    Exactly ``block_hash`` applied block after block: the blocks' bytes are cut in one pass
    (a ``(blocks, 4 * block_size)`` byte view), then chained.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = _token_array(token_ids)
    count = len(tokens) // block_size
    if count == 0:
        return []
    rows = np.ascontiguousarray(tokens[: count * block_size]).view(np.dtype(f"V{4 * block_size}"))
    return _chain(namespace.root(), rows.tolist())


Hasher = Callable[[Sequence[int], int, Namespace], list[BlockHash]]
"""How a store computes a prompt's chain: ``hash_blocks``, or in tests a double that collides
on purpose (the identity checks, not the hash, must keep tenants apart)."""


def reusable_tokens(prompt_len: int, matched_blocks: int, block_size: int) -> int:
    """Tokens a lookup may take from cache: matched full blocks, never the whole prompt.

    At least one token is always left to compute, so a prompt that is an exact multiple of
    the block size and fully cached still reuses at most ``prompt_len - 1`` tokens (the
    engine then reuses the last block partially).
    """
    return max(0, min(matched_blocks * block_size, prompt_len - 1))
