"""The acceptance rule of a verify pass: exact on a tiny vocabulary, and what a sampled
request's verify pass draws."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from workers.engine.acceptance import (accept_probability, greedy_accepted, residual,
                                       sample_accepted)
from workers.engine.sequence import Sampler
from workers.messages import SamplingParams

P = np.array([0.5, 0.25, 0.125, 0.125])
DRAFTS = [np.array([0.25, 0.25, 0.25, 0.25]), np.array([0.0, 0.0, 0.9, 0.1]),
          np.array([1.0, 0.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.0, 1.0]), P]


def output_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(out = y) under the rule: the draft x ~ q kept with accept_probability, else a draw
    from the residual."""
    out = np.zeros_like(p)
    for x in np.flatnonzero(q):
        a = accept_probability(p, q, int(x))
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual(p, q)
    return out


class TestTheRule:
    @pytest.mark.parametrize("q", DRAFTS, ids=["uniform", "off", "certain-0", "certain-3", "same"])
    def test_the_output_is_distributed_as_the_target(self, q):
        assert np.abs(output_distribution(P, q) - P).max() <= 1e-15

    def test_every_pair_of_a_small_grid(self):
        grid = [np.array(v) / sum(v) for v in itertools.product((0, 1, 2, 5), repeat=3) if sum(v)]
        for p, q in itertools.product(grid, grid):
            assert np.abs(output_distribution(p, q) - p).max() <= 1e-12

    def test_a_certain_draft_is_kept_with_its_target_probability(self):
        q = np.array([0.0, 0.0, 1.0, 0.0])
        assert accept_probability(P, q, 2) == 0.125
        assert residual(P, q).tolist() == [0.5 / 0.875, 0.25 / 0.875, 0.0, 0.125 / 0.875]

    def test_a_token_the_draft_never_proposes_is_refused(self):
        with pytest.raises(ValueError, match="drafted with probability 0"):
            accept_probability(P, np.array([1.0, 0.0, 0.0, 0.0]), 1)

    def test_greedy_accepts_the_leading_drafts_equal_to_the_argmax(self):
        assert greedy_accepted([5, 6, 7], [5, 6, 9, 1]) == 2
        assert greedy_accepted([5, 6, 7], [5, 6, 7, 1]) == 3
        assert greedy_accepted([4], [5, 6]) == 0 and greedy_accepted([], [5]) == 0


class TestSampledVerify:
    def test_the_first_token_follows_the_target_and_the_draft_is_kept_at_its_rate(self):
        sampler = Sampler(SamplingParams(max_tokens=1, temperature=1.0, seed=3))
        rows = mx.log(mx.array(np.stack([P, P]).astype(np.float32)))
        n = 4000
        firsts = np.zeros(4)
        kept = 0
        for _ in range(n):
            tokens, accepted = sample_accepted(sampler, rows, [2])
            firsts[tokens[0]] += 1
            kept += accepted
            assert len(tokens) == accepted + 1
        sigma = np.sqrt(P * (1 - P) / n)
        assert np.all(np.abs(firsts / n - P) <= 4 * sigma)
        assert abs(kept / n - 0.125) <= 4 * np.sqrt(0.125 * 0.875 / n)

    def test_a_rejected_position_never_draws_the_rejected_token(self):
        sampler = Sampler(SamplingParams(max_tokens=1, temperature=1.0, seed=4))
        rows = mx.log(mx.array(np.stack([P, P]).astype(np.float32)))
        for _ in range(300):
            tokens, accepted = sample_accepted(sampler, rows, [0])
            if accepted == 0:
                assert tokens[0] != 0
