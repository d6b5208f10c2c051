"""Which drafted tokens a verify pass accepts: the rule that keeps speculation exact.

A draft proposes token ``x`` for a position with probability ``q(x)``; the target model's
verify pass gives that position's distribution ``p`` (after temperature, top-p and any mask:
the distribution the request samples from). The standard rejection rule (Leviathan et al.,
2023; Chen et al., 2023) accepts ``x`` with probability ``min(1, p(x) / q(x))`` and, on a
rejection, draws the position's token from the residual ``max(0, p - q)`` renormalised. The
token that comes out is then distributed exactly as ``p``::

    P(out = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x q(x) min(1, p(x)/q(x))) residual(y)
               = min(q(y), p(y)) + max(0, p(y) - q(y))        = p(y)

Prompt-lookup drafts are certain (``q`` is all on ``x``): ``x`` is accepted with probability
``p(x)`` and a rejection draws from ``p`` without ``x``. Greedy requests accept ``x`` exactly
when it is the verify pass's argmax, so their output is the output without speculation.
The first rejected position's token (or, when every draft is accepted, the token after the
last one) comes from the same pass: a verify pass always yields at least one token.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from workers.engine.sequence import Sampler


def accept_probability(p: np.ndarray, q: np.ndarray, token: int) -> float:
    """``min(1, p(token) / q(token))`` for a token the draft proposed (``q(token) > 0``)."""
    if q[token] <= 0:
        raise ValueError(f"token {token} was drafted with probability {q[token]}: a draft "
                         "proposes only tokens it gives a positive probability")
    return float(min(1.0, p[token] / q[token]))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The distribution a rejected position draws from: ``max(0, p - q)`` renormalised (``p``
    itself when ``q`` covers nothing ``p`` has more of, which only happens when ``p == q``,
    where no rejection can occur)."""
    rest = np.maximum(p - q, 0.0)
    total = rest.sum()
    return rest / total if total > 0 else p


def greedy_accepted(draft: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the verify pass's argmax at their position."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


def sample_accepted(sampler: Sampler, logprobs: mx.array, draft: list[int]
                    ) -> tuple[list[int], int]:
    """A sampled request's tokens from one verify pass over ``draft`` (``logprobs``: the
    pass's ``[len(draft) + 1, V]`` rows, before temperature), and how many drafts it took.

    Each certain draft ``x`` is kept with probability ``p(x)`` (``q`` all on ``x``); the first
    rejection draws from the residual, ``p`` without ``x``; with every draft kept, the next
    token is drawn as a plain step would. Draws use the request's own key (``Sampler``)."""
    out: list[int] = []
    for j, x in enumerate(draft):
        p = sampler.distribution(logprobs[j])
        if sampler.uniform() < float(p[x].item()):
            out.append(x)
            continue
        rest = mx.where(mx.arange(p.shape[0]) == x, mx.array(0.0, dtype=p.dtype), p)
        out.append(sampler.draw(rest / rest.sum()))
        return out, j
    out.append(int(sampler(logprobs[len(draft)][None]).item()))
    return out, len(draft)
