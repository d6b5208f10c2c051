"""orchard's routing policy: prefill saved against load carried, decided as data.

Inputs per candidate worker (draining workers are never candidates):

- ``matched_tokens``: tokens of the prompt it would not prefill (its matched full blocks,
  held or just routed there, capped by ``reusable_tokens`` so the suffix is never empty);
- ``load_tokens``: the work already ahead of a new request there, in prefill tokens:
  ``queued_prefill_tokens + decode_weight_tokens x running_decodes``.

Algorithm:

1. ``cost(w) = load_tokens(w) + prompt_tokens - matched_tokens(w)``: the prefill work that
   stands between the request and its first token on ``w`` (a TTFT proxy in tokens).
2. The **home** worker. If some worker matches more than the prefix every candidate holds
   (say a shared system prompt), home is the one matching most (lowest cost among equals):
   reason ``prefix_match``. Otherwise the prefix is cold: home is the rendezvous-hash winner
   of the chain up to the first block not held everywhere (``hashes[common]``), so a new
   shared prefix lands on one worker: reason ``cold_hash``. Rendezvous (highest random weight)
   moves only the keys of a worker that joins or leaves.
3. **Spill.** If ``cost(home) - min cost > spill_tokens``, the request goes to the cheapest
   worker instead (reason ``load_spill``; ``cold_spill`` for a cold prefix), ties broken by
   more matched tokens then by worker id. The margin keeps affinity while the home's queue is
   merely busy: every spill duplicates a prefix in a second cache and fragments the next
   turns of a conversation, so it must buy a real TTFT gain.

Defaults, chosen by replaying the Mooncake conversation trace and a synthetic trace of a
different shape (see ``docs/benchmarks.md``, ``## Router``):

- ``spill_tokens = 16384``: ~32 blocks, about one long prompt's prefill; a smaller margin
  spills on ordinary queue noise and loses hits, a larger one lets one hot conversation's
  worker build a queue that shows in TTFT p99.
- ``cold_spill_tokens = 4096``: a cold prefix has nothing cached to lose, so it spills on a
  smaller queue gap (pending entries still keep its siblings together).
- ``decode_weight_tokens = 64``: a running decode slows chunked prefill slightly; it counts
  as a small amount of prefill work.

Deterministic: ties break by worker id and the rendezvous hash is seeded.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import xxhash

from router.key import BlockHash


class NoWorkerAvailable(Exception):
    """No worker can take a request now (none registered, or all draining): retry later.

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
    decode_weight_tokens: int = 64
    balance_weight: float = 0.25
    balance_half_life_s: float = 300.0

    def __post_init__(self) -> None:
        values = {"cache_weight": self.cache_weight, "cold_spill_tokens": self.cold_spill_tokens,
                  "decode_weight_tokens": self.decode_weight_tokens,
                  "balance_weight": self.balance_weight}
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


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    matched_tokens: int
    load_tokens: int
    score: float  # cost in prefill tokens ahead of the first token; lower is better


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    worker_id: str
    reason: Reason
    expected_cached_tokens: int
    prompt_tokens: int
    candidates: tuple[Candidate, ...]


def rendezvous(key: BlockHash, workers: Sequence[str], seed: int) -> str:
    """Highest-random-weight choice of a worker for ``key`` (stable under churn)."""
    prefix = key.to_bytes(16, "little") + seed.to_bytes(8, "little", signed=True)
    digest = xxhash.xxh3_64_intdigest
    return max((digest(prefix + w.encode()), w) for w in workers)[1]


def decide(
    config: PolicyConfig,
    block_size: int,
    hashes: Sequence[BlockHash],
    prompt_tokens: int,
    matched_blocks: dict[str, int],
    loads: Sequence[WorkerLoad],
    seed: int,
    shared_blocks: int = 0,
    recent_scale: float = 1.0,
) -> RoutingDecision:
    """Choose a worker among ``loads`` (the eligible workers) for one prompt.

    ``hashes`` is the prompt's chain (at least one entry: the namespace root stands in for a
    prompt shorter than a block); ``matched_blocks`` the index's answer for it;
    ``shared_blocks`` how many leading blocks are a known shared prefix.
    """
    if not loads:
        raise NoWorkerAvailable("no worker is accepting requests: add a worker or retry")
    weight, cache_weight = config.decode_weight_tokens, config.cache_weight - 1.0
    cap = max(0, prompt_tokens - 1)  # reusable_tokens, inlined: this is the hot path
    get = matched_blocks.get
    matched = []
    for load in loads:
        m = get(load.worker_id, 0) * block_size
        matched.append(m if m < cap else cap)
    by_match = sorted(matched)
    best_match = by_match[-1]
    shared = by_match[-2] if len(by_match) > 1 else 0
    shared = max(shared, min(shared_blocks * block_size, cap))
    least_recent = min(load.recent_prefill_tokens for load in loads)
    balance = config.balance_weight * recent_scale
    candidates = []
    for load, m in zip(loads, matched):
        load_tokens = int(load.queued_prefill_tokens + weight * load.running_decodes
                          + balance * (load.recent_prefill_tokens - least_recent))
        affinity = m - shared
        score = load_tokens + prompt_tokens - m - (cache_weight * affinity if affinity > 0 else 0)
        candidates.append(Candidate(load.worker_id, m, load_tokens, score))
    if best_match > shared:
        chosen = min(candidates, key=_by_score)
        reason = Reason.PREFIX_MATCH if chosen.matched_tokens == best_match else Reason.LOAD_SPILL
    else:
        key = hashes[min(-(-shared // block_size), len(hashes) - 1)]
        home_id = rendezvous(key, [c.worker_id for c in candidates], seed)
        chosen = next(c for c in candidates if c.worker_id == home_id)
        reason = Reason.COLD_HASH
        cheapest = min(candidates, key=_by_score)
        if chosen.score - cheapest.score > config.cold_spill_tokens:
            chosen, reason = cheapest, Reason.COLD_SPILL
    return RoutingDecision(chosen.worker_id, reason, chosen.matched_tokens, prompt_tokens,
                           tuple(candidates))


def _by_score(c: Candidate) -> tuple[float, int, str]:
    return (c.score, -c.matched_tokens, c.worker_id)


def _by_load(c: Candidate) -> tuple[int, str]:
    return (c.load_tokens, c.worker_id)
