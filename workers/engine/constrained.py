"""A request's grammar and log-probabilities inside the batched step.

The first token comes from the engine's own prefill pass (``first_token``); every later one
from the decode batch (``workers.engine.decode``), which hands a constrained row's logits to
its ``RowHook`` before sampling. The hook advances the request's grammar past the token the
batch just fed in and masks the row to what the grammar takes next; the batch keeps the
row's log-probabilities *before* the mask for the request's ``logprobs`` (OpenAI's rule:
log-softmax of the model's logits, before temperature and constraints)::

    step N    model ──► logits[b, V] ──► row i: RowHook i (accept token N-1, mask)
                                          ──► sample ──► token N of request i

A constrained row never drafts (its grammar steps one token a pass), so a hook sees each of
its request's tokens once, in order. Requests without a grammar need no hook. The cost of a
constraint is the mask and the matcher's step (measured in ``orchard bench outputs``).
"""
from __future__ import annotations

import mlx.core as mx

from workers.engine.constraints import Constraint

_MASKED = -float("inf")


class RowHook:
    """One constrained request's mask in the decode batch."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self._primed = False  # the first token was accepted by ``first_token``

    def __call__(self, fed: int, logits: mx.array) -> mx.array:
        """``logits`` (``[1, V]``) of the position after ``fed``, masked by the grammar."""
        if self._primed:
            self.constraint.accept(fed)
        self._primed = True
        return mask_row(logits, self.constraint)


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
