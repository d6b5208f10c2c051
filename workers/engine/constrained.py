"""A request's grammar and log-probabilities inside the batched step.

The first token comes from the engine's own prefill pass (``first_token``); every later one
from mlx-lm's ``BatchGenerator``, which calls a request's logits processors on its own row
of the step's logits before sampling. ``RowHook`` is that processor: it advances the
request's grammar past the token the batch just fed in, masks the row to what the grammar
takes next, and keeps the row's log-probabilities *before* the mask for the request's
``logprobs`` (OpenAI's rule: log-softmax of the model's logits, before temperature and
constraints)::

    step N    model ──► logits[b, V] ──► row i: RowHook i (accept token N-1, keep raw row,
                                          mask) ──► sample ──► token N of request i

The batch pipelines: it builds step N+1 before it hands out step N's tokens, so a hook's raw
rows wait in a queue, one per sampled token, taken in order as the tokens come out (``raw``).
Requests without a grammar need no hook: the batch's own log-probabilities are raw for them.
Reading the token the batch fed in makes the step wait for it: the cost of a constraint is
that sync plus the mask (measured in ``orchard bench outputs``).
"""
from __future__ import annotations

from collections import deque

import mlx.core as mx

from workers.engine.constraints import Constraint

_MASKED = -float("inf")


class RowHook:
    """One constrained request's logits processor in the decode batch."""

    def __init__(self, constraint: Constraint, fed: int) -> None:
        self.constraint = constraint
        self._fed = fed          # tokens of the request's context the grammar has seen
        self._raw: deque[mx.array] = deque()

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        n = context.size
        if n == self._fed + 1:
            self.constraint.accept(int(context[-1].item()))
            self._fed = n
        elif n != self._fed:
            raise RuntimeError(f"a constrained request's context grew from {self._fed} to {n} "
                               "tokens in one step")
        self._raw.append(logits[0] - mx.logsumexp(logits[0]))
        return mask_row(logits, self.constraint)

    def raw(self) -> mx.array:
        """The raw log-probabilities of the next token out of the batch."""
        if not self._raw:
            raise RuntimeError("a constrained request's token came out of the batch with no "
                               "raw row kept for it")
        return self._raw.popleft()


def mask_row(logits: mx.array, constraint: Constraint) -> mx.array:
    """``logits`` (one row, ``[1, V]``) with every token the grammar refuses at -inf."""
    allowed = mx.array(constraint.allowed())
    return mx.where(allowed[None, :], logits, mx.array(_MASKED, dtype=logits.dtype))


def first_token(logits: mx.array, sampler, constraint: Constraint | None
                ) -> tuple[int, mx.array]:
    """The first output token from the prompt's last logits (``[1, V]``), sampled inside the
    grammar, and the raw log-probabilities it was drawn from."""
    raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    drawn = raw
    if constraint is not None:
        masked = mask_row(logits, constraint)
        drawn = masked - mx.logsumexp(masked, axis=-1, keepdims=True)
    token = sampler(drawn) if sampler else mx.argmax(drawn, axis=-1)
    mx.eval(token, raw)
    first = int(token.item())
    if constraint is not None:
        constraint.accept(first)
    return first, raw[0]
