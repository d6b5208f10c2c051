"""The on-disk form of one K/V block: a self-describing, checksummed file.

One file per block, named by its hash (``ab/ab12....kv``: 256 subdirectories keep directory
listings short at millions of blocks)::

    "ORKV" | version u16 | header length u32 | header (msgpack) | payload | xxh3_128 (16 bytes)

    header:  block hash, parent hash, namespace label, position in its chain, model id,
             weights revision, token ids, kv bits, and each array's dtype and shape (keys'
             parts, then values')
    payload: the arrays' bytes, in that order

The digest covers everything before it, so a torn write (a kill -9 or a power cut between
``write`` and the rename) and flipped bits both fail ``decode_block``. A file is written to
``<name>.tmp`` and renamed into place, so a complete name normally means a complete file;
``read_header`` also checks the file's size against the header, which catches a truncated file
at restart without reading its payload. Decoding rebuilds ``mx.array``s from the payload.

Version 2 records the block's whole identity (namespace, parent, position, tokens), which a
load checks against what the lookup expects; a version 1 file (no position, written under the
old 64-bit key) is ``OutdatedBlock``: dropped at start and counted, never misread.
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from router.kv.key import BlockHash, BlockIdentity

MAGIC = b"ORKV"
VERSION = 2
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_DIGEST = 16
# mx dtype name -> (numpy dtype of its bytes, mx dtype to view them as)
_DTYPES = {
    "float32": (np.float32, None), "float16": (np.float16, None), "uint32": (np.uint32, None),
    "bfloat16": (np.uint16, mx.bfloat16),
}


class CorruptBlock(ValueError):
    """A block file that cannot be trusted: torn, truncated, flipped or not a block at all."""


class OutdatedBlock(CorruptBlock):
    """A block file of an older format version: never read, dropped."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What a block file says about itself (its header)."""

    block: BlockHash
    identity: BlockIdentity
    model: str
    revision: str
    bits: int

    @property
    def parent(self) -> BlockHash:
        return self.identity.parent

    @property
    def namespace(self) -> str:
        return self.identity.namespace

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.identity.tokens


@dataclass(frozen=True, slots=True)
class BlockData:
    record: BlockRecord
    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]


def block_path(directory: Path, block: BlockHash) -> Path:
    name = f"{block:032x}"
    return directory / name[:2] / (name + SUFFIX)


def encode_block(record: BlockRecord, keys: tuple[mx.array, ...],
                 values: tuple[mx.array, ...]) -> bytes:
    """The file's bytes for one block (its arrays must already be evaluated)."""
    out = io.BytesIO()
    write_block(out, record, keys, values)
    return out.getvalue()


def write_block(f: BinaryIO, record: BlockRecord, keys: tuple[mx.array, ...],
                values: tuple[mx.array, ...]) -> int:
    """Write one block's file to ``f``; return its size. The arrays' bytes go from their own
    buffers to the file (no joined copy): the digest is taken as they go."""
    arrays = [*keys, *values]
    specs = [[_dtype_name(a), list(a.shape)] for a in arrays]
    header = msgpack.packb([
        record.block.to_bytes(16, "little"), record.parent.to_bytes(16, "little"),
        record.namespace, record.identity.position, record.model, record.revision,
        list(record.tokens), record.bits, len(keys), specs], use_bin_type=True)
    digest = xxhash.xxh3_128()
    size = 0
    for part in [_PREFIX.pack(MAGIC, VERSION, len(header)), header, *map(_raw, arrays)]:
        digest.update(part)
        size += f.write(part)
    return size + f.write(digest.digest())


def read_header(path: Path) -> BlockRecord:
    """The header of the file at ``path``; ``CorruptBlock`` when its size or header is wrong.

    Reads only the header: the payload's checksum is verified by ``decode_block`` on use.
    """
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        header_len = _check_prefix(prefix, path)
        header = f.read(header_len)
    record, _, specs = _parse_header(header, path)
    want = _PREFIX.size + header_len + sum(_spec_bytes(s) for s in specs) + _DIGEST
    size = path.stat().st_size
    if size != want:
        raise CorruptBlock(f"{path}: {size} bytes, its header says {want} (truncated write)")
    return record


def decode_block(data: bytes, path: Path) -> BlockData:
    """Check the digest and rebuild the block's arrays; ``CorruptBlock`` on any mismatch."""
    if len(data) < _PREFIX.size + _DIGEST:
        raise CorruptBlock(f"{path}: {len(data)} bytes is too short for a block file")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if xxhash.xxh3_128_digest(body) != digest:
        raise CorruptBlock(f"{path}: checksum mismatch (torn or corrupted file)")
    header_len = _check_prefix(body[:_PREFIX.size], path)
    start = _PREFIX.size + header_len
    record, n_keys, specs = _parse_header(body[_PREFIX.size:start], path)
    arrays = []
    for name, shape in specs:
        size = _spec_bytes((name, shape))
        if start + size > len(body):
            raise CorruptBlock(f"{path}: payload shorter than its header says")
        np_dtype, view = _DTYPES[name]
        flat = np.frombuffer(body, dtype=np_dtype, count=size // np.dtype(np_dtype).itemsize,
                             offset=start)
        array = mx.array(flat.reshape(shape))
        arrays.append(array.view(view) if view is not None else array)
        start += size
    if start != len(body):
        raise CorruptBlock(f"{path}: {len(body) - start} unexpected bytes after the payload")
    return BlockData(record, tuple(arrays[:n_keys]), tuple(arrays[n_keys:]))


def _check_prefix(prefix: bytes, path: Path) -> int:
    if len(prefix) < _PREFIX.size:
        raise CorruptBlock(f"{path}: truncated before its header")
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptBlock(f"{path}: not an orchard block file")
    if version < VERSION:
        raise OutdatedBlock(f"{path}: block file version {version}, this orchard reads {VERSION}")
    if version != VERSION:
        raise CorruptBlock(f"{path}: block file version {version}, this orchard reads {VERSION}")
    return header_len


def _parse_header(header: bytes, path: Path) -> tuple[BlockRecord, int, list]:
    try:
        (block, parent, ns, position, model, revision, tokens, bits, n_keys,
         specs) = msgpack.unpackb(header, raw=False)
        identity = BlockIdentity(str(ns), BlockHash(int.from_bytes(parent, "little")),
                                 int(position), tuple(int(t) for t in tokens))
        record = BlockRecord(BlockHash(int.from_bytes(block, "little")), identity, str(model),
                             str(revision), int(bits))
        specs = [(str(name), tuple(int(d) for d in shape)) for name, shape in specs]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptBlock(f"{path}: unreadable header ({exc})") from None
    if any(name not in _DTYPES for name, _ in specs):
        raise CorruptBlock(f"{path}: unknown array dtype in {specs}")
    return record, int(n_keys), specs


def _spec_bytes(spec) -> int:
    name, shape = spec
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[name][0]).itemsize


def _dtype_name(a: mx.array) -> str:
    name = str(a.dtype).removeprefix("mlx.core.")
    if name not in _DTYPES:
        raise ValueError(f"cannot write a {name} array to a block file")
    return name


def _raw(a: mx.array) -> memoryview:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return memoryview(np.ascontiguousarray(a)).cast("B")
