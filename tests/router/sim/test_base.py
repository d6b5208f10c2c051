"""``router.sim.base``: what every simulated policy shares: the blocks a request may write (those
before its last breakpoint) and the load a policy accounts per worker, by request: in flight,
queued prefill tokens (less what it expects cached) until the prefill ends, running K/V blocks
(the prompt's, rounded up) until the request finishes."""
from __future__ import annotations

import pytest

from router.kv.key import BlockHash
from router.sim.base import SimPolicy, SimRequest

BS = 4


def request(rid: int, length: int, blocks: int = 2, write_blocks: int | None = None) -> SimRequest:
    return SimRequest(rid, length, 3, tuple(BlockHash(b) for b in range(1, blocks + 1)),
                      write_blocks=write_blocks)


class Cached(SimPolicy):
    """A policy that expects 4 tokens cached on w1, nothing on w0."""

    def expected_cached(self, req: SimRequest, worker: str) -> int:
        return 4 if worker == "w1" else 0


def load(policy: SimPolicy) -> list[tuple[int, int, int]]:
    return [(policy.in_flight[w], policy.prefill[w], policy.kv_blocks[w]) for w in policy.workers]


class TestTheBlocksARequestWrites:
    def test_all_of_them_without_a_breakpoint_and_those_before_it_with_one(self):
        assert request(0, 9, 2).writable == (BlockHash(1), BlockHash(2))
        assert request(0, 9, 2, write_blocks=1).writable == (BlockHash(1),)
        assert request(0, 9, 2, write_blocks=0).writable == ()


class TestTheLoadAPolicyAccounts:
    def test_a_request_counts_until_its_prefill_ends_and_its_blocks_until_it_finishes(self):
        policy = Cached(["w0", "w1"], BS, seed=0)
        policy.started(request(0, 9), "w0", 0.0)        # 9 tokens: 3 blocks of 4
        policy.started(request(1, 9), "w1", 0.0)        # 4 of them expected cached
        policy.started(request(2, 4), "w1", 0.0)
        assert load(policy) == [(1, 9, 3), (2, 5, 4)]
        policy.prefilled(1)
        assert load(policy) == [(1, 9, 3), (2, 0, 4)]
        policy.finished(1)
        assert load(policy) == [(1, 9, 3), (1, 0, 1)]

    def test_a_request_that_finishes_before_its_prefill_ends_gives_its_tokens_back(self):
        policy = Cached(["w0", "w1"], BS, seed=0)
        policy.started(request(0, 9), "w0", 0.0)
        policy.finished(0)
        assert load(policy) == [(0, 0, 0), (0, 0, 0)]

    def test_the_base_has_no_choice_no_pull_and_no_index(self):
        policy = SimPolicy(["w0"], BS, seed=0)
        with pytest.raises(NotImplementedError):
            policy.choose(request(0, 9), 0.0)
        assert (policy.planned_pull(), policy.index_dropped(), policy.reasons) == (None, None, {})
        assert policy.expected_cached(request(0, 9), "w0") == 0
