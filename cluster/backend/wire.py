"""The frames of the frontend <-> worker stream (``cluster.backend.link``): layout, codec, auth.

A frame is a 4-byte big-endian length, then a msgpack array ``[kind, stream_id, body]``::

    kind      sent by    body
    GENERATE  frontend   [GenerateRequest, feed_after, chunks,   start stream ``stream_id``
                          router_id, PullPlan | nil]
    ABORT     frontend   nil                                     the caller gave up on it
    ITEM      worker     TokenChunk | Prefilled | WorkerDone     WorkerDone ends the stream
                                                             (both defined here)
    ERROR     worker     [error kind, message]                   ends the stream

A connection whose first frame is PULL is a transfer between two workers
(``cluster.backend.pull``), the receiver asking, the holder answering::

    PULL      receiver   [Namespace, tokens, start, stop, window]  blocks start..stop
    BLOCK     holder     a block's bytes (``workers.cache.transfer``; stream_id: its index)
    NEXT      receiver   nil          the window is stored: send the next one
    END       holder     blocks sent  no more blocks (fewer than asked: the holder lacks them)

Messages travel as msgpack extension types, not pickle: a dataclass is its position in
``_DATACLASSES`` and its fields in order, an enum its position in ``_ENUMS`` and its value, an
``EventBatch`` the bytes of ``router.kv.events.encode_batch`` (its 128-bit block hashes do not
fit msgpack's integers). Only the types listed here decode: the stream carries data, never
code. Arrays decode as tuples, as the messages' fields are.

Authentication (``challenge`` / ``answer``): the worker sends a random 32-byte nonce, the
frontend answers HMAC-SHA256(cluster secret, nonce); the secret itself, handed to the worker
through Ray, never crosses the stream.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from enum import IntEnum

import msgpack

from cluster.backend.protocol import TokenChunk
from router.kv.events import EventBatch, decode_batch, encode_batch
from router.kv.key import Namespace
from workers.messages import (CacheControls, GenerateRequest, GenerateResult, LookupOutcome,
                              LookupReport, ResponseFormat, SamplingParams, Timings,
                              TokenLogprob)

MAX_FRAME = 64 << 20        # a frame longer than this is a broken (or hostile) peer
NONCE_BYTES = 32
ANSWER_BYTES = hashlib.sha256().digest_size
_HEADER = struct.Struct("!I")


class Kind(IntEnum):
    GENERATE = 0
    ABORT = 1
    ITEM = 2
    ERROR = 3
    PULL = 4
    BLOCK = 5
    NEXT = 6
    END = 7


class ErrorKind(IntEnum):
    REFUSED = 0   # the engine refused the request (ValueError at the caller)
    FAILED = 1    # the engine broke under it (WorkerFailed at the caller)
    OTHER = 2     # anything else (RuntimeError at the caller)


class WireError(ConnectionError):
    """The peer sent something that is not a frame of this protocol."""


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The request's first token is out (sent instead of chunks when none are wanted)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PullPlan:
    """The router's decision to fill a request's prefix from a peer before it runs: the
    receiver pulls the prompt's first ``blocks`` blocks it lacks from ``peer``."""

    peer: str            # the holder's worker id
    host: str            # the holder's stream (``LinkServer``) address and port
    port: int
    blocks: int
    predicted_s: float   # the router's predicted pull time


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """What a pull did: the blocks stored from the peer, its wall time and bytes (the link's
    measurement), and why it ended early ("": every block asked for came)."""

    peer: str
    blocks: int
    tokens: int
    nbytes: int
    seconds: float
    refused: str = ""


@dataclass(frozen=True, slots=True)
class WorkerDone:
    """A finished request and the worker's own wall time on it (cache writes included)."""

    result: GenerateResult
    worker_s: float
    traced: bool = False   # the worker drew the request's spans (lookup, prefill, decode)
    # The worker's block event batches after the caller's ``feed_after``, up to this result:
    # the caller's router learns what the request stored before it routes the next one.
    events: tuple[EventBatch, ...] = ()
    pulled: PullOutcome | None = None   # the request's pull from a peer, when it had one


_DATACLASSES = (GenerateRequest, Namespace, SamplingParams, TokenChunk, Prefilled, WorkerDone,
                GenerateResult, LookupReport, Timings, ResponseFormat, TokenLogprob, PullPlan,
                PullOutcome, CacheControls)
_DATACLASS_CODE = {cls: i for i, cls in enumerate(_DATACLASSES)}
_ENUMS = (LookupOutcome,)
_ENUM_CODE = {cls: i for i, cls in enumerate(_ENUMS)}
_EXT_DATACLASS, _EXT_ENUM, _EXT_EVENTS = 1, 2, 3


def _default(obj):
    code = _DATACLASS_CODE.get(type(obj))
    if code is not None:
        return msgpack.ExtType(_EXT_DATACLASS, _pack(
            [code, [getattr(obj, name) for name in obj.__dataclass_fields__]]))
    if isinstance(obj, tuple):
        return list(obj)
    if type(obj) in _ENUM_CODE:
        return msgpack.ExtType(_EXT_ENUM, _pack([_ENUM_CODE[type(obj)], obj.value]))
    if isinstance(obj, EventBatch):
        return msgpack.ExtType(_EXT_EVENTS, encode_batch(obj))
    raise TypeError(f"{type(obj).__name__} does not travel on the worker stream")


def _ext(code: int, data: bytes):
    if code == _EXT_EVENTS:
        return decode_batch(data)
    index, body = _unpack(data)
    if code == _EXT_DATACLASS:
        return _DATACLASSES[index](*body)
    if code == _EXT_ENUM:
        return _ENUMS[index](body)
    raise WireError(f"unknown extension type {code}")


def _pack(obj) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, ext_hook=_ext, use_list=False, raw=False)


def frame(kind: Kind, stream_id: int, body=None) -> bytes:
    """One frame, header included, ready for ``writer.write``."""
    data = _pack([int(kind), stream_id, body])
    return _HEADER.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> tuple[Kind, int, object]:
    """The next frame; ``asyncio.IncompleteReadError`` at the end of the stream."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise WireError(f"a frame of {size} bytes (at most {MAX_FRAME})")
    try:
        kind, stream_id, body = _unpack(await reader.readexactly(size))
        return Kind(kind), stream_id, body
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise WireError(f"an undecodable frame: {exc}") from None


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def answer(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def accepts(secret: bytes, nonce: bytes, reply: bytes) -> bool:
    return hmac.compare_digest(answer(secret, nonce), reply)
