"""Prompt-lookup drafts, adaptive k, and the step's cost model."""
from __future__ import annotations

import pytest

from workers.engine.draft import (FIRST_PAUSE, GIVE_UP, PromptLookup, SpecCost, Speculation,
                                  START_K)


class TestLookup:
    def test_the_latest_earlier_occurrence_of_the_longest_suffix(self):
        # ... 1 2 3 | 9 9 ... 1 2 3 | 7 8 ... then the history ends in 1 2 3
        lookup = PromptLookup(8, [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3])
        lookup.k = 8
        assert lookup.propose(8) == [7, 8, 6, 1, 2, 3]
        assert lookup.propose(2) == [7, 8]

    def test_a_shorter_suffix_when_the_longer_one_never_occurred(self):
        lookup = PromptLookup(8, [4, 5, 6, 1, 9, 8, 7, 1])
        assert lookup.propose(8) == [9, 8]  # only "1" occurred before: k is 2 at first
        assert PromptLookup(8, [4, 5, 6, 7]).propose(8) == []
        assert PromptLookup(8, []).propose(8) == []

    def test_tokens_that_arrive_extend_the_index(self):
        lookup = PromptLookup(8, [1, 2, 3, 4])
        lookup.extend([1, 2])
        assert lookup.propose(8) == [3, 4]
        assert lookup.propose(0) == []


class TestAdaptiveK:
    def test_k_grows_while_drafts_are_accepted_and_falls_to_what_was_accepted(self):
        lookup = PromptLookup(6, [])
        assert lookup.k == START_K == 2
        lookup.verified(2, 2)
        assert lookup.k == 4
        lookup.verified(4, 4)
        lookup.verified(6, 6)
        assert lookup.k == 6  # max_k
        lookup.verified(6, 2)
        assert lookup.k == 3
        assert (lookup.drafted, lookup.accepted) == (18, 14)

    def test_a_request_whose_drafts_keep_failing_stops_drafting(self):
        lookup = PromptLookup(4, [1, 2, 1, 2, 1, 2])
        for _ in range(GIVE_UP):
            assert lookup.propose(4)
            lookup.verified(len(lookup.propose(4)), 0)
        assert [lookup.propose(4) for _ in range(FIRST_PAUSE)] == [[]] * FIRST_PAUSE
        assert lookup.propose(4) == [1]  # after the pause: it looks again (k fell to 1)
        for _ in range(GIVE_UP):
            lookup.verified(1, 0)
        assert sum(1 for _ in range(2 * FIRST_PAUSE) if not lookup.propose(4)) == 2 * FIRST_PAUSE

    def test_one_accepted_draft_resets_the_count_of_failures(self):
        lookup = PromptLookup(4, [1, 2, 1, 2, 1, 2])
        for accepted in (0, 0, 1, 0, 0):
            lookup.verified(2, accepted)
        assert lookup.propose(4) != []


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
        spec.join(0, [1, 2, 1, 2, 1, 2])
        spec.join(1, [5, 6, 7])
        assert spec.drafts({0: 10, 1: 10}) == {0: [1, 2]}
        spec.cost.observe(rows=2, width=0, seconds=0.01)
        spec.cost.observe(rows=2, width=2, seconds=1.0)  # a verify pass far dearer
        assert spec.drafts({0: 10, 1: 10}) == {}

    def test_max_k_is_checked(self):
        with pytest.raises(ValueError, match="speculate_max_k must be 1 to 8, got 9"):
            Speculation(9)
