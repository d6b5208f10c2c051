"""Prompt-lookup drafts: what each running request proposes to the verify pass, and when.

**The draft.** A request's history is its prompt and its output so far. Its last ``n`` tokens
(``n`` = 4, 3, 2, 1, longest first) are looked up among its earlier ``n``-grams; the tokens
that followed the most recent earlier occurrence are the draft, up to ``k`` of them. Batch
jobs that quote, correct, reformat or edit their prompt copy long spans of it, and there the
drafts are what the model writes. The lookup is an index of every ``n``-gram to the position
after its latest occurrence, updated as tokens arrive: a draft costs four dict reads.

**Adaptive k (per request).** ``k`` starts at 2. A verify pass that accepts every draft raises
it by 2 (up to ``max_k``); one that rejects sets it to the accepted count plus 1, so a request
drafts about what it has lately been accepted. After ``GIVE_UP`` (3) passes in a row that
accept none of their drafts the request stops drafting for ``pause`` steps, which doubles at
each give-up (16, 32, ... up to 256 steps): a request with nothing to copy soon drafts
nothing, and one that reaches a copyable span later still finds it.

**The step (``SpecCost``).** A verify pass of ``b`` rows and ``K`` drafts per row yields ``b +
A`` tokens (``A``: the drafts accepted) in ``T + X`` seconds, against ``b`` tokens in ``T`` for
a plain step: it pays when ``A * T > b * X``. ``X`` is measured per extra position (the last
verify passes' time over a plain step's, ``T`` the plain step's moving average) and ``A`` is
forecast from each row's acceptance rate; until both are measured, a step drafts, so the
first verify passes measure ``X``. A step that would not pay drafts nothing. With a draft
model (``workers.engine.draft_model``) ``X`` also counts drafting, measured per draft
position (one draft pass for the whole batch), and the rows' paces plan the passes before any
runs: a step that would not pay runs no draft pass. A draft model always proposes, so after
``PLAIN_EVERY`` (32) verify passes in a row a step is plain, which measures ``T``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.draft_model import DraftModel
from workers.rates import moving_average

NGRAMS = (4, 3, 2, 1)   # lookup lengths, longest first
START_K = 2
GROW_K = 2
GIVE_UP = 3             # passes in a row that accept nothing before a request pauses
FIRST_PAUSE = 16        # steps
LONGEST_PAUSE = 256
MAX_K = 8
FIRST_RATE = 0.5       # a new request's forecast acceptance rate, before its first pass
# With a draft model, at most this many verify passes in a row before a plain step: a draft
# model always proposes, so without it a plain step (``T``) might never be measured and the
# cost rule never asked. One step in 33 plain costs speculation at most 3%.
PLAIN_EVERY = 32


@dataclass(slots=True)
class Pace:
    """One request's adaptive ``k`` and its draft counts (whatever proposes its drafts)."""

    max_k: int
    k: int = START_K
    drafted: int = 0        # drafts sent to verify passes
    accepted: int = 0       # of those, accepted
    rate: float = FIRST_RATE  # moving average of accepted / drafted per pass
    _misses: int = 0        # passes in a row that accepted nothing
    _pause: int = 0         # steps left without drafting
    _next_pause: int = FIRST_PAUSE

    def __post_init__(self) -> None:
        self.k = min(self.k, self.max_k)

    def allowance(self, limit: int) -> int:
        """How many tokens to draft this step: ``min(k, limit)``, none while paused (a
        step asked counts down the pause)."""
        k = min(self.k, limit)
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
        self.rate = moving_average(self.rate, accepted / drafted)
        if accepted == drafted:
            self.k = min(self.max_k, self.k + GROW_K)
        else:
            self.k = min(self.max_k, accepted + 1)
        self._misses = self._misses + 1 if accepted == 0 else 0
        if self._misses >= GIVE_UP:
            self._misses = 0
            self._pause = self._next_pause
            self._next_pause = min(LONGEST_PAUSE, 2 * self._next_pause)


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
        longest matching suffix; none with nothing to match."""
        if k <= 0:
            return []
        h = self.history
        for n in NGRAMS:
            if len(h) > n:
                at = self._index.get(tuple(h[-n:]))
                if at is not None:
                    return h[at:at + k]
        return []


@dataclass(slots=True)
class SpecCost:
    """Whether a step's drafts pay for their verify pass, from measured step times."""

    _plain_s: float = 0.0           # moving average of a plain step
    _extra_s: float = 0.0           # moving average of a verify pass's cost per extra position
    _draft_s: float = 0.0           # moving average of drafting's cost per draft position
    plain_every: int = 0            # verify passes in a row before a plain step; 0: no limit
    _passes: int = 0                # verify passes since the last plain step

    def pays(self, rows: int, width: int, expected_accepted: float) -> bool:
        """A pass of ``rows`` rows, ``width`` drafts each, that forecasts
        ``expected_accepted`` accepted drafts: does it beat ``rows`` plain tokens?"""
        if width <= 0:
            return False
        if self.plain_every and self._passes >= self.plain_every:
            return False  # a plain step now, to measure one
        if not (self._plain_s and self._extra_s):
            return True  # not measured yet: the pass itself measures it
        extra = rows * width * self._extra_s + width * self._draft_s
        return expected_accepted * self._plain_s > rows * extra

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows and ``width`` drafts each took ``seconds``."""
        self._passes = self._passes + 1 if width else 0
        if width == 0:
            self._plain_s = moving_average(self._plain_s, seconds)
        elif self._plain_s:
            extra = max(seconds - self._plain_s, 0.0) / (rows * width)
            self._extra_s = moving_average(self._extra_s, extra) or 1e-12

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
        self._paces[uid] = Pace(self.max_k)
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
        """Each joined row's draft (``limits``: the most tokens worth drafting per row),
        or none at all when the verify pass would not pay for itself."""
        plan = {uid: self._paces[uid].allowance(limit) for uid, limit in limits.items()
                if uid in self._paces}
        if self._model is None:
            drafts = {uid: self._lookups[uid].propose(k) for uid, k in plan.items()}
            drafts = {uid: d for uid, d in drafts.items() if d}
            plan = {uid: len(d) for uid, d in drafts.items()}
        width = max(plan.values(), default=0)
        expected = sum(self._paces[uid].rate * n for uid, n in plan.items())
        if not self.cost.pays(len(limits), width, expected):
            return {}
        return drafts if self._model is None else self._model.propose(plan)

    def verified(self, uid: int, drafted: int, accepted: int, tokens: list[int]) -> None:
        """Row ``uid``'s pass took ``accepted`` of ``drafted``; ``tokens`` are its new ones."""
        self._drafted += drafted
        self._accepted += accepted
        pace = self._paces.get(uid)
        if pace is None:
            return
        pace.verified(drafted, accepted)
        if self._model is not None:
            self._model.verified(uid, accepted, tokens)
        else:
            self._lookups[uid].extend(tokens)
