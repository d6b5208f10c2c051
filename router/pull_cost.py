"""What a prefix pulled from a peer costs, and when it beats waiting or recomputing.

The rule (``router.policy`` states it in its header, with these defaults) compares, for each
candidate worker ``w``, its time to first token in tokens of prefill on ``w``::

    without a pull   ttft(w)      = queue(w) + prompt - matched(w)
    with a pull      ttft_pull(w) = queue(w) + prompt - matched(h)
                                    + pull_s(h -> w, (matched(h) - matched(w)) tokens)
                                      x prefill_tokens_s(w)
    pull_s(h -> w, n) = fixed_s(h, w) + n x bytes_per_token / bytes_s(h, w)

where ``queue(w)`` is the prefill ahead of a new request there (queued prefill and running
decodes, as ``router.policy`` weighs them) and ``h``, the source, is the candidate with spare
capacity (below) holding the longest match (ties: the shorter queue, then by id). The request
goes to the ``w`` with the lowest ``ttft_pull(w)`` with a pull when that is lower than the
policy's own choice's ``ttft``; otherwise nothing changes. A pull of less than
``MIN_PULL_BLOCKS`` is never planned (its fixed cost is all it would carry).

Spare capacity. A holder serves a pull between its engine steps, one window's encoding at a
time, so each pull it serves slows its own decodes: by ``PULL_TPOT_COST = 0.085`` of their
TPOT, measured (``orchard bench pull``'s ``holder_tpot_during_pull_over_alone``, 1.085 with
pulls served back to back on an idle machine, both workers on it: an upper bound). A pull may slow the
holder's decodes by at most ``HOLDER_SLOWDOWN_BOUND = 1.10``, so a holder serves at most
``MAX_PULLS_PER_SOURCE = floor((1.10 - 1) / 0.085) = 1`` pull at a time: a holder already
serving that many (planned pulls from it whose requests have not produced their first token,
``Row.pulls_served``) is no source, and the longest match among the others is.

Links. Each (holder, receiver) pair's rate starts at the defaults below and follows what
the pulls between them measured: the receiver measures each of its pulls (its
``PullOutcome``: bytes over wall time, ``cluster.backend.link_meter``) and reports the pair's
figures with its block events (``LinkMeasure``), which the router takes as they come:
a pull of at least ``BANDWIDTH_PULL_BYTES`` updates the bandwidth (its bytes over its time
less the fixed cost), a smaller one the fixed cost (its time less its bytes at the
bandwidth), each a moving average with weight ``SMOOTHING`` for the new figure.

Defaults (until measured):

- ``DEFAULT_BYTES_S = 1.1e9``: 10 GbE's payload rate, the link between Macs in a rack.
- ``DEFAULT_FIXED_S = 0.002``: a TCP connect, the nonce and HMAC round trip and the first
  window's request on a LAN, about 4 round trips of 0.5 ms.
- ``DEFAULT_PREFILL_TOKENS_S = 6000``: the simulator's prefill rate; a worker that reports its
  own (``WorkerRates.prefill_tokens_s``) is costed at that.
- ``MIN_PULL_BLOCKS = 1``, ``SMOOTHING = 0.3``, ``BANDWIDTH_PULL_BYTES = 1 MiB``.
- ``MAX_PULLS_PER_SOURCE = 1`` (from ``PULL_TPOT_COST = 0.085`` and ``HOLDER_SLOWDOWN_BOUND =
  1.10``, under Spare capacity).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

DEFAULT_BYTES_S = 1.1e9
DEFAULT_FIXED_S = 0.002
DEFAULT_PREFILL_TOKENS_S = 6000.0
MIN_PULL_BLOCKS = 1
PULL_TPOT_COST = 0.085          # a holder's decode TPOT grows by this while it serves a pull
HOLDER_SLOWDOWN_BOUND = 1.10   # the most a holder's pulls may slow its decodes
MAX_PULLS_PER_SOURCE = int((HOLDER_SLOWDOWN_BOUND - 1) / PULL_TPOT_COST + 1e-9)
SMOOTHING = 0.3
BANDWIDTH_PULL_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LinkRate:
    """One direction of one link: bandwidth and a fixed cost per pull."""

    bytes_s: float
    fixed_s: float

    def __post_init__(self) -> None:
        if self.bytes_s <= 0 or self.fixed_s < 0:
            raise ValueError(f"a link needs bytes_s > 0 and fixed_s >= 0, got {self.bytes_s} "
                             f"and {self.fixed_s}")

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bytes_s


DEFAULT_LINK = LinkRate(DEFAULT_BYTES_S, DEFAULT_FIXED_S)


@dataclass(frozen=True, slots=True)
class PullChoice:
    """A pull the router planned: the request's worker takes ``blocks`` from ``source``."""

    source: str
    blocks: int          # the prompt's first ``blocks`` blocks are held after the pull
    tokens: int          # tokens pulled (those the receiver lacked)
    predicted_s: float   # predicted pull time


@dataclass(frozen=True, slots=True)
class Row:
    """What the choice reads of one candidate (``router.policy.Candidate``'s fields)."""

    worker_id: str
    matched_tokens: int
    load_tokens: int   # its queue: the prefill ahead of a new request there
    pulls_served: int = 0   # pulls it serves now (planned from it, not yet prefilled)


class PeerLinks:
    """The router's view of the links between workers, per (holder, receiver) pair."""

    def __init__(self, bytes_per_token: int, default: LinkRate = DEFAULT_LINK) -> None:
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
        self.bytes_per_token = bytes_per_token
        self.default = default
        self._links: dict[tuple[str, str], LinkRate] = {}

    def rate(self, holder: str, receiver: str) -> LinkRate:
        return self._links.get((holder, receiver), self.default)

    def set(self, holder: str, receiver: str, rate: LinkRate) -> None:
        """The pair's rate as the receiver measured it (its ``LinkMeasure``)."""
        self._links[(holder, receiver)] = rate

    def forget(self, worker_id: str) -> None:
        """A worker left: its links go with it."""
        for pair in [p for p in self._links if worker_id in p]:
            del self._links[pair]

    def links(self) -> Mapping[tuple[str, str], LinkRate]:
        return dict(self._links)


def observed(now: LinkRate, nbytes: int, seconds: float) -> LinkRate:
    """``now`` after a pull that moved ``nbytes`` in ``seconds`` (the rule under Links, in the
    module's header); a pull that moved nothing, or took no time, leaves it as it was."""
    if nbytes <= 0 or seconds <= 0:
        return now
    if nbytes >= BANDWIDTH_PULL_BYTES:
        moving = max(seconds - now.fixed_s, seconds / 2)   # never a negative time
        return LinkRate((1 - SMOOTHING) * now.bytes_s + SMOOTHING * nbytes / moving, now.fixed_s)
    fixed = max(0.0, seconds - nbytes / now.bytes_s)
    return LinkRate(now.bytes_s, (1 - SMOOTHING) * now.fixed_s + SMOOTHING * fixed)


def best_pull(rows: Sequence[Row], chosen: str, prompt_tokens: int, block_size: int,
              links: PeerLinks, prefill_tokens_s: Mapping[str, float]
              ) -> tuple[str, PullChoice] | None:
    """The worker and the pull that beat the policy's choice ``chosen``, if any (the rule in
    the module's header)."""
    spare = [r for r in rows if r.pulls_served < MAX_PULLS_PER_SOURCE]
    if not spare:
        return None
    source = min(spare, key=lambda r: (-r.matched_tokens, r.load_tokens, r.worker_id))
    held = source.matched_tokens
    by_id = {r.worker_id: r for r in rows}
    mine = by_id[chosen]
    best_ttft = mine.load_tokens + prompt_tokens - mine.matched_tokens
    best: tuple[float, str, PullChoice] | None = None
    for row in rows:
        lacking = (held - row.matched_tokens) // block_size
        if row.worker_id == source.worker_id or lacking < MIN_PULL_BLOCKS:
            continue
        tokens = lacking * block_size
        seconds = links.rate(source.worker_id, row.worker_id).seconds(
            tokens * links.bytes_per_token)
        rate = prefill_tokens_s.get(row.worker_id, DEFAULT_PREFILL_TOKENS_S)
        ttft = row.load_tokens + prompt_tokens - (row.matched_tokens + tokens) + seconds * rate
        if ttft < best_ttft and (best is None or (ttft, row.worker_id) < best[:2]):
            blocks = (row.matched_tokens + tokens) // block_size
            best = (ttft, row.worker_id, PullChoice(source.worker_id, blocks, tokens, seconds))
    return None if best is None else (best[1], best[2])
