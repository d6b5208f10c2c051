"""Blocks between workers: what a holder sends of its store, and what a receiver checks and
keeps of what arrives (``cluster.backend.pull`` carries the bytes).

A block travels in the disk tier's file format (``workers.cache.disk_files``): its header says
its hash, identity (namespace, parent, position, token ids), model, weights revision, K/V
bits and every array's dtype and shape, and an XXH3-128 digest covers it all, so one block is
one self-checking frame::

    holder (engine thread)                          receiver (engine thread)
    ──────────────────────                          ────────────────────────
    serve(ns, tokens, start, stop)                  begin(ns, tokens, blocks) ─► start, or
      memory or disk, each verified ─► bytes          PullRefused (no room, no store)
                                   ────── frames ──► adopt(ns, tokens, index, frames):
                                                      digest, model, revision, hash, identity
                                                      and token ids, dtype and shape: each
                                                      block checked, stored in order; the
                                                      first bad one ends the pull (Adopted)

Nothing is trusted because a peer sent it: the receiver computes the prompt's chain itself
(its own hasher, its own secret) and keeps a block only where the block's record equals the
block the receiver expects there. A refusal (``PullRefused`` from ``begin``, ``Adopted.refused``
from ``adopt``) names what was wrong; the caller computes the blocks itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Sequence

import mlx.core as mx

from router.kv.key import ChainIdentities, Hasher, Namespace
from workers.cache.blocks import KVShape, StoredBlock
from workers.cache.disk_files import BlockRecord, CorruptBlock, decode_block, encode_block
from workers.cache.kv_quant import KVCodec
from workers.cache.store import PrefixStore

_IN_TRANSIT = PurePath("<in transit>")   # named in a corrupt block's message


class PullRefused(ValueError):
    """A pull (or one block of it) that the receiver will not take; the message says why."""


@dataclass(frozen=True, slots=True)
class PullStart:
    """Where a pull starts: the receiver's memory holds blocks before ``start`` already."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Adopted:
    """What a receiver kept of a window: blocks stored, and why it stopped ("": all kept)."""

    stored: int
    refused: str = ""


class BlockTransfer:
    """One store's side of a transfer, either way (the engine thread only)."""

    def __init__(self, store: PrefixStore, model: str, revision: str, hasher: Hasher,
                 enabled: bool) -> None:
        self._store = store
        self._model = model
        self._revision = revision
        self._hash = hasher
        self._enabled = enabled

    @property
    def block_size(self) -> int:
        return self._store.block_size

    # ---- the holder ------------------------------------------------------------------------

    def serve(self, namespace: Namespace, tokens: Sequence[int], start: int, stop: int
              ) -> list[bytes]:
        """Blocks ``start`` to ``stop`` of ``tokens``' chain as frames, up to the first this
        store lacks (fewer than asked: the receiver computes the rest)."""
        if not self._enabled:
            return []
        hashes = self._hash(tokens[:stop * self.block_size], self.block_size, namespace)
        frames = []
        for i, (block, codec) in enumerate(self._store.served(namespace, tokens, start, stop),
                                           start=start):
            record = BlockRecord(hashes[i], block.identity, self._model, self._revision,
                                 codec.bits)
            mx.eval(block.keys, block.values)
            frames.append(encode_block(record, block.keys, block.values))
        return frames

    # ---- the receiver ----------------------------------------------------------------------

    def begin(self, namespace: Namespace, tokens: Sequence[int], blocks: int) -> PullStart:
        """The blocks to ask for to hold ``tokens``' first ``blocks``: those from the first
        one memory lacks. ``PullRefused`` when they cannot all be kept here."""
        if not self._enabled:
            raise PullRefused("this worker keeps no prefix store (use_store is off)")
        hashes = self._hash(tokens[:blocks * self.block_size], self.block_size, namespace)
        start = self._store.ledger.peek(hashes)
        ledger = self._store.ledger
        need = (len(hashes) - start) * self.block_size * ledger.bytes_per_token
        if need > ledger.capacity_bytes:
            raise PullRefused(f"no room: {len(hashes) - start} blocks take {need} bytes, this "
                              f"worker's memory tier holds {ledger.capacity_bytes}")
        return PullStart(start, len(hashes))

    def adopt(self, namespace: Namespace, tokens: Sequence[int], index: int,
              frames: Sequence[bytes]) -> Adopted:
        """Check ``frames`` (blocks ``index`` on) and store them in order, up to the first
        bad one (the ones before it are kept)."""
        bs = self.block_size
        hashes = self._hash(tokens[:(index + len(frames)) * bs], bs, namespace)
        if len(hashes) < index + len(frames):
            return Adopted(0, f"{index + len(frames)} blocks sent for a prompt of "
                              f"{len(hashes)} full blocks")
        want = ChainIdentities(namespace, hashes, tokens, bs)
        good: list[StoredBlock] = []
        refused = ""
        for i, data in enumerate(frames, start=index):
            try:
                good.append(self._checked(data, hashes[i], want[i]))
            except PullRefused as exc:
                refused = f"block {i}: {exc}"
                break
        stored = self._store.adopt(namespace, hashes, index, good, self._codec) if good else 0
        if stored < len(good):
            refused = (f"no room: memory kept {stored} of {len(good)} blocks sent; blocks "
                       f"{index + stored} to {index + len(good) - 1} were dropped")
        return Adopted(stored, refused)

    @property
    def _codec(self) -> KVCodec:
        return KVCodec(0, self._store.shape.dtype)

    def _checked(self, data: bytes, block, identity) -> StoredBlock:
        """The block in ``data`` decoded to the model's dtype, if it is the block expected."""
        try:
            arrived = decode_block(data, _IN_TRANSIT)
        except CorruptBlock as exc:
            raise PullRefused(f"corrupted in transit ({exc})") from None
        record = arrived.record
        if (record.model, record.revision) != (self._model, self._revision):
            raise PullRefused(f"a block of model {record.model!r} revision "
                              f"{record.revision!r}; this worker serves {self._model!r} "
                              f"revision {self._revision!r}")
        if record.identity.tokens != identity.tokens:
            raise PullRefused("its token ids are not the prompt's")
        if record.block != block or record.identity != identity:
            raise PullRefused(f"its hash or identity is not the prompt's block {block:032x}")
        try:
            codec = KVCodec(record.bits, self._store.shape.dtype)
            keys, values = codec.decode(arrived.keys), codec.decode(arrived.values)
        except (ValueError, TypeError) as exc:
            raise PullRefused(f"undecodable K/V ({exc})") from None
        _check_geometry(keys, values, self._store.shape, self.block_size)
        return StoredBlock(identity, (keys,), (values,))


def _check_geometry(keys: mx.array, values: mx.array, shape: KVShape, block_size: int) -> None:
    want = (shape.layers, shape.kv_heads, block_size, shape.head_dim)
    for name, a in (("keys", keys), ("values", values)):
        if a.dtype != shape.dtype:
            raise PullRefused(f"{name} of dtype {a.dtype}; this worker's K/V is {shape.dtype}")
        if tuple(a.shape) != want:
            raise PullRefused(f"{name} of shape {tuple(a.shape)}; this worker's blocks are "
                              f"{want}")
