"""The engine's step loop, simulated: how ``orchard simulate --profile`` times a worker.

It follows ``workers/engine/engine.py``'s ``Engine.step`` and the rules of ``workers.engine.scheduler``
(whose ``StepBudget`` and ``split_budget`` it runs as they are), with the times taken from a
measured ``EngineProfile`` instead of the model::

    step:  admit   queued requests, FIFO, while running + prefilling < max_batch
           decode  one token for every running request: one batched step,
                   profile step_s(batch, mean context)
           prefill at most `budget` prompt tokens (512 alone; while requests decode, what fits
                   in (stall - 1) decode steps at the measured prefill rate), oldest job first:
                   a job's chunks together cost the profile's prefill_s(cached, new) for its
                   whole prompt, the first one its fixed cost (the difference of two grid
                   reads for each later one)

- A job is looked up in the store when it first gets budget (the cached blocks' load time is
  charged to that step); a job whose first block is an older prefilling job's first block
  waits for it, then reuses what that one stored.
- A chunk that completes blocks stores them at the step's end (the router hears of them
  ``event_delay_s`` later).
- A job whose share covers its last prompt token produces its first token at the step's end
  and decodes from the next step; it finishes after ``output_length - 1`` decode steps.
- Every gap between two tokens of a request is one inter-token latency: a decode step, plus
  the prefill chunks of the step before it.

With speculative decoding (``Speculation``: every running request drafts ``width`` tokens and
accepts ``accepted`` of them per pass on average, a figure a trace does not carry, so the
run states it), each decode step is a verify pass, timed by the profile's
``verify_step_s(batch, width, context)``, and yields ``1 + accepted`` tokens a request (the
last pass of a request yields what it has left).

Not modelled: the per-tenant round robin of admission (traces have one tenant), the K/V
memory limit, equal-offset chunks sharing a pass (each chunk is timed on its own).
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from router.kv.events import EventBatch
from router.kv.key import BlockHash, reusable_tokens
from router.sim.service import ProfileService
from router.sim.base import SimRequest
from workers.engine.scheduler import StepBudget, split_budget, this_step

# (time, kind, payload): "events" (an EventBatch), "prefilled" or "finished" (a request id)
Emit = Callable[[float, str, object], None]


class Store(Protocol):
    """The simulated worker's prefix store: the ledger accounting ``router.sim.simulator`` owns."""

    wid: str
    now: float
    seq: int
    prefilled_tokens: int

    def match(self, hashes: Sequence[BlockHash]) -> tuple[int, int]: ...
    def insert(self, hashes: Sequence[BlockHash]) -> None: ...
    def drain_events(self) -> list: ...


@dataclass(frozen=True, slots=True)
class Speculation:
    """Every decode step a verify pass of ``width`` drafts a row, ``accepted`` of them taken
    on average (0 <= accepted <= width)."""

    width: int
    accepted: float

    def __post_init__(self) -> None:
        if self.width < 1 or not 0.0 <= self.accepted <= self.width:
            raise ValueError(f"speculation: need width >= 1 and 0 <= accepted <= width, got "
                             f"width {self.width}, accepted {self.accepted}")


@dataclass(slots=True)
class _Job:
    req: SimRequest
    arrival: float
    first_block: BlockHash | None
    looked_up: bool = False
    cached: int = 0  # prompt tokens the store lookup reused
    done: int = 0    # prompt tokens in the cache (reused or computed)

    @property
    def need(self) -> int:
        return self.req.input_length - self.done


@dataclass(slots=True)
class _Running:
    rid: int
    left: float      # output tokens still to come
    context: int     # tokens in its cache
    last: float      # when its latest token came


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request met on its worker."""

    arrival: float
    first: float
    cached: int


class EngineWorker:
    """One worker's queue, prefilling jobs and decode batch, advanced step by step."""

    def __init__(self, store: Store, service: ProfileService, block_size: int,
                 prefill_budget: int, decode_stall: float, disk_load_s: Callable[[int], float],
                 event_delay_s: float, speculation: Speculation | None = None) -> None:
        self.store = store
        self.speculation = speculation
        self.service = service
        self.block_size = block_size
        self.budget = StepBudget(prefill_budget, decode_stall)
        self.disk_load_s = disk_load_s
        self.event_delay_s = event_delay_s
        self.clock = 0.0
        self.queue: deque[_Job] = deque()
        self.prefilling: list[_Job] = []
        self.running: list[_Running] = []
        self.outcomes: dict[int, Outcome] = {}
        self.gaps = array("d")  # every inter-token latency, in seconds

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.prefilling or self.running)

    def submit(self, req: SimRequest, now: float) -> None:
        if not self.busy:
            self.clock = max(self.clock, now)
        first = req.hashes[0] if req.input_length > self.block_size and req.hashes else None
        self.queue.append(_Job(req, now, first))

    def advance(self, until: float, emit: Emit) -> None:
        """Run every step that starts before ``until``."""
        while self.busy and self.clock < until:
            self._step(emit)

    def _step(self, emit: Emit) -> None:
        limit = self.service.max_batch
        while self.queue and len(self.running) + len(self.prefilling) < limit:
            self.prefilling.append(self.queue.popleft())
        start = self.clock
        elapsed = self._decode(start, emit) if self.running else 0.0
        decoding = elapsed > 0.0
        if self.prefilling:
            elapsed += self._prefill(self.budget.tokens(decoding), start, elapsed, emit)
        self.clock = start + max(elapsed, 1e-9)

    def _decode(self, start: float, emit: Emit) -> float:
        running = self.running
        context = sum(r.context for r in running) // len(running)
        spec = self.speculation
        if spec is None:
            step, tokens = self.service.step_s(len(running), context), 1.0
        else:
            step = self.service.verify_step_s(len(running), spec.width, context)
            tokens = 1.0 + spec.accepted
        self.budget.observe_decode(step)
        at = start + step
        still = []
        for r in running:
            self.gaps.append(at - r.last)
            taken = min(tokens, r.left)
            r.last, r.left, r.context = at, r.left - taken, r.context + round(taken)
            if r.left > 1e-9:
                still.append(r)
            else:
                emit(at, "finished", r.rid)
        self.running = still
        return step

    def _prefill(self, budget: int, start: float, elapsed: float, emit: Emit) -> float:
        jobs = self._this_step(budget)
        load = sum(self._look_up(job, start + elapsed) for job in jobs if not job.looked_up)
        shares = split_budget([job.need for job in jobs], budget)
        compute = sum(self._chunk_s(job, n) for job, n in zip(jobs, shares) if n)
        # the engine measures its prefill rate on the chunks alone: a request's fixed cost
        # (the profile's time for no new tokens) is not part of it
        fixed = sum(self.service.chunk_s(0, job.cached) for job, n in zip(jobs, shares)
                    if n and job.done == job.cached)
        self.budget.observe_prefill(sum(shares), compute - fixed, decoding=elapsed > 0.0)
        end = start + elapsed + load + compute
        self.store.now = end
        for job, n in zip(jobs, shares):
            if not n:
                continue
            bs = self.block_size
            if (job.done + n) // bs > job.done // bs:
                self.store.insert(job.req.writable[:(job.done + n) // bs])
            job.done += n
            self.store.prefilled_tokens += n
            if job.need == 0:
                self._first_token(job, end, emit)
        self._send_events(end, emit)
        return load + compute

    def _chunk_s(self, job: _Job, tokens: int) -> float:
        """A chunk's share of the profile's time for the whole prompt on its cached prefix:
        the first chunk pays the request's fixed cost, the chunks sum to the measured time."""
        computed = job.done - job.cached
        whole = self.service.chunk_s(computed + tokens, job.cached)
        return whole - self.service.chunk_s(computed, job.cached) if computed else whole

    def _this_step(self, budget: int) -> list[_Job]:
        """Oldest first; a job sharing an older prefilling job's first block waits for it."""
        return this_step(self.prefilling, budget)

    def _look_up(self, job: _Job, now: float) -> float:
        """Match the job's blocks in the store; the seconds its cached blocks take to load."""
        job.looked_up = True
        self.store.now = now
        in_memory, on_disk = self.store.match(job.req.hashes)
        cached = reusable_tokens(job.req.input_length, in_memory + on_disk, self.block_size)
        job.cached = job.done = cached
        self.outcomes[job.req.rid] = Outcome(job.arrival, float("nan"), cached)
        from_disk = max(0, cached - in_memory * self.block_size)
        return self.service.load_s(cached - from_disk) + self.disk_load_s(from_disk)

    def _first_token(self, job: _Job, at: float, emit: Emit) -> None:
        self.prefilling.remove(job)
        rid = job.req.rid
        self.outcomes[rid] = Outcome(job.arrival, at, self.outcomes[rid].cached)
        emit(at, "prefilled", rid)
        left = job.req.output_length - 1
        if left > 0:
            self.running.append(_Running(rid, left, job.req.input_length, at))
        else:
            emit(at, "finished", rid)

    def _send_events(self, at: float, emit: Emit) -> None:
        events = self.store.drain_events()
        if events:
            emit(at + self.event_delay_s, "events",
                 EventBatch(self.store.wid, self.store.seq, tuple(events)))
            self.store.seq += 1
