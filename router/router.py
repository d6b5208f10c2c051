"""``Router``: the plain class the cluster routes with, in each frontend's own process
(``cluster.backend.routing``); no router is shared between processes.

It owns the worker set (live or draining), the load each worker carries as the router
accounts it (queued prefill, running decodes, and recent prefill decayed over
``balance_half_life_s``), the ``PrefixIndex`` (who holds what) and the ``SharedPrefixes``
(which prefixes many prompts continue); the choice itself is ``router.policy.decide``.

Life of a request, as the cluster drives it::

    decision = router.route(namespace, block_hashes, prompt_tokens)   # may raise NoWorkerAvailable
    router.started(request_id, decision)      # queued prefill += prompt - expected cached
    router.prefilled(request_id)              # first token: prefill done, now decoding
    router.finished(request_id)               # done (or failed): its load is gone

Workers' ``EventBatch``es reach ``apply_events`` (decoded off the wire,
``cluster.backend.wire``); a batch's ``WorkerRates`` (disk read bandwidth, prefill rate) set
what a token on that worker's disk costs the policy (``router.policy.disk_token_cost``), the
latest batch's standing. After a router restart, or when ``stale_workers()`` names a worker
whose batches had a gap, the cluster calls ``rebuild(worker_id, holdings)`` with the worker's
current block hashes.

Memory: ``index_bytes`` bounds the ``PrefixIndex`` (``router.index``: what it forgets first);
beside it the ``SharedPrefixes`` get a sixteenth of that: ``index_bytes / 16 /
SHARED_ENTRY_BYTES`` branch points and as many shared marks, at 131 and 89 bytes an entry
(measured: RSS over 300k and 100k entries), 610k of each for the default 2 GiB; at least
``SHARED_MIN_ENTRIES`` (65,536: 14 MB), so that a small index budget (the simulator's, to
measure what the index's eviction costs) does not also forget which prefixes are shared.

Given ``PeerLinks`` (a cluster whose workers can pull blocks from each other), a decision may
carry a pull (``router.policy.with_pull``, ``router.pull_cost``); a batch's ``LinkMeasure``s
(the worker's links from its peers, as its pulls measured them) are those pairs' rates from
then on. The router counts the pulls each worker serves (planned from it, from ``started``
until the request's ``prefilled`` or ``finished``): a holder serving ``MAX_PULLS_PER_SOURCE``
is no pull source.

Session keys (``route(..., session=)``: a request's ``prompt_cache_key`` or session header):
the router remembers, per namespace, the worker each key was last routed to, for the
policy's tie-break (``router.policy``, step 5); at most ``MAX_SESSIONS`` keys (65,536, about
10 MB), the least recently routed forgotten first.

The clock is injected (seconds, monotonic); randomness is the seeded rendezvous hash only.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from router.kv.events import EventBatch
from router.index import DEFAULT_INDEX_BYTES, DEFAULT_PENDING_TTL_S, IndexCounters, PrefixIndex
from router.kv.key import BlockHash, Namespace
from router.policy import (NoWorkerAvailable, PolicyConfig, RouteQuery, RoutingDecision, WorkerLoad,
                           decide, disk_token_cost, with_pull)
from router.pull_cost import LinkRate, PeerLinks
from router.sharing import SharedPrefixes

SHARED_ENTRY_BYTES = 131 + 89  # a branch point and a shared mark (Python dicts of hashes)
SHARED_MIN_ENTRIES = 1 << 16
MAX_SESSIONS = 1 << 16  # session keys remembered for the tie-break


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker_id: str
    draining: bool
    queued_prefill_tokens: int
    running_decodes: int
    in_flight: int
    blocks_held: int
    recent_prefill_tokens: float = 0.0  # prefill sent there, decayed by the balance half-life
    disk_token_cost: float | None = None  # measured; None: the policy's default stands


@dataclass(slots=True)
class _Load:
    queued_prefill_tokens: int = 0
    running_decodes: int = 0
    in_flight: int = 0
    draining: bool = False
    recent_scaled: float = 0.0  # forward-decayed: prefill x 2**((t - epoch) / half-life)
    disk_token_cost: float | None = None  # from the worker's latest rates


@dataclass(slots=True)
class _Ticket:
    worker_id: str
    prefill_tokens: int
    decoding: bool = False
    pull_source: str = ""   # the worker serving this request's pull until it prefills


class Router:
    """Cache-aware routing over a live set of workers, fed by their block events."""

    def __init__(
        self,
        block_size: int,
        config: PolicyConfig = PolicyConfig(),
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        index_bytes: int = DEFAULT_INDEX_BYTES,
        pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
        links: PeerLinks | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.config = config
        self.seed = seed
        self._clock = clock
        self._index = PrefixIndex(index_bytes, pending_ttl_s)
        self._shared = SharedPrefixes(max(SHARED_MIN_ENTRIES,
                                          index_bytes // 16 // SHARED_ENTRY_BYTES))
        self._loads: dict[str, _Load] = {}
        self._tickets: dict[str, _Ticket] = {}
        self._epoch = clock()
        self._views: dict[str, WorkerLoad] = {}  # eligible (not draining) workers' loads
        # None: the cluster cannot move blocks between workers, so no pull is planned
        self.links = links
        self._prefill_rates: dict[str, float] = {}  # measured, from the workers' batches
        self._pulls_served: dict[str, int] = {}  # worker -> pulls it serves now
        # (namespace label, session key) -> the worker it was routed to last; oldest first
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.unknown_tickets = 0

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id must be a non-empty string")
        self._index.add_worker(worker_id)
        self._loads[worker_id] = _Load()
        self._refresh(worker_id)

    def drain_worker(self, worker_id: str) -> None:
        """Send no new requests to ``worker_id``; in-flight ones finish normally."""
        self._load_of(worker_id).draining = True
        self._views.pop(worker_id, None)

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` (left, or dead) and everything it held, at once."""
        self._load_of(worker_id)
        self._index.remove_worker(worker_id)
        del self._loads[worker_id]
        self._views.pop(worker_id, None)
        self._prefill_rates.pop(worker_id, None)
        self._pulls_served.pop(worker_id, None)
        if self.links is not None:
            self.links.forget(worker_id)
        for rid in [r for r, t in self._tickets.items() if t.worker_id == worker_id]:
            self._pull_served(self._tickets.pop(rid))

    def workers(self) -> list[WorkerStatus]:
        decay = self._decay(self._clock())
        return [WorkerStatus(w, l.draining, l.queued_prefill_tokens, l.running_decodes,
                             l.in_flight, self._index.blocks_held(w), l.recent_scaled * decay,
                             l.disk_token_cost)
                for w, l in self._loads.items()]

    def stale_workers(self) -> list[str]:
        return self._index.stale_workers()

    def indexed_blocks(self) -> int:
        """Distinct blocks the index knows a holder of."""
        return len(self._index)

    def index_counters(self) -> IndexCounters:
        return self._index.counters()

    def holders(self, block: BlockHash) -> list[str]:
        """The live workers this router believes hold ``block`` (from their events)."""
        return self._index.holders(block)

    # ---- events --------------------------------------------------------------------------

    def apply_events(self, batch: EventBatch) -> None:
        """Apply a worker's batch of block events."""
        self._index.apply(batch)
        load = self._loads.get(batch.worker_id)
        if batch.rates is not None and load is not None and batch.rates.prefill_tokens_s:
            self._prefill_rates[batch.worker_id] = batch.rates.prefill_tokens_s
        if self.links is not None and load is not None:
            for measured in batch.links:   # the worker's links from its peers
                if measured.peer in self._loads:
                    self.links.set(measured.peer, batch.worker_id,
                                   LinkRate(measured.bytes_s, measured.fixed_s))
        if batch.rates is not None and load is not None:
            cost = disk_token_cost(batch.rates)
            if cost is not None and cost != load.disk_token_cost:
                load.disk_token_cost = cost
                self._refresh(batch.worker_id)

    def lost_events(self, worker_id: str, seq: int) -> None:
        """A batch of ``worker_id``'s up to ``seq`` was lost where no later batch shows it
        (its feed's heartbeat named a batch never applied): stale until ``rebuild``."""
        self._index.mark_gap(worker_id, seq)

    def rebuild(self, worker_id: str, holdings: Iterable[BlockHash],
                disk_holdings: Iterable[BlockHash] = ()) -> None:
        """Replace the index's view of ``worker_id`` with the blocks it reports holding in
        memory (``holdings``) and on disk (``disk_holdings``)."""
        self._index.rebuild(worker_id, holdings, disk_holdings)

    # ---- routing -------------------------------------------------------------------------

    def route(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
              prompt_tokens: int, session: str = "") -> RoutingDecision:
        """Choose a worker for a prompt of ``prompt_tokens`` whose full blocks hash to
        ``block_hashes``; ``session``: its session key ("": none), a tie-break. Raises
        ``NoWorkerAvailable`` when no worker takes requests."""
        if prompt_tokens <= 0:
            raise ValueError(f"prompt_tokens must be positive, got {prompt_tokens}")
        if len(block_hashes) * self.block_size > prompt_tokens:
            raise ValueError(
                f"{len(block_hashes)} blocks of {self.block_size} tokens do not fit in a "
                f"{prompt_tokens}-token prompt: pass the hashes of full blocks only")
        now = self._clock()
        recent_scale = self._decay(now)
        loads = list(self._views.values())
        if not loads:
            why = "all workers are draining" if self._loads else "no workers are registered"
            raise NoWorkerAvailable(f"cannot route: {why}; add a worker or retry later")
        found = self._index.match(block_hashes, now)
        matched = found.blocks
        deepest = max(matched.values(), default=0)
        shared = self._shared.depth(block_hashes, deepest)
        self._shared.note(block_hashes, deepest)
        stored = self._index.holders(block_hashes[shared - 1]) if shared else ()
        chain = block_hashes if block_hashes else (namespace.root(),)
        key = (namespace.label(), session)
        query = RouteQuery(chain, prompt_tokens, matched, shared, stored, found.disk_blocks,
                           self._sessions.get(key, "") if session else "")
        decision = decide(self.config, query, loads, block_size=self.block_size, seed=self.seed,
                          recent_scale=recent_scale)
        if self.links is not None and len(loads) > 1:
            decision = with_pull(self.config, decision, loads, self.links, self._prefill_rates,
                                 self.block_size, self._pulls_served)
        if session:
            self._sessions[key] = decision.worker_id
            self._sessions.move_to_end(key)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self._index.note_routed(decision.worker_id, block_hashes, now,
                                matched.get(decision.worker_id, 0))
        return decision

    # ---- load accounting -----------------------------------------------------------------

    def started(self, request_id: str, decision: RoutingDecision) -> None:
        """The request was sent where ``decision`` says: count its prefill as queued there."""
        if request_id in self._tickets:
            raise ValueError(f"request {request_id!r} already started; finish it first")
        load = self._load_of(decision.worker_id)
        prefill = decision.prompt_tokens - decision.expected_cached_tokens
        source = decision.pull.source if decision.pull is not None else ""
        self._tickets[request_id] = _Ticket(decision.worker_id, prefill, pull_source=source)
        if source:
            self._pulls_served[source] = self._pulls_served.get(source, 0) + 1
        load.queued_prefill_tokens += prefill
        load.recent_scaled += prefill / self._decay(self._clock())
        load.in_flight += 1
        self._refresh(decision.worker_id)

    def prefilled(self, request_id: str) -> None:
        """The request produced its first token: its prefill is done, it now decodes."""
        ticket = self._tickets.get(request_id)
        if ticket is None or ticket.decoding:
            self.unknown_tickets += ticket is None
            return
        load = self._loads[ticket.worker_id]
        load.queued_prefill_tokens -= ticket.prefill_tokens
        load.running_decodes += 1
        self._refresh(ticket.worker_id)
        ticket.decoding = True
        self._pull_served(ticket)

    def finished(self, request_id: str) -> None:
        """The request is done (or failed): drop whatever load it still carried."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            self.unknown_tickets += 1  # e.g. its worker was removed meanwhile
            return
        load = self._loads[ticket.worker_id]
        if ticket.decoding:
            load.running_decodes -= 1
        else:
            load.queued_prefill_tokens -= ticket.prefill_tokens
        load.in_flight -= 1
        self._refresh(ticket.worker_id)
        self._pull_served(ticket)

    def pulls_served(self) -> dict[str, int]:
        """The pulls each worker serves now (those planned from it, not yet prefilled)."""
        return {w: n for w, n in self._pulls_served.items() if n}

    def _pull_served(self, ticket: _Ticket) -> None:
        # A request's pull is over once it prefills (or ends): its source may serve another.
        source, ticket.pull_source = ticket.pull_source, ""
        if self._pulls_served.get(source, 0) > 0:   # absent: the source left meanwhile
            self._pulls_served[source] -= 1

    def _refresh(self, worker_id: str) -> None:
        # One view per load change, not one per worker per decision: the hot path reuses them.
        load = self._loads[worker_id]
        if not load.draining:
            self._views[worker_id] = WorkerLoad(worker_id, load.queued_prefill_tokens,
                                                load.running_decodes, load.recent_scaled,
                                                load.disk_token_cost)

    def _decay(self, now: float) -> float:
        # Forward decay: adding x at time t stores x * 2**((t - epoch)/h); reading at ``now``
        # multiplies by 2**(-(now - epoch)/h). The epoch moves before the numbers grow large.
        half_life = self.config.balance_half_life_s
        if now - self._epoch > 64 * half_life:
            shrink = 2.0 ** (-(now - self._epoch) / half_life)
            for load in self._loads.values():
                load.recent_scaled *= shrink
            self._epoch = now
            for worker_id in self._loads:
                self._refresh(worker_id)
        return 2.0 ** (-(now - self._epoch) / half_life)

    def _load_of(self, worker_id: str) -> _Load:
        load = self._loads.get(worker_id)
        if load is None:
            known = ", ".join(sorted(self._loads)) or "none"
            raise ValueError(f"unknown worker {worker_id!r}: known workers are {known}")
        return load
