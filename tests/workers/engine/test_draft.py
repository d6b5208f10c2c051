"""Prompt-lookup drafts, adaptive k, and the step's cost model."""
from __future__ import annotations

import pytest

from workers.engine.draft import (FIRST_PAUSE, GIVE_UP, Pace, PromptLookup, SpecCost,
                                  Speculation, START_K)


class TestLookup:
    def test_the_latest_earlier_occurrence_of_the_longest_suffix(self):
        # ... 1 2 3 | 9 9 ... 1 2 3 | 7 8 ... then the history ends in 1 2 3
        lookup = PromptLookup([1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3])
        assert lookup.propose(8) == [7, 8, 6, 1, 2, 3]
        assert lookup.propose(2) == [7, 8]

    def test_a_shorter_suffix_when_the_longer_one_never_occurred(self):
        lookup = PromptLookup([4, 5, 6, 1, 9, 8, 7, 1])
        assert lookup.propose(2) == [9, 8]  # only "1" occurred before
        assert PromptLookup([4, 5, 6, 7]).propose(8) == []
        assert PromptLookup([]).propose(8) == []

    def test_tokens_that_arrive_extend_the_index(self):
        lookup = PromptLookup([1, 2, 3, 4])
        lookup.extend([1, 2])
        assert lookup.propose(2) == [3, 4]
        assert lookup.propose(8) == [3, 4, 1, 2]
        assert lookup.propose(0) == []


class TestAdaptiveK:
    def test_k_grows_while_drafts_are_accepted_and_falls_to_what_was_accepted(self):
        pace = Pace(6)
        assert pace.k == START_K == 2 and pace.allowance(8) == 2 and pace.allowance(1) == 1
        pace.verified(2, 2)
        assert pace.k == 4
        pace.verified(4, 4)
        pace.verified(6, 6)
        assert pace.k == 6  # max_k
        pace.verified(6, 2)
        assert pace.k == 3
        assert (pace.drafted, pace.accepted) == (18, 14)

    def test_a_request_whose_drafts_keep_failing_stops_drafting(self):
        pace = Pace(4)
        for k in (2, 1, 1)[:GIVE_UP]:  # k falls to what was accepted, plus 1
            assert pace.allowance(4) == k
            pace.verified(k, 0)
        assert [pace.allowance(4) for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE
        assert pace.allowance(4) == 1  # after the pause: it drafts again (k fell to 1)
        for _ in range(GIVE_UP):
            pace.verified(1, 0)
        assert sum(1 for _ in range(2 * FIRST_PAUSE) if not pace.allowance(4)) == 2 * FIRST_PAUSE

    def test_one_accepted_draft_resets_the_count_of_failures(self):
        pace = Pace(4)
        for accepted in (0, 0, 1, 0, 0):
            pace.verified(2, accepted)
        assert pace.allowance(4) == 1  # not paused: k fell to 1


class TestCost:
    def test_drafts_until_measured_then_only_when_they_pay(self):
        cost = SpecCost()
        assert cost.pays(rows=4, width=2, expected_accepted=0.0)
        assert not cost.pays(rows=4, width=0, expected_accepted=3.0)
        cost.observe(rows=4, width=0, seconds=0.100)
        cost.observe(rows=4, width=2, seconds=0.108)  # 8 extra positions: 1 ms each
        # pays when accepted x 0.100 > rows x (rows x width x 0.001)
        assert cost.pays(rows=4, width=2, expected_accepted=0.33)
        assert not cost.pays(rows=4, width=2, expected_accepted=0.31)
        assert not cost.pays(rows=8, width=4, expected_accepted=2.5)

    def test_a_step_that_would_not_pay_drafts_nothing(self):
        spec = Speculation(4)
        spec.join(0, [1, 2, 1, 2, 1], 2)
        spec.join(1, [5, 6], 7)
        assert spec.drafts({0: 10, 1: 10}) == {0: [1, 2]}
        spec.cost.observe(rows=2, width=0, seconds=0.01)
        spec.cost.observe(rows=2, width=2, seconds=1.0)  # a verify pass far dearer
        assert spec.drafts({0: 10, 1: 10}) == {}

    def test_with_plain_every_a_plain_step_follows_that_many_verify_passes(self):
        cost = SpecCost(plain_every=3)
        for _ in range(3):
            assert cost.pays(rows=2, width=2, expected_accepted=4.0)  # not measured: drafts
            cost.observe(rows=2, width=2, seconds=0.0)
        assert not cost.pays(rows=2, width=2, expected_accepted=4.0)
        cost.observe(rows=2, width=0, seconds=0.0)  # the plain step
        assert cost.pays(rows=2, width=2, expected_accepted=4.0)
        assert SpecCost().plain_every == Speculation(4).cost.plain_every == 0  # prompt lookup

    def test_max_k_is_checked(self):
        with pytest.raises(ValueError, match="speculate_max_k must be 1 to 8, got 9"):
            Speculation(9)
