"""The two cache TTLs side by side on a workload: what a 5-minute and a 1-hour write cost.

A write kept an hour costs more than one kept five minutes (``cache_write_1h`` = 2.0 against
``cache_write_5m`` = 1.25 uncached input tokens in ``router/prices.toml``; a read 0.1). The
hour pays off when prefixes are read again after five minutes (and within the hour) often
enough: such a re-read is a read under the 1-hour TTL but a miss and a fresh write under the
5-minute one. Per token of block written at the 1-hour TTL, with ``L`` late re-reads for
each such write::

    cost(5m) - cost(1h) = (w_5m - r) * L - (w_1h - w_5m)     per token written at 1 h
    break-even          L* = (w_1h - w_5m) / (w_5m - r)      = 0.75 / 1.15 = 0.652

so the hour pays off when the workload has more than 0.652 late re-reads per 1-hour write.

The workload is replayed on one cache with no capacity limit and no queue (the planner's
ideal cluster, ``router.sim.planner.ideal_goodput``): at each request's arrival, its leading
full blocks whose last use is less than the TTL ago are read, the rest of its full blocks
written, its partial tail computed (``router.kv.key.reusable_tokens``: at least one token is
always computed). A block's last use is its last request, read or written (the stores' TTL
is from last use), so both TTLs see the same gaps and only which gaps count as hits differs.
Chained ids make the held blocks a prefix: a block's parent is used whenever it is.

Capacity is what the planner's grid replays; this comparison is the TTL's price alone, and
``M`` here is a floor that capacity evictions only raise, for both TTLs alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router.kv.key import reusable_tokens

from router.cost import FIVE_MINUTES_S, Rates, TokenUsage, total_usage
from router.sim.trace import TraceRequest

ONE_HOUR_S = 3600.0


@dataclass(frozen=True, slots=True)
class TtlComparison:
    """The workload priced at each TTL, and what decides between them (module doc)."""

    requests: int
    input_tokens: int
    short: TokenUsage         # the whole workload's usage at the 5-minute TTL
    long: TokenUsage          # at the 1-hour TTL
    short_multiplier: float   # M at 5 minutes
    long_multiplier: float    # M at 1 hour
    reread_tokens: int        # block tokens used again, after any gap
    late_reread_tokens: int   # of them, after 5 minutes and within the hour
    break_even: float         # late re-read tokens per 1-hour written token where both cost alike

    @property
    def late_share(self) -> float:
        """The share of re-reads that arrive after 5 minutes (and within the hour)."""
        return self.late_reread_tokens / self.reread_tokens if self.reread_tokens else 0.0

    @property
    def late_per_write(self) -> float:
        """Late re-read tokens per token written at the 1-hour TTL."""
        written = self.long.written_tokens
        return self.late_reread_tokens / written if written else 0.0

    @property
    def recommended_ttl_s(self) -> float:
        """The TTL of the lower M; on a tie the 5-minute one (it holds memory for less long)."""
        return ONE_HOUR_S if self.long_multiplier < self.short_multiplier else FIVE_MINUTES_S

    def cost_per_request(self, long: bool) -> float:
        """Input cost per request, in uncached input tokens."""
        m = self.long_multiplier if long else self.short_multiplier
        return m * self.input_tokens / self.requests

    def as_json(self) -> dict:
        return {"ttls_s": [FIVE_MINUTES_S, ONE_HOUR_S],
                "m_5m": round(self.short_multiplier, 4), "m_1h": round(self.long_multiplier, 4),
                "cost_per_request_5m": round(self.cost_per_request(False), 2),
                "cost_per_request_1h": round(self.cost_per_request(True), 2),
                "reread_tokens": self.reread_tokens,
                "late_reread_tokens": self.late_reread_tokens,
                "late_reread_share": round(self.late_share, 4),
                "late_rereads_per_1h_write": round(self.late_per_write, 4),
                "break_even_rereads_per_1h_write": round(self.break_even, 4),
                "recommended_ttl_s": self.recommended_ttl_s}


def break_even(rates: Rates) -> float:
    """Late re-reads per 1-hour write at which the two TTLs cost the same (module doc)."""
    extra = rates.cache_write_1h - rates.cache_write_5m
    saved = rates.cache_write_5m - rates.cache_read
    if saved <= 0:
        # a 5-minute write no dearer than a read: re-writing late costs nothing extra
        return float("inf")
    return max(0.0, extra) / saved


def _usages(trace: Sequence[TraceRequest], ttl_s: float, block: int) -> list[TokenUsage]:
    last: dict[int, float] = {}
    out = []
    for r in trace:
        full = min(len(r.hash_ids), r.input_length // block)
        held = 0
        while held < full and r.arrival_s - last.get(r.hash_ids[held], -ttl_s) < ttl_s:
            held += 1
        cached = reusable_tokens(r.input_length, held, block)
        out.append(TokenUsage(r.input_length, cached, (full - held) * block))
        for h in r.hash_ids[:full]:
            last[h] = r.arrival_s
    return out


def _rereads(trace: Sequence[TraceRequest], block: int) -> tuple[int, int]:
    """(re-read block tokens, those after 5 minutes and within the hour)."""
    last: dict[int, float] = {}
    reread = late = 0
    for r in trace:
        for h in r.hash_ids[:min(len(r.hash_ids), r.input_length // block)]:
            if h in last:
                reread += block
                late += block if FIVE_MINUTES_S <= r.arrival_s - last[h] < ONE_HOUR_S else 0
            last[h] = r.arrival_s
    return reread, late


def compare_ttls(trace: Sequence[TraceRequest], rates: Rates, block: int) -> TtlComparison:
    """The workload at a 5-minute and a 1-hour TTL; ``block``: tokens per trace block id."""
    if not trace:
        raise ValueError("the workload has no requests: nothing to compare the TTLs on")
    if block <= 0:
        raise ValueError(f"block must be positive tokens per block id, got {block}")
    short = total_usage(_usages(trace, FIVE_MINUTES_S, block))
    long = total_usage(_usages(trace, ONE_HOUR_S, block))
    reread, late = _rereads(trace, block)
    return TtlComparison(len(trace), short.input_tokens, short, long,
                         short.multiplier(rates, FIVE_MINUTES_S),
                         long.multiplier(rates, ONE_HOUR_S), reread, late, break_even(rates))
