"""A simulated worker under the linear service model (``router.sim.simulator``): its store's
tiers (``router.kv.tiers``), a FIFO prefill queue, decodes beside it, and a pull from a peer
first when the router planned one (``router.sim.pulls``)."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from router.kv.events import EventBatch, WorkerRates
from router.kv.key import BlockHash, reusable_tokens
from router.kv.tiers import TieredLedger
from router.pull_cost import PullChoice
from router.sim.base import SimRequest
from router.sim.pulls import pull_between
from router.sim.service import LinearService, ProfileService

if TYPE_CHECKING:
    from router.sim.simulator import SimConfig


class SimWorker:
    """One simulated worker: its store's two tiers without tensors, its prefill queue and
    running decodes, on its own clock."""

    def __init__(self, wid: str, config: SimConfig, root: BlockHash) -> None:
        self.wid = wid
        self.now = 0.0
        # the store's two tiers (``router.kv.tiers``), on this worker's simulated clock
        self.tiers = TieredLedger(config.capacity_tokens, config.disk_capacity_tokens,
                                  config.ttl_s, lambda: self.now, config.eviction)
        self.block_size = config.block_size
        self.free_at = 0.0
        self.decodes: list[float] = []  # end times of running decodes
        self.prefilled_tokens = 0
        self.seq = 0
        self.root = root

    def match(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Leading blocks held in memory, then how many more on disk (both touched)."""
        return self.tiers.match(hashes)

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        self.tiers.insert(hashes, self.block_size, "trace", self.root)

    def written_blocks(self) -> int:
        return self.tiers.written_blocks()

    def drain_events(self) -> list:
        return self.tiers.drain_events()


@dataclass(frozen=True, slots=True)
class Served:
    cached: int
    first: float        # first-token time
    end: float          # last-token time
    step_s: float       # one decode step of the batch it joined (its inter-token latency)
    events: EventBatch | None
    pulled: int = 0     # tokens pulled from a peer first


def serve_linear(worker: SimWorker, req: SimRequest, now: float, config: SimConfig,
                 service: LinearService | ProfileService, source: SimWorker | None = None,
                 pull: PullChoice | None = None) -> Served:
    """Run one request on ``worker`` (the linear model): its pull if planned, FIFO prefill,
    then decode beside."""
    arrived, pulled = now, 0
    if source is not None and pull is not None:
        got = pull_between(worker.tiers, source.tiers, req.hashes, pull.blocks,
                           config.block_size, config.link(), config.kv_bytes_per_token)
        if got.tokens:
            arrived, pulled = now + got.seconds, got.tokens
            worker.now = max(worker.now, arrived)
            worker.insert(req.hashes[:got.blocks])
    start = max(arrived, worker.free_at)
    decodes = worker.decodes
    while decodes and decodes[0] <= start:
        heapq.heappop(decodes)
    worker.now = start
    in_memory, on_disk = worker.match(req.hashes)
    cached = reusable_tokens(req.input_length, in_memory + on_disk, config.block_size)
    compute = req.input_length - cached
    load = config.disk_load_s(max(0, cached - in_memory * config.block_size))
    first = start + load + service.prefill_s(compute, cached, len(decodes), req.input_length)
    worker.free_at = first
    worker.prefilled_tokens += compute
    worker.now = first
    if req.writable:
        worker.insert(req.writable)
    step = service.step_s(len(decodes) + 1, req.input_length + req.output_length // 2)
    end = first + req.output_length * step
    heapq.heappush(decodes, end)
    events = worker.drain_events()
    batch = None
    if events:   # with pulls on, each batch reports the worker's prefill rate, as a worker's
        rates = WorkerRates(config.kv_bytes_per_token, None, config.prefill_tps) if (
            config.link_gbps) else None
        batch = EventBatch(worker.wid, worker.seq, tuple(events), rates)
        worker.seq += 1
    return Served(cached, first, end, step, batch, pulled)
