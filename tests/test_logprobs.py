"""Log-probabilities of output tokens (``workers.engine.sequence.token_logprob``): the chosen
token's value and the likeliest alternatives, exactly, most likely first, ties by token id."""
from __future__ import annotations

import math

import mlx.core as mx

import workers  # noqa: F401  (OpenBLAS before mlx)
from workers.engine.sequence import token_logprob
from workers.messages import TokenLogprob


def _row(values) -> mx.array:
    logits = mx.array(values, dtype=mx.float32)
    return logits - mx.logsumexp(logits)


def test_the_chosen_token_and_the_top_alternatives_in_order():
    row = _row([0.0, 2.0, 1.0, 2.0, -1.0])
    z = math.log(1 + 2 * math.e ** 2 + math.e + math.e ** -1)
    got = token_logprob(row, 2, 3)
    assert got.token == 2 and abs(got.logprob - (1 - z)) < 1e-6
    assert [t for t, _ in got.top] == [1, 3, 2]  # 1 and 3 tie: the lower id first
    assert all(abs(v - want) < 1e-6 for (_, v), want in zip(got.top, [2 - z, 2 - z, 1 - z]))


def test_zero_alternatives_and_all_of_a_tiny_vocabulary():
    row = _row([1.0, 0.0])
    assert token_logprob(row, 0, 0).top == ()
    every = token_logprob(row, 1, 5)
    assert [t for t, _ in every.top] == [0, 1]
    assert isinstance(every, TokenLogprob)


def test_a_half_precision_row_is_read_in_float32():
    row = _row([0.5, 0.25, 0.125]).astype(mx.float16)
    got = token_logprob(row, 0, 1)
    assert isinstance(got.logprob, float) and got.top[0][0] == 0
