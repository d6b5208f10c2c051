"""The dyadic bisection: exact depths, the blocks it looks at, agreement with a linear walk."""
from __future__ import annotations

import random

import pytest

from router.walk import dyadic_split, walk_chain


def probe_of(depths: dict[int, int], looked: list[int] | None = None):
    """A probe over blocks 0..n-1 (a block is its position) where bit w holds the first
    ``depths[w]`` blocks; records the positions it was asked for."""
    def probe(position: int) -> tuple[int, list[int]]:
        if looked is not None:
            looked.append(position)
        mask = sum(1 << w for w, depth in depths.items() if position < depth)
        return position + 100, [mask]
    return probe


def test_splits_are_dyadic():
    assert [dyadic_split(0, 511), dyadic_split(256, 511), dyadic_split(256, 384)] == [256, 384, 320]
    assert [dyadic_split(0, 2), dyadic_split(3, 5), dyadic_split(5, 8), dyadic_split(0, 399)] \
        == [1, 4, 6, 256]


def test_every_depth_and_the_blocks_looked_at():
    looked: list[int] = []
    walked = walk_chain(list(range(512)), probe_of({0: 300, 1: 512, 2: 1}, looked))
    assert sorted(walked.ends[0], key=lambda e: e[1]) == [(4, 1), (1, 300), (2, 512)]
    assert sorted(looked) == sorted(set(looked))  # each block looked at once
    assert sorted(walked.used) == sorted(p + 100 for p in looked)  # all below the deepest


def test_prompts_of_different_lengths_look_at_the_same_blocks_of_a_prefix():
    seen = []
    for n in (400, 512, 1000):
        looked: list[int] = []
        walk_chain(list(range(n)), probe_of({0: 300}, looked))
        seen.append(sorted(p for p in looked if p < 300))
    assert seen[0] == seen[1] == seen[2] == [0, 256, 288, 296, 298, 299]


def test_nothing_held_is_one_lookup():
    looked: list[int] = []
    walked = walk_chain(list(range(512)), probe_of({}, looked))
    assert walked.ends == [[]] and looked == [0] and walked.used == []


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_a_linear_walk_on_prefix_closed_holdings(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    depths = {w: rng.randrange(0, n + 1) for w in range(rng.randrange(1, 40))}
    walked = walk_chain(list(range(n)), probe_of(depths))
    found = {w: depth for mask, depth in walked.ends[0] for w in depths if mask >> w & 1}
    assert found == {w: d for w, d in depths.items() if d}
