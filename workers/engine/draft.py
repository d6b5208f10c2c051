"""Prompt-lookup drafts: what each running request proposes to the verify pass, and when.

**The draft.** A request's history is its prompt and its output so far. Its last ``n`` tokens
(``n`` = 4, 3, 2, 1, longest first) are looked up among its earlier ``n``-grams; the tokens
that followed the most recent earlier occurrence are the draft, up to ``k`` of them (a copy
that runs into the present repeats: a request that loops drafts its loop). Batch
jobs that quote, correct, reformat or edit their prompt copy long spans of it, and there the
drafts are what the model writes. The lookup is an index of every ``n``-gram to the position
after its latest occurrence, updated as tokens arrive: a draft costs four dict reads.

**Per request: how likely its drafts are.** Each request keeps, per draft position ``j``,
the chance ``q_j`` that its token is accepted once every token before it was (a moving
average over the passes that reached ``j``; a new request starts where the engine's recent
passes stand: ``Prior``, 0.5 before the first), so a draft of ``n`` tokens is expected to
yield ``q_1 + q_1 q_2 + ... + q_1 ... q_n`` of them. A chance per position, not one for
every token: a copy is all or nothing, so a request's first draft token is often the doubtful
one and the rest follow it. After ``GIVE_UP`` (3) passes in a row that accept none of its
drafts the request stops drafting for ``pause`` steps, which doubles at each give-up (16, 32,
... up to 256 steps): a request with nothing to copy soon drafts nothing, and one that
reaches a copyable span later still finds it.

**Per step: the width (``SpecCost``).** The verify pass is one rectangle, every row padded to
the widest draft ``w``, and a pad costs what a draft costs. A pass of ``b`` rows at width
``w`` takes ``T_b + b w X_w`` seconds (``T_b`` a plain step of ``b`` rows, ``X_w`` an extra
position at width ``w``: moving averages, per row count and per width, the nearest row
count's and any width's until that one is measured) and yields ``b + A(w)`` tokens, ``A(w)``
the rows' expected accepted drafts with each draft cut to ``w``. The step takes the ``w`` (0
to ``max_k``) with the most tokens per second; ``w`` = 0, a plain step, when no width beats
``b / T_b`` by ``MARGIN``. So every
row drafts what its lookup finds, up to ``w``: a row that pads instead of drafting pays the
same. Until ``T`` and ``X`` are measured a step drafts at full width, so the first verify
passes measure ``X``; later probes (after ``PROBE_AFTER`` declined steps) run at width 1.
With a draft model (``workers.engine.draft_model``) ``X`` also counts drafting, measured per
draft position (one draft pass for the whole batch), and the width is chosen before any draft
pass runs: a step that would not pay runs none. A draft model always proposes, so after
``PLAIN_EVERY`` (32) verify passes in a row a step is plain, which measures ``T``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from workers.engine.draft_model import DraftModel
from workers.rates import EMA_WEIGHT, moving_average

NGRAMS = (4, 3, 2, 1)   # lookup lengths, longest first
GIVE_UP = 3             # passes in a row that accept nothing before a request pauses
FIRST_PAUSE = 16        # steps
LONGEST_PAUSE = 256
MAX_K = 8
FIRST_P = 0.5           # a new request's per-token acceptance, before its first pass
# With a draft model, at most this many verify passes in a row before a plain step: a draft
# model always proposes, so without it a plain step (``T``) might never be measured and the
# cost rule never asked. One step in 33 plain costs speculation at most 3%.
PLAIN_EVERY = 32
# After this many steps in a row that had drafts and ran plain, one verify pass of width
# PROBE_WIDTH measures ``X`` again (a slow pass, or a busy machine, may have set it too high):
# at most one pass in 33 that does not pay, and the narrowest (at 8 drafts a probe of 8 rows
# is about a step of 72, 4 plain steps on this CPU; at 1, about 1.4).
PROBE_AFTER = 32
PROBE_WIDTH = 1
# A new request's acceptance starts at the moving average of the engine's recent rows (each
# row's pass weighted PRIOR_WEIGHT): a chat job's short requests, which find little to copy,
# start where the ones before them ended instead of at FIRST_P each time.
PRIOR_WEIGHT = 0.05
# A verify pass must beat plain decoding's tokens per second by this share: its cost and its
# yield are both estimates, and the width with the best estimate is the one most likely
# overestimated; a pass that gains less than this is not worth the risk.
MARGIN = 0.03


def _expected(q: Sequence[float], n: int) -> list[float]:
    """Accepted tokens expected of a draft cut to each length 1 to ``n``, ``q[j]`` the chance
    that draft token ``j + 1`` is accepted once every token before it was."""
    total, reach, out = 0.0, 1.0, []
    for j in range(n):
        reach *= q[j]
        total += reach
        out.append(total)
    return out


def _learn(q: list[float], drafted: int, accepted: int, weight: float) -> None:
    """A pass took ``accepted`` of ``drafted``: each position it reached (every accepted one
    and the first rejected) moves its chance toward what happened there."""
    for j in range(min(accepted + 1, drafted)):
        q[j] += weight * ((j < accepted) - q[j])


@dataclass(slots=True)
class Pace:
    """One request's acceptance and draft counts (whatever proposes its drafts)."""

    max_k: int
    drafted: int = 0        # drafts sent to verify passes
    accepted: int = 0       # of those, accepted
    # per draft position j: the chance that token j + 1 is accepted, given the ones before
    # (a moving average over the passes that reached it)
    q: list[float] = field(default_factory=lambda: [FIRST_P] * MAX_K)
    _misses: int = 0        # passes in a row that accepted nothing
    _pause: int = 0         # steps left without drafting
    _next_pause: int = FIRST_PAUSE

    def expected(self, n: int) -> list[float]:
        """The accepted tokens a draft is expected to yield, cut to each length 1 to ``n``:
        ``q1``, ``q1 + q1 q2``, ... ``q1 + ... + q1 ... qn``."""
        return _expected(self.q, n)

    def allowance(self, limit: int) -> int:
        """How many tokens the request may draft this step: ``min(max_k, limit)``, none
        while paused (a step asked counts down the pause)."""
        k = min(self.max_k, limit)
        if k <= 0:
            return 0
        if self._pause:
            self._pause -= 1
            return 0
        return k

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify pass took ``accepted`` of the ``drafted`` tokens this request proposed."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        _learn(self.q, drafted, accepted, EMA_WEIGHT)
        self._misses = self._misses + 1 if accepted == 0 else 0
        if self._misses >= GIVE_UP:
            self._misses = 0
            self._pause = self._next_pause
            self._next_pause = min(LONGEST_PAUSE, 2 * self._next_pause)


@dataclass(slots=True)
class Prior:
    """Where a new request's acceptance starts: the chances ``Pace`` keeps, over every row's
    passes in the engine, each pass weighted ``PRIOR_WEIGHT``."""

    q: list[float] = field(default_factory=lambda: [FIRST_P] * MAX_K)

    def verified(self, drafted: int, accepted: int) -> None:
        _learn(self.q, drafted, accepted, PRIOR_WEIGHT)

    def pace(self, max_k: int) -> Pace:
        return Pace(max_k, q=list(self.q))


@dataclass(slots=True)
class PromptLookup:
    """One request's history and the index of its ``n``-grams."""

    history: list[int] = field(default_factory=list)
    _index: dict[tuple[int, ...], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tokens, self.history = self.history, []
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Tokens the request now holds (its prompt, then each step's output)."""
        h = self.history
        for t in tokens:
            h.append(t)
            end = len(h) - 1  # the n-grams ending before t are now followed by t
            for n in NGRAMS:
                if end >= n:
                    self._index[tuple(h[end - n:end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the history's
        longest matching suffix (a copy that runs into the present repeats, as a copy of
        itself does: ``a b a b`` drafts ``a b a b ...``); none with nothing to match."""
        if k <= 0:
            return []
        h = self.history
        for n in NGRAMS:
            if len(h) > n:
                at = self._index.get(tuple(h[-n:]))
                if at is not None:
                    span = h[at:at + k]
                    if len(span) < k:  # the copy reaches the present: it repeats itself
                        span = (span * (k // len(span) + 1))[:k]
                    return span
        return []


@dataclass(slots=True)
class SpecCost:
    """Whether a step's drafts pay for their verify pass, from measured step times."""

    _plain_s: float = 0.0           # moving average of a plain step (any row count)
    _extra_s: float = 0.0           # moving average of a verify pass's cost per extra position
    _draft_s: float = 0.0           # moving average of drafting's cost per draft position
    plain_every: int = 0            # verify passes in a row before a plain step; 0: no limit
    _passes: int = 0                # verify passes since the last plain step
    _declined: int = 0              # steps in a row that had drafts and ran plain
    _widths: set[int] = field(default_factory=set)  # widths passed at least once
    _plain_at: dict[int, float] = field(default_factory=dict)  # a plain step, per row count
    _extra_at: dict[int, float] = field(default_factory=dict)  # the extra position, per width

    def plain(self, rows: int) -> float:
        """A plain step of ``rows`` rows: measured at that count, else at the nearest one."""
        if rows in self._plain_at:
            return self._plain_at[rows]
        if not self._plain_at:
            return self._plain_s
        return self._plain_at[min(self._plain_at, key=lambda r: (abs(r - rows), r))]

    def pass_s(self, rows: int, width: int) -> float:
        """A verify pass of ``rows`` rows at ``width``: a plain step and ``rows x width``
        extra positions, each at that width's measured cost (the cost of any width until
        this one is measured), and drafting's ``width`` positions."""
        extra = self._extra_at.get(width, self._extra_s)
        return self.plain(rows) + width * (rows * extra + self._draft_s)

    def width(self, rows: int, expected: Sequence[float]) -> int:
        """The verify pass's width for a step of ``rows`` rows, ``expected[w - 1]`` the
        drafts its rows are expected to have accepted at width ``w``: the one that yields the
        most tokens per second, 0 (a plain step) when none beats plain decoding by
        ``MARGIN``."""
        if not expected:
            return 0
        if self.plain_every and self._passes >= self.plain_every:
            return 0  # a plain step now, to measure one
        if not (self._plain_s and self._extra_s):
            return len(expected)  # not measured yet: the pass itself measures it
        best, best_rate = 0, (1 + MARGIN) * rows / self.plain(rows)
        for w, accepted in enumerate(expected, 1):
            rate = (rows + accepted) / self.pass_s(rows, w)
            if rate > best_rate:
                best, best_rate = w, rate
        if best:
            return best
        self._declined += 1
        if self._declined > PROBE_AFTER:  # measure again: ``X`` may have been one slow pass
            return min(PROBE_WIDTH, len(expected))
        return 0

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows and ``width`` drafts each took ``seconds``."""
        self._passes = self._passes + 1 if width else 0
        if width:
            self._declined = 0
        if width == 0:
            self._plain_s = moving_average(self._plain_s, seconds)
            self._plain_at[rows] = moving_average(self._plain_at.get(rows), seconds)
        elif width not in self._widths:
            self._widths.add(width)  # the first pass of a shape: MLX's warm-up, not its cost
        elif self._plain_s:
            extra = max(seconds - self.plain(rows), 0.0) / (rows * width) or 1e-12
            self._extra_s = moving_average(self._extra_s, extra)
            self._extra_at[width] = moving_average(self._extra_at.get(width), extra)

    def observe_draft(self, width: int, seconds: float) -> None:
        """Drafting ``width`` tokens a row took ``seconds`` (a draft model's passes: one a
        position for the whole batch; a prompt lookup's reads: next to nothing)."""
        if width:
            self._draft_s = moving_average(self._draft_s, seconds / width)


@dataclass(frozen=True, slots=True)
class SpecStats:
    """An engine's decode steps so far: plain steps and verify passes, their time, the drafts
    verified and accepted (what ``orchard bench spec`` reports)."""

    plain_steps: int
    plain_s: float
    verify_passes: int
    verify_s: float
    drafted: int
    accepted: int
    draft_s: float = 0.0    # time spent drafting (a draft model's passes, its catch-up)


class Speculation:
    """The engine's drafting: one ``Pace`` per running row, one ``SpecCost``, and the drafts'
    source: each row's ``PromptLookup``, or a draft model's batched passes
    (``workers.engine.draft_model``) when the engine has one."""

    def __init__(self, max_k: int, model: DraftModel | None = None) -> None:
        if not 1 <= max_k <= MAX_K:
            raise ValueError(f"speculate_max_k must be 1 to {MAX_K}, got {max_k}")
        self.max_k = max_k
        self.cost = SpecCost(plain_every=PLAIN_EVERY if model is not None else 0)
        self._model = model
        self._paces: dict[int, Pace] = {}
        self._lookups: dict[int, PromptLookup] = {}  # without a draft model
        self._steps = [0, 0.0, 0, 0.0]  # plain steps, their seconds, verify passes, seconds
        self._drafted = self._accepted = 0
        self._draft_s = 0.0
        self._prior = Prior()

    def stats(self) -> SpecStats:
        plain, plain_s, passes, verify_s = self._steps
        return SpecStats(plain, plain_s, passes, verify_s, self._drafted, self._accepted,
                         self._draft_s)

    def observe_step(self, rows: int, width: int, seconds: float, draft_s: float = 0.0
                     ) -> None:
        """A decode step of ``rows`` rows and ``width`` drafts each took ``seconds``, after
        ``draft_s`` of drafting."""
        self.cost.observe(rows, width, seconds)
        self.cost.observe_draft(width, draft_s)
        at = 2 if width else 0
        self._steps[at] += 1
        self._steps[at + 1] += seconds
        self._draft_s += draft_s

    def join(self, uid: int, prompt: list[int], first: int) -> None:
        """Row ``uid`` drafts from its prompt and first token on."""
        self._paces[uid] = self._prior.pace(self.max_k)
        if self._model is not None:
            self._model.join(uid, prompt, first)
        else:
            self._lookups[uid] = PromptLookup([*prompt, first])

    def leave(self, uid: int) -> None:
        self._paces.pop(uid, None)
        self._lookups.pop(uid, None)
        if self._model is not None:
            self._model.leave(uid)

    def drafts(self, limits: dict[int, int]) -> dict[int, list[int]]:
        """Each joined row's draft (``limits``: the most tokens worth drafting per row), cut
        to the step's width, or none at all when no verify pass would pay for itself."""
        plan = {uid: self._paces[uid].allowance(limit) for uid, limit in limits.items()
                if uid in self._paces}
        if self._model is None:
            drafts = {uid: self._lookups[uid].propose(k) for uid, k in plan.items()}
            drafts = {uid: d for uid, d in drafts.items() if d}
            plan = {uid: len(d) for uid, d in drafts.items()}
        plan = {uid: n for uid, n in plan.items() if n}
        widest = max(plan.values(), default=0)
        expected = [0.0] * widest   # the rows' expected accepted drafts at each width
        for uid, n in plan.items():
            run = self._paces[uid].expected(n)
            for w in range(widest):
                expected[w] += run[min(w, n - 1)]
        width = self.cost.width(len(limits), expected)
        if not width:
            return {}
        if self._model is None:
            return {uid: d[:width] for uid, d in drafts.items()}
        return self._model.propose({uid: min(n, width) for uid, n in plan.items()})

    def verified(self, uid: int, drafted: int, accepted: int, tokens: list[int]) -> None:
        """Row ``uid``'s pass took ``accepted`` of ``drafted``; ``tokens`` are its new ones."""
        self._drafted += drafted
        self._accepted += accepted
        self._prior.verified(drafted, accepted)
        pace = self._paces.get(uid)
        if pace is None:
            return
        pace.verified(drafted, accepted)
        if self._model is not None:
            self._model.verified(uid, accepted, tokens)
        else:
            self._lookups[uid].extend(tokens)
