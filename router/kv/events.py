"""Block events: what a worker's prefix store tells the router about the blocks it holds.

The store emits one ``BlockStored`` when a block's K/V enter it and one ``BlockRemoved`` when
they leave (evicted, expired or invalidated). A worker sends them to the router in batches,
encoded with msgpack: compact, language-neutral, and the same shape that vLLM's and llm-d's KV
events take. A batch carries the worker id and a per-worker sequence number so the router can
notice a gap (a lost batch) and ask the worker for its full state instead.

Each event names the store's tier it concerns (``Tier.MEMORY`` or ``Tier.DISK``): a block
evicted from memory to the worker's disk is one ``BlockRemoved(tier=MEMORY)`` and one
``BlockStored(tier=DISK)``; the worker holds a block while any tier does. A batch written
before tiers existed decodes with every event in memory.

A batch from a worker with a disk tier also carries its ``WorkerRates``: the disk tier's
measured read bandwidth and the engine's measured prefill rate, from which the router's
policy counts what a block on that disk costs to load (``router.policy.disk_token_cost``).
They ride on the batches because every path that brings a worker's blocks to a router (the
in-process backend, a result's batches and the event feed on the Ray path) already carries
them; a rate changes when the worker reads from disk or prefills, and both store blocks, so a
batch follows.

A batch from a worker that has pulled blocks from peers also carries its ``LinkMeasure``s:
for each peer it pulled from, the link's bandwidth and fixed cost as its pulls measured them
(``router.pull_cost``). A pull stores blocks, so a batch follows it; every router that hears
the worker's batches costs its pulls on the pair's measured figures, not only the router that
planned the pull.

This module is shared by ``workers`` (producer) and ``router`` (consumer); it imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

import msgpack

from router.kv.key import BlockHash


class Tier(str, Enum):
    MEMORY = "memory"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block: BlockHash
    parent: BlockHash
    token_count: int
    namespace: str
    tier: Tier = Tier.MEMORY


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block: BlockHash
    namespace: str
    tier: Tier = Tier.MEMORY


BlockEvent = Union[BlockStored, BlockRemoved]


@dataclass(frozen=True, slots=True)
class WorkerRates:
    """What a worker measured of its own speed; a rate is None until it is first measured."""

    disk_bytes_per_token: int           # K/V bytes one token takes in its disk tier
    disk_read_bytes_s: float | None     # the disk tier's read bandwidth
    prefill_tokens_s: float | None      # the engine's prefill passes

    def __post_init__(self) -> None:
        if self.disk_bytes_per_token <= 0:
            raise ValueError(f"WorkerRates.disk_bytes_per_token must be positive, "
                             f"got {self.disk_bytes_per_token}")
        for name in ("disk_read_bytes_s", "prefill_tokens_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # not NaN either
                raise ValueError(f"WorkerRates.{name} must be positive or None "
                                 f"(not measured), got {value}")


@dataclass(frozen=True, slots=True)
class LinkMeasure:
    """A worker's measured link from ``peer`` to it: what pulling ``n`` bytes costs,
    ``fixed_s + n / bytes_s`` seconds."""

    peer: str
    bytes_s: float
    fixed_s: float

    def __post_init__(self) -> None:
        if not self.peer:
            raise ValueError("LinkMeasure.peer must name a worker")
        if not self.bytes_s > 0 or not self.fixed_s >= 0:   # not NaN either
            raise ValueError(f"LinkMeasure from {self.peer!r} needs bytes_s > 0 and "
                             f"fixed_s >= 0, got {self.bytes_s} and {self.fixed_s}")


@dataclass(frozen=True, slots=True)
class EventBatch:
    worker_id: str
    seq: int
    events: tuple[BlockEvent, ...]
    rates: WorkerRates | None = None  # the worker's, as of this batch (None: no disk tier)
    links: tuple[LinkMeasure, ...] = ()  # its measured links from its peers, as of this batch


_STORED, _REMOVED = 0, 1


def _h(value: int) -> bytes:
    return value.to_bytes(16, "little")


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch as msgpack: ``[worker_id, seq, [[kind, ...fields], ...], rates]``,
    ``rates`` being ``[disk_bytes_per_token, disk_read_bytes_s, prefill_tokens_s]`` or nil,
    then, when it has links, ``[[peer, bytes_s, fixed_s], ...]``."""
    rows = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            rows.append([_STORED, _h(ev.block), _h(ev.parent), ev.token_count, ev.namespace,
                         ev.tier.value])
        else:
            rows.append([_REMOVED, _h(ev.block), ev.namespace, ev.tier.value])
    r = batch.rates
    rates = None if r is None else [r.disk_bytes_per_token, r.disk_read_bytes_s, r.prefill_tokens_s]
    row = [batch.worker_id, batch.seq, rows, rates]
    if batch.links:
        row.append([[m.peer, m.bytes_s, m.fixed_s] for m in batch.links])
    return msgpack.packb(row, use_bin_type=True)


def decode_batch(data: bytes) -> EventBatch:
    """Decode what ``encode_batch`` wrote; a malformed payload raises ``ValueError``."""
    try:
        worker_id, seq, rows, *more = msgpack.unpackb(data, raw=False)
        rates = _rates(more[0]) if more and more[0] is not None else None
        links = tuple(LinkMeasure(str(peer), float(bytes_s), float(fixed_s))
                      for peer, bytes_s, fixed_s in (more[1] if len(more) > 1 else ()))
        events: list[BlockEvent] = []
        for row in rows:
            if row[0] == _STORED:
                events.append(BlockStored(
                    BlockHash(int.from_bytes(row[1], "little")),
                    BlockHash(int.from_bytes(row[2], "little")),
                    int(row[3]), str(row[4]), _tier(row, 5)))
            elif row[0] == _REMOVED:
                events.append(BlockRemoved(BlockHash(int.from_bytes(row[1], "little")),
                                           str(row[2]), _tier(row, 3)))
            else:
                raise ValueError(f"unknown block event kind {row[0]!r}")
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed event batch: {exc}") from None
    return EventBatch(str(worker_id), int(seq), tuple(events), rates, links)


def _rates(row: list) -> WorkerRates:
    per_token, read, prefill = row
    return WorkerRates(int(per_token), None if read is None else float(read),
                       None if prefill is None else float(prefill))


def _tier(row: list, at: int) -> Tier:
    return Tier(row[at]) if len(row) > at else Tier.MEMORY
