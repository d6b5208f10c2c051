"""What every simulated policy shares: the request it routes and the load it accounts.

A policy sees what a real router would: the request (block hashes, lengths), its own record
of what it sent where (``started``/``prefilled``/``finished``), and, if it consumes them, the
workers' block events. ``SimPolicy`` keeps per worker the in-flight requests, the queued
prefill tokens and the running KV blocks, by request.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from router.kv.events import EventBatch
from router.kv.key import BlockHash


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    input_length: int
    output_length: int
    hashes: tuple[BlockHash, ...]  # full blocks only
    session: str = ""                # its session key ("": none), for orchard's tie-break
    write_blocks: int | None = None  # full blocks before its last breakpoint (None: all)

    @property
    def writable(self) -> tuple[BlockHash, ...]:
        """The blocks a worker stores for it: those before its last breakpoint."""
        return self.hashes if self.write_blocks is None else self.hashes[:self.write_blocks]


@dataclass(slots=True)
class _Open:
    """A request a policy has sent and not yet seen finish."""

    worker: str
    prefill: int
    blocks: int
    decoding: bool = False


class SimPolicy:
    """Base: per-worker in-flight, queued prefill tokens and running KV blocks, by request."""

    name = "base"

    def __init__(self, workers: Sequence[str], block_size: int, seed: int) -> None:
        self.workers = list(workers)
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.in_flight = {w: 0 for w in self.workers}
        self.prefill = {w: 0 for w in self.workers}
        self.kv_blocks = {w: 0 for w in self.workers}
        self._open: dict[int, _Open] = {}
        self.reasons: dict[str, int] = {}  # why each request went where (orchard only)

    def choose(self, req: SimRequest, now: float) -> str:
        """The worker for ``req`` arriving at ``now`` (each policy defines it)."""
        raise NotImplementedError

    def expected_cached(self, req: SimRequest, worker: str) -> int:
        return 0

    def planned_pull(self):
        """The pull the last ``choose`` planned (``router.pull_cost.PullChoice``; orchard only)."""
        return None

    def index_dropped(self) -> int | None:
        """Blocks the policy's own index forgot to stay in its budget (orchard only)."""
        return None

    def on_events(self, batch: EventBatch) -> None:
        """Block events from a worker; policies that do not use them ignore them."""

    def started(self, req: SimRequest, worker: str, now: float) -> None:
        prefill = req.input_length - self.expected_cached(req, worker)
        blocks = -(-req.input_length // self.block_size)
        self._open[req.rid] = _Open(worker, prefill, blocks)
        self.in_flight[worker] += 1
        self.prefill[worker] += prefill
        self.kv_blocks[worker] += blocks

    def prefilled(self, rid: int) -> None:
        entry = self._open[rid]
        self.prefill[entry.worker] -= entry.prefill
        entry.decoding = True

    def finished(self, rid: int) -> None:
        entry = self._open.pop(rid)
        if not entry.decoding:
            self.prefill[entry.worker] -= entry.prefill
        self.in_flight[entry.worker] -= 1
        self.kv_blocks[entry.worker] -= entry.blocks
