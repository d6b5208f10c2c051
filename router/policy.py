"""orchard's routing policy: prefill saved against load carried, decided as data.

Inputs per candidate worker (draining workers are never candidates):

- ``matched_tokens``: tokens of the prompt it would not prefill (its matched full blocks,
  held or just routed there, capped so the suffix is never empty);
- ``load_tokens``: the work ahead of a new request there, in prefill tokens:
  ``queued_prefill + decode_weight_tokens x running_decodes
  + balance_weight x (recent_prefill - least recent_prefill of any candidate)``,
  where ``recent_prefill`` is the prefill sent there, decayed with ``balance_half_life_s``.

Algorithm:

1. ``shared`` = the longest prefix that is not one worker's own: the second-best match, or
   the prompt's known shared prefix (``router.sharing``: a prefix that different prompts
   continue, like a system prompt), whichever is longer. ``affinity(w) = matched(w) - shared``
   when positive: what only ``w`` holds, typically a conversation's history.
2. ``score(w) = load_tokens(w) + prompt - matched(w) - (cache_weight - 1) x affinity(w)
   - (shared_weight - 1) x held_shared(w)``: the prefill between the request and its first
   token on ``w`` (a TTFT proxy), with the tokens only ``w`` holds worth ``cache_weight``
   tokens of queue each. ``held_shared(w)`` is the part of the known shared prefix that
   ``w`` holds beyond the second-best match, counted only where ``w``'s own block events say
   it stores the whole shared prefix: a long system prompt held by one worker is worth more
   than its own prefill there (a copy elsewhere costs cache room as well as time), but a
   prefix that was only just routed somewhere is not held yet, so a burst of new chats on a
   fresh system prompt still spreads. Matched tokens that only ``w``'s disk tier holds add
   their load time (``cost(w) x disk_tokens(w)``, under Defaults).
3. If some worker has affinity, the lowest score wins: reason ``prefix_match`` when it is
   the best-matching worker, ``load_spill`` when its queue pushed the request elsewhere.
4. Otherwise the prompt is cold (nothing beyond a shared prefix is held). Its home is the
   lower-scoring of the ``HOME_CHOICES = 2`` rendezvous-hash winners of the chain up to its
   first unshared block (reason ``cold_hash``): deterministic, so a router that restarts, or
   another router, places it alike, and the request's pending blocks bring its siblings
   after it before any event arrives. Two choices instead of one keep hash collisions from
   stacking new prefixes on one worker: with one choice, some two of 4 system prompts on 4
   workers share a home 91% of the time. If the home's score still exceeds the lowest by more
   than ``min(cold_spill_tokens, prompt - shared)``, the lowest wins (``cold_spill``): a
   cold prompt waits at its home for at most its own new prefill, which is all a sibling
   arriving there later could reuse of it. Rendezvous (highest random weight) moves only
   the keys of a worker that joins or leaves.
5. **Session keys break ties, never a longer match.** A request may name a session
   (``prompt_cache_key``, or a session header: ``session_worker`` is the worker that
   served that key last, in the same namespace). In step 3 it is a tie-break only: equal
   score and equal match, the session's worker before the worker id. In step 4, where no
   worker holds more than the shared prefix, the session's worker takes the place of the
   rendezvous home when it matches as much as the best-matching worker (so it never
   overrides a longer cached match elsewhere), and the cold spill still applies. Why:
   agent clients put a per-message line near the top of the system prompt; each request
   then looks cold, and its hash home moves with that line, while its session's worker
   holds the conversation's kept cache and, behind a breakpoint, its stable prefix.

Defaults, chosen by replaying the Mooncake conversation trace and a synthetic trace of a
different shape (figures in ``docs/benchmarks.md``, ``## Router``):

- ``cache_weight = 64``: a cached token of a conversation's own history is worth 64 tokens
  of queue. Moving a conversation loses this turn's hit and duplicates its history in a
  second cache, and every later turn follows the longer copy; measured hit ratio rises from
  16 to 64 and is flat beyond, while TTFT p99 starts to grow past 64.
- ``cold_spill_tokens = 4096`` (8 blocks of 512): a cold prompt has little to lose, so it
  leaves its hash home as soon as that home is a few blocks of prefill busier; 0 and 16384
  measured within noise; never spilling nearly tripled TTFT p99 (imbalance 1.25). Short
  prompts leave sooner (their own new prefill is the cap): in a burst of 20 new chats of
  560 tokens on 4 workers a 4096-token tolerance let one worker take 6 and another 2, and
  the cluster's TTFT p99 was worse than round robin's. On the conversation trace this costs
  about 0.001 of hit ratio (0.2801 to 0.2807 on seeds 0 to 2, against 0.2805 to 0.2818).
- ``shared_weight = 4``: a cached token of a known shared prefix that only one worker
  stores is worth 4 tokens of queue there. Before it (weight 1), a 30k to 41k-token shared
  prefix held by one worker counted no more than one token of queue per cached token, and
  its conversations spread to workers that prefilled and stored it again. Measured over
  seeds 0 to 2 (8 x 1M tokens, weight 1 -> 4): the conversation trace's goodput (TTFT <= 2 s)
  57.78 / 57.62 / 57.97% -> 57.83 / 57.93 / 58.17%, hit ratio 0.2807 / 0.2801 / 0.2805 ->
  0.2809 / 0.2816 / 0.2808; the lighter synthetic trace's hit ratio 0.6054 / 0.6057 /
  0.6060 -> 0.6082 / 0.6081 / 0.6086 at a goodput 0.23 to 0.45 points lower (99.0 to 99.1%
  -> 98.7 to 98.8%). Weight 8 on the synthetic trace, seed 0: 0.6106, goodput 98.08%. A
  burst of 20 new chats on one fresh 30k-token system prompt on 4 workers is unchanged
  (mean TTFT 5.13 s); counting routed-only prefixes too, all 20 went to one worker and the
  mean rose to 5.81 s.
- ``balance_weight = 0.25``, ``balance_half_life_s = 300``: a worker that did more prefill
  in the last few minutes (about a cache lifetime at these rates) gets fewer cold prompts;
  this keeps long-run imbalance near 1.0 even when the queues are empty (low load), where a
  hot shared prefix would otherwise pull every new conversation to one worker.
- ``decode_weight_tokens = 64``: a running decode slows chunked prefill slightly.
- A matched token that only the worker's disk tier holds is not free: it costs its load
  time, counted in tokens of prefill on that worker: ``score += cost(w) x disk_tokens(w)``
  with ``cost(w) = disk_bytes_per_token x prefill_tokens_s / disk_read_bytes_s``
  (``disk_token_cost``): a token's load time (bytes over the read bandwidth, seconds) times
  the tokens the worker prefills in a second. Each worker measures both rates (its disk
  tier's bytes read back over the time reading them, its prefill passes' tokens over their
  time, moving averages) and reports them with its block events (``WorkerRates``). Until a
  worker has measured both, the default ``PolicyConfig.disk_token_cost = DISK_TOKEN_COST =
  0.14`` stands: 46,080 bytes per token (the default model, float32) at an assumed 2 GB/s
  is 23 us, against 167 us to prefill a token at the simulator's 6,000 tokens/s. Measured
  on the shared 2-core CPU (default model, ``orchard bench disk``): 644 MB/s and 24.1
  prefill tokens/s, 0.0017.

Pulls (``router.pull_cost``; only where the cluster can move blocks between its workers, a
``Router`` given ``PeerLinks``). After the choice above, each candidate's time to first token
with a pull is weighed against the chosen worker's without one, in tokens of prefill on that
candidate: ``ttft(w) = queue(w) + prompt - matched(w)``, where ``queue(w) =
queued_prefill + decode_weight_tokens x running_decodes`` is the wait ahead of it (the
balance term, which spreads cold prompts, is no wait and is left out); with the blocks it
lacks pulled from the source ``h`` (the longest match; ties: the shorter queue, then by id),
``ttft_pull(w) = queue(w) + prompt - matched(h) + pull_s x prefill_tokens_s(w)``, where
``pull_s = fixed_s(h, w) + pulled tokens x bytes_per_token / bytes_s(h, w)``. The lowest
``ttft_pull`` below the choice's ``ttft`` wins: the request goes there (reason
``load_spill``, expecting ``matched(h)`` cached) with a ``PullChoice``. Defaults until a link
or a worker is measured (each worker's pulls measure the pair's bandwidth and fixed cost;
its prefill rate comes with its block events): ``bytes_s = 1.1e9`` (10 GbE), ``fixed_s =
0.002`` (a connect, the authentication and the first window on a LAN), ``prefill_tokens_s =
6000`` (the simulator's), at least ``MIN_PULL_BLOCKS = 1`` block pulled. **The source must
have spare capacity**: the holder serves a pull a window of 8 blocks between its engine steps
(``cluster.backend.pull``), which slows its own decodes by ``PULL_TPOT_COST = 0.085`` of their
TPOT per pull it serves (measured, an upper bound: ``orchard bench pull``'s
``holder_tpot_during_pull_over_alone``, 1.085 on an idle machine); a pull may slow them by at most
``HOLDER_SLOWDOWN_BOUND = 1.10``, so a holder serves at most ``MAX_PULLS_PER_SOURCE = 1``
pull at a time. A holder that already serves one (a pull planned from it whose request has
not produced its first token: the ``Router`` counts them) is no source; the longest match
among the other holders is, or no pull is planned.

Deterministic: ties break by worker id and the rendezvous hash is seeded.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Collection, Iterator, Mapping, Sequence

import xxhash

from router.kv.events import WorkerRates
from router.kv.key import BlockHash
from router.pull_cost import PeerLinks, PullChoice, Row, best_pull

HOME_CHOICES = 2  # a cold prompt's home: the less busy of its two rendezvous winners
# Loading a token's K/V from a worker's disk tier, in tokens of prefill, until the worker has
# measured its rates: 46,080 bytes per token (the default model, float32) at 2 GB/s is 23 us,
# against 167 us to prefill a token at the simulator's 6,000 tokens/s: 0.14
# (docs/benchmarks.md, "A disk tier per worker").
DISK_TOKEN_COST = 0.14


class NoWorkerAvailable(RuntimeError):
    """No worker can take a request now (none registered, or all draining): retry later.

    The one no-workers error: the router raises it and the backends pass it through unchanged.

    The cluster maps it to gRPC ``UNAVAILABLE``.
    """


class Reason(str, Enum):
    PREFIX_MATCH = "prefix_match"  # the worker holding the longest prefix
    LOAD_SPILL = "load_spill"      # the prefix's home was overloaded: cheapest worker
    COLD_HASH = "cold_hash"        # nobody holds the prefix: its rendezvous-hash home
    COLD_SPILL = "cold_spill"      # cold prefix, and its home was overloaded


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    cache_weight: float = 64.0
    cold_spill_tokens: int = 4_096
    shared_weight: float = 4.0
    decode_weight_tokens: int = 64
    balance_weight: float = 0.25
    balance_half_life_s: float = 300.0
    disk_token_cost: float = DISK_TOKEN_COST

    def __post_init__(self) -> None:
        values = {"cache_weight": self.cache_weight, "cold_spill_tokens": self.cold_spill_tokens,
                  "shared_weight": self.shared_weight,
                  "decode_weight_tokens": self.decode_weight_tokens,
                  "balance_weight": self.balance_weight,
                  "disk_token_cost": self.disk_token_cost}
        for name, value in values.items():
            if value < 0:
                raise ValueError(f"PolicyConfig.{name} must be >= 0, got {value}")
        if self.balance_half_life_s <= 0:
            raise ValueError(f"PolicyConfig.balance_half_life_s must be > 0 seconds, "
                             f"got {self.balance_half_life_s}")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The work a worker carries, as the router accounts it."""

    worker_id: str
    queued_prefill_tokens: int
    running_decodes: int
    # Prefill sent there lately, decayed by ``balance_half_life_s``; in the units the router
    # keeps it in: ``decide``'s ``recent_scale`` turns it into tokens.
    recent_prefill_tokens: float = 0.0
    # Prefill tokens a token on its disk tier costs to load (``disk_token_cost``, from its
    # measured rates); None until measured: ``PolicyConfig.disk_token_cost`` stands.
    disk_token_cost: float | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    matched_tokens: int
    load_tokens: int
    score: float  # cost in prefill tokens ahead of the first token; lower is better


class CandidateRows(Sequence[Candidate]):
    """A decision's candidates, kept as plain rows and read as ``Candidate`` records.

    Every decision carries all its candidates, but most decisions are never inspected one
    candidate at a time; a row costs a tenth of a frozen record to make (at 32 workers that
    is a third of a decision). Immutable; iterating or indexing yields ``Candidate``s.
    """

    __slots__ = ("_rows",)

    def __init__(self, rows: tuple[tuple[str, int, int, float], ...]) -> None:
        object.__setattr__(self, "_rows", rows)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CandidateRows is immutable")

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return tuple(Candidate(*row) for row in self._rows[i])
        return Candidate(*self._rows[i])

    def __iter__(self) -> Iterator[Candidate]:
        return (Candidate(*row) for row in self._rows)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (CandidateRows, tuple)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._rows)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self):
        return (CandidateRows, (self._rows,))


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    worker_id: str
    reason: Reason
    expected_cached_tokens: int
    prompt_tokens: int
    candidates: Sequence[Candidate]  # a tuple, or the compact ``CandidateRows``
    pull: PullChoice | None = None   # the prefix pulled from a peer first (``router.pull_cost``)


def disk_token_cost(rates: WorkerRates) -> float | None:
    """The prefill tokens one token on a worker's disk tier costs to load: its load time,
    ``disk_bytes_per_token / disk_read_bytes_s`` seconds, at ``prefill_tokens_s``; None until
    the worker has measured both rates."""
    if rates.disk_read_bytes_s is None or rates.prefill_tokens_s is None:
        return None
    return rates.disk_bytes_per_token / rates.disk_read_bytes_s * rates.prefill_tokens_s


def rendezvous(key: BlockHash, workers: Sequence[str], seed: int, choices: int = 1
               ) -> list[str]:
    """The ``choices`` highest-random-weight workers for ``key``, best first (stable under
    churn: a worker joining or leaving moves only the keys it wins or held)."""
    prefix = key.to_bytes(16, "little") + seed.to_bytes(8, "little", signed=True)
    digest = xxhash.xxh3_64_intdigest
    weighted = [(digest(prefix + w.encode()), w) for w in workers]
    if choices == 1:
        return [max(weighted)[1]]
    weighted.sort(reverse=True)
    return [w for _, w in weighted[:choices]]


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What the router knows about one prompt when it routes it.

    ``hashes`` is the prompt's chain (at least one entry: the namespace root stands in for a
    prompt shorter than a block); ``matched_blocks`` the index's answer for it;
    ``shared_blocks`` how many leading blocks are a known shared prefix, and
    ``shared_stored_on`` the workers whose events say they store all of it;
    ``disk_blocks`` how many of each worker's matched blocks only its disk tier holds.
    """

    hashes: Sequence[BlockHash]
    prompt_tokens: int
    matched_blocks: Mapping[str, int]
    shared_blocks: int = 0
    shared_stored_on: Collection[str] = ()
    disk_blocks: Mapping[str, int] | None = None
    session_worker: str = ""  # the worker that served the request's session key last


def decide(config: PolicyConfig, query: RouteQuery, loads: Sequence[WorkerLoad], *,
           block_size: int, seed: int, recent_scale: float = 1.0) -> RoutingDecision:
    """Choose a worker among ``loads`` (the eligible workers) for one prompt (``query``);
    ``block_size`` and ``seed`` are the router's, ``recent_scale`` scales the balance term."""
    hashes, prompt_tokens, matched_blocks = query.hashes, query.prompt_tokens, query.matched_blocks
    shared_blocks, shared_stored_on = query.shared_blocks, query.shared_stored_on
    disk_blocks, session = query.disk_blocks, query.session_worker
    if not loads:
        raise NoWorkerAvailable("no worker is accepting requests: add a worker or retry")
    weight, cache_weight = config.decode_weight_tokens, config.cache_weight - 1.0
    shared_gain = config.shared_weight - 1.0
    cap = max(0, prompt_tokens - 1)  # reusable_tokens, inlined: this is the hot path
    get = matched_blocks.get
    matched = []
    for load in loads:
        m = get(load.worker_id, 0) * block_size
        matched.append(m if m < cap else cap)
    by_match = sorted(matched)
    best_match = by_match[-1]
    second = by_match[-2] if len(by_match) > 1 else 0
    known = min(shared_blocks * block_size, cap)
    shared = max(second, known)
    least_recent = min(map(_recent, loads))
    balance = config.balance_weight * recent_scale
    rows = []
    cheapest, cheapest_key = None, None
    for load, m in zip(loads, matched):
        load_tokens = int(load.queued_prefill_tokens + weight * load.running_decodes
                          + balance * (load.recent_prefill_tokens - least_recent))
        affinity = m - shared
        score = load_tokens + prompt_tokens - m - (cache_weight * affinity if affinity > 0 else 0)
        if shared_gain and load.worker_id in shared_stored_on:
            held = (m if m < known else known) - second  # of the shared prefix, only here
            if held > 0:
                score -= shared_gain * held
        if disk_blocks and load.worker_id in disk_blocks:
            cost = load.disk_token_cost
            if cost is None:
                cost = config.disk_token_cost
            score += cost * min(m, disk_blocks[load.worker_id] * block_size)
        row = (load.worker_id, m, load_tokens, score)
        rows.append(row)
        # lowest score; then more matched; then the session's worker; then by id
        key = (score, -m, load.worker_id != session, load.worker_id)
        if cheapest_key is None or key < cheapest_key:
            cheapest, cheapest_key = row, key
    if best_match > shared:
        chosen = cheapest
        reason = Reason.PREFIX_MATCH if chosen[1] == best_match else Reason.LOAD_SPILL
    else:
        key = hashes[min(-(-shared // block_size), len(hashes) - 1)]
        ids = [load.worker_id for load in loads]
        chosen = None
        homes = ([session] if session in ids and rows[ids.index(session)][1] == best_match
                 else rendezvous(key, ids, seed, HOME_CHOICES))
        for home in homes:
            row = rows[ids.index(home)]
            if chosen is None or row[3] < chosen[3]:  # a tie keeps the first (highest weight)
                chosen = row
        reason = Reason.COLD_HASH
        tolerance = min(config.cold_spill_tokens, prompt_tokens - shared)
        if chosen[3] - cheapest[3] > tolerance:
            chosen, reason = cheapest, Reason.COLD_SPILL
    worker_id, matched_tokens, _, _ = chosen
    return RoutingDecision(worker_id, reason, matched_tokens, prompt_tokens,
                           CandidateRows(tuple(rows)))


def _recent(load: WorkerLoad) -> float:
    return load.recent_prefill_tokens


def with_pull(config: PolicyConfig, decision: RoutingDecision, loads: Sequence[WorkerLoad],
              links: PeerLinks, prefill_tokens_s: Mapping[str, float], block_size: int,
              pulls_served: Mapping[str, int] | None = None) -> RoutingDecision:
    """``decision``, or the worker and pull that beat it (the rule under Pulls, above);
    ``loads`` are the candidates' (the same workers as ``decision.candidates``),
    ``pulls_served`` the pulls each worker serves now (absent: none)."""
    queue = {load.worker_id: load.queued_prefill_tokens
             + config.decode_weight_tokens * load.running_decodes for load in loads}
    serving = pulls_served or {}
    rows = [Row(c.worker_id, c.matched_tokens, queue[c.worker_id], serving.get(c.worker_id, 0))
            for c in decision.candidates]
    found = best_pull(rows, decision.worker_id, decision.prompt_tokens, block_size, links,
                      prefill_tokens_s)
    if found is None:
        return decision
    worker_id, pull = found
    cached = min(pull.blocks * block_size, max(0, decision.prompt_tokens - 1))
    return RoutingDecision(worker_id, Reason.LOAD_SPILL, cached, decision.prompt_tokens,
                           decision.candidates, pull)
