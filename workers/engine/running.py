"""The engine's running requests: the decode batch, each row's ``Sequence``, their drafts.

``Running`` is owned by the engine (``workers.engine.engine``), on its thread. A prefilled
request ``join``s with its cache and first token; each ``step`` runs one pass of the decode
batch (``workers.engine.decode``) over every row, with the drafts speculation proposes
(``workers.engine.draft``, when on), and feeds each row's new tokens to its ``Sequence`` in
order until the request finishes: a stop string, an end token or ``max_tokens`` inside a
verify pass drops the pass's later tokens. A finished row leaves with its cache less those
tokens (``Finished``), for the engine to store.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from workers.engine.constrained import RowHook
from workers.engine.decode import DecodeBatch, RowStep
from workers.engine.draft import SpecStats, Speculation
from workers.engine.scheduler import StepBudget
from workers.engine.sequence import Sampler, Sequence, TokenDelta


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that finished in the decode batch: its cache holds ``tokens``."""

    seq: Sequence
    cache: list[KVCache]
    tokens: list[int]


class Running:
    """The requests decoding together, and speculation's state for them."""

    def __init__(self, model: nn.Module, speculation: Speculation | None, budget: StepBudget,
                 eos: set[int], now_ns: Callable[[], int]) -> None:
        self._batch = DecodeBatch(model)
        self._spec = speculation
        self._budget = budget
        self._eos = eos
        self._now_ns = now_ns
        self._rows: dict[int, Sequence] = {}  # decode batch uid -> sequence

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._rows.values()))

    def join(self, seq: Sequence, first: int, cache: list[KVCache], prompt: list[int],
             sampler: Sampler | None, hook: RowHook | None) -> None:
        uid = self._batch.insert(first, cache, prompt, sampler, hook)
        self._rows[uid] = seq
        if self._spec is not None and hook is None:  # a grammar's row never drafts
            self._spec.join(uid, list(prompt), first)

    def abort(self, request_id: str) -> bool:
        uid = next((u for u, seq in self._rows.items()
                    if seq.request.request_id == request_id), None)
        if uid is None:
            return False
        self._leave(uid)
        return True

    def step(self, deltas: list[TokenDelta]) -> list[Finished]:
        """One pass over every row: each row's new tokens (one, or a verify pass's accepted
        drafts and one more) taken in order until its request finishes."""
        drafts: dict[int, list[int]] = {}
        start = self._now_ns()
        if self._spec is not None:
            drafts = self._spec.drafts({uid: seq.request.sampling.max_tokens - len(seq.tokens) - 1
                                        for uid, seq in self._rows.items()})
            drafts = {uid: _through_end(d, self._eos) for uid, d in drafts.items()}
        drafted = self._now_ns()
        steps = self._batch.step(drafts)
        seconds = (self._now_ns() - drafted) / 1e9
        width = max((len(d) for d in drafts.values()), default=0)
        # drafting and its verify pass are the step prefill waits beside
        self._budget.observe_decode((self._now_ns() - start) / 1e9)
        if self._spec is not None:
            self._spec.observe_step(len(steps), width, seconds, (drafted - start) / 1e9)
        return [f for f in (self._take(s, deltas) for s in steps) if f is not None]

    def spec_stats(self) -> SpecStats | None:
        return self._spec.stats() if self._spec is not None else None

    def _take(self, step: RowStep, deltas: list[TokenDelta]) -> Finished | None:
        seq = self._rows[step.uid]
        used = 0
        for token, row in zip(step.tokens, step.logprobs):
            deltas.append(seq.delta(token, self._now_ns(), self._eos, row))
            used += 1
            if seq.finish_reason:
                break
        seq.drafted += step.drafted
        seq.accepted += min(step.accepted, used)
        if self._spec is not None:
            self._spec.verified(step.uid, step.drafted, step.accepted, list(step.tokens))
        if not seq.finish_reason:
            return None
        cache, tokens = self._leave(step.uid, unused=len(step.tokens) - used)
        return Finished(seq, cache, tokens)

    def _leave(self, uid: int, unused: int = 0) -> tuple[list[KVCache], list[int]]:
        del self._rows[uid]
        if self._spec is not None:
            self._spec.leave(uid)
        return self._batch.remove(uid, unused)


def _through_end(draft: list[int], eos: set[int]) -> list[int]:
    """``draft`` up to its first end token (kept): nothing after it could be used."""
    for i, token in enumerate(draft):
        if token in eos:
            return draft[:i + 1]
    return draft
