"""Prompt-lookup drafts, adaptive k, and the step's cost model."""
from __future__ import annotations

import pytest

from workers.engine.draft import (FIRST_PAUSE, GIVE_UP, PROBE_AFTER, Pace, PromptLookup,
                                  SpecCost, Speculation)


class TestLookup:
    def test_the_latest_earlier_occurrence_of_the_longest_suffix(self):
        # ... 1 2 3 | 9 9 ... 1 2 3 | 7 8 ... then the history ends in 1 2 3
        lookup = PromptLookup([1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3])
        assert lookup.propose(2) == [7, 8]
        assert lookup.propose(6) == [7, 8, 6, 1, 2, 3]
        # the copy reaches the present: what follows it is the copy again
        assert lookup.propose(8) == [7, 8, 6, 1, 2, 3, 7, 8]

    def test_a_shorter_suffix_when_the_longer_one_never_occurred(self):
        lookup = PromptLookup([4, 5, 6, 1, 9, 8, 7, 1])
        assert lookup.propose(2) == [9, 8]  # only "1" occurred before
        assert PromptLookup([4, 5, 6, 7]).propose(8) == []
        assert PromptLookup([]).propose(8) == []

    def test_tokens_that_arrive_extend_the_index(self):
        lookup = PromptLookup([1, 2, 3, 4])
        lookup.extend([1, 2])
        assert lookup.propose(2) == [3, 4]
        assert lookup.propose(8) == [3, 4, 1, 2, 3, 4, 1, 2]
        assert lookup.propose(0) == []

    def test_a_loop_drafts_its_loop(self):
        assert PromptLookup([5, 9, 9, 9]).propose(5) == [9, 9, 9, 9, 9]
        assert PromptLookup([1, 2, 3, 1, 2]).propose(4) == [3, 1, 2, 3]


class TestAcceptance:
    def test_each_pass_moves_the_per_token_acceptance_and_the_expected_yield(self):
        pace = Pace(6)
        assert pace.p == 0.5 and pace.expected(3) == [0.5, 0.75, 0.875] and pace.expected(0) == []
        assert pace.allowance(8) == 6 and pace.allowance(1) == 1 and pace.allowance(0) == 0
        pace.verified(4, 4)  # hits 0.7 x 0.5 + 0.3 x 4 = 1.55, stops 0.7 x 0.5 = 0.35
        assert pace.p == pytest.approx(1.55 / 1.9)
        pace.verified(4, 1)  # hits 1.385, stops 0.245 + 0.3 (it stopped at a rejection)
        assert pace.p == pytest.approx(1.385 / 1.93)
        assert pace.expected(2) == pytest.approx([pace.p, pace.p + pace.p ** 2])
        pace.verified(0, 0)  # drafted nothing: nothing learnt
        assert pace.p == pytest.approx(1.385 / 1.93)
        assert (pace.drafted, pace.accepted) == (8, 5)

    def test_a_request_whose_drafts_keep_failing_stops_drafting(self):
        pace = Pace(4)
        for _ in range(GIVE_UP):
            assert pace.allowance(4) == 4
            pace.verified(4, 0)
        assert [pace.allowance(4) for _ in range(FIRST_PAUSE)] == [0] * FIRST_PAUSE
        assert pace.allowance(4) == 4  # after the pause: it drafts again
        for _ in range(GIVE_UP):
            pace.verified(4, 0)
        assert sum(1 for _ in range(2 * FIRST_PAUSE) if not pace.allowance(4)) == 2 * FIRST_PAUSE

    def test_a_new_request_starts_where_the_engines_recent_rows_stand(self):
        spec = Speculation(4)
        spec.join(0, [1, 2, 3], 4)
        assert spec._paces[0].p == 0.5   # the first request: FIRST_P
        spec.verified(0, 4, 0, [7])      # hits 0.95 x 0.5 = 0.475, stops 0.475 + 0.05
        spec.verified(0, 4, 4, [1, 2, 3, 4, 7])  # hits 0.45125 + 0.2, stops 0.49875
        spec.join(1, [5, 6], 7)
        assert spec._paces[1].p == pytest.approx(0.65125 / (0.65125 + 0.49875))
        spec.leave(0)
        spec.join(2, [5, 6], 7)          # a request that left still counts
        assert spec._paces[2].p == spec._paces[1].p

    def test_one_accepted_draft_resets_the_count_of_failures(self):
        pace = Pace(4)
        for accepted in (0, 0, 1, 0, 0):
            pace.verified(2, accepted)
        assert pace.allowance(4) == 4  # not paused


class TestCost:
    def test_full_width_until_measured_then_the_width_with_the_most_tokens_a_second(self):
        cost = SpecCost()
        assert cost.width(rows=4, expected=[0.0, 0.0]) == 2
        assert cost.width(rows=4, expected=[]) == 0
        cost.observe(rows=4, width=0, seconds=0.100)
        cost.observe(rows=4, width=2, seconds=9.0)    # a width's first pass: not measured
        assert cost.width(rows=4, expected=[0.0, 0.0]) == 2
        cost.observe(rows=4, width=2, seconds=0.108)  # 8 extra positions: 1 ms each
        # plain: 40 tokens/s; width w: (4 + A(w)) / (0.100 + 0.004 w)
        assert cost.width(rows=4, expected=[0.17, 0.30]) == 1   # 40.10 against 39.81
        assert cost.width(rows=4, expected=[0.15, 0.33]) == 2   # 39.90 against 40.09
        assert cost.width(rows=4, expected=[0.15, 0.31]) == 0   # neither beats 40

    def test_a_step_that_would_not_pay_drafts_nothing(self):
        spec = Speculation(4)
        spec.join(0, [1, 2, 1, 2, 1], 2)
        spec.join(1, [5, 6], 7)
        assert spec.drafts({0: 10, 1: 10}) == {0: [1, 2, 1, 2]}
        spec.cost.observe(rows=2, width=0, seconds=0.01)
        for _ in range(2):  # the first pass of a width warms up, the second is measured
            spec.cost.observe(rows=2, width=2, seconds=1.0)  # a verify pass far dearer
        assert spec.drafts({0: 10, 1: 10}) == {}

    def test_after_declining_a_while_one_pass_of_width_1_measures_again(self):
        cost = SpecCost()
        cost.observe(rows=2, width=0, seconds=0.1)
        cost.observe(rows=2, width=2, seconds=0.5)
        cost.observe(rows=2, width=2, seconds=0.5)   # 0.1 s a position: never pays
        assert [cost.width(2, [0.5, 0.9]) for _ in range(PROBE_AFTER)] == [0] * PROBE_AFTER
        assert cost.width(2, [0.5, 0.9]) == 1       # the probe, at the narrowest width
        cost.observe(rows=2, width=1, seconds=0.5)  # width 1's first pass: warm-up, not measured
        assert [cost.width(2, [0.5, 0.9]) for _ in range(PROBE_AFTER)] == [0] * PROBE_AFTER
        assert cost.width(2, [0.5, 0.9]) == 1
        cost.observe(rows=2, width=1, seconds=0.102)  # it was one slow pass: 1 ms a position
        # X = 0.7 x 0.1 + 0.3 x 0.001 = 0.0703 s: still dear, so plain again until the next probe
        assert cost.width(2, [0.5, 0.9]) == 0
        assert cost.width(2, []) == 0 and cost.width(2, []) == 0  # no drafts: not declined
        for _ in range(PROBE_AFTER - 1):
            cost.width(2, [0.5, 0.9])
        assert cost.width(2, [0.5, 0.9]) == 1

    def test_every_draft_is_cut_to_the_step_width(self):
        spec = Speculation(4)
        spec.join(0, [1, 2, 3, 4, 5, 6, 1, 2], 3)   # copies 4 5 6 1 after "1 2 3"
        spec.join(1, [8, 9, 8], 9)                  # copies 8 9 (8 9 ...) after "8 9"
        assert spec.drafts({0: 10, 1: 10}) == {0: [4, 5, 6, 1], 1: [8, 9, 8, 9]}  # not measured
        spec.cost.observe(rows=2, width=0, seconds=0.1)
        spec.cost.observe(rows=2, width=1, seconds=0.5)    # warm-up: not measured
        spec.cost.observe(rows=2, width=1, seconds=0.13)   # 15 ms an extra position
        # p = 0.5 for both: A = 1.0, 1.5, 1.75, 1.875 at widths 1 to 4; plain 20 tokens/s,
        # width 1 3.0 / 0.13 = 23.1, width 2 3.5 / 0.16 = 21.9, width 3 3.75 / 0.19 = 19.7
        assert spec.drafts({0: 10, 1: 10}) == {0: [4], 1: [8]}
        assert spec.drafts({0: 1, 1: 10}) == {0: [4], 1: [8]}  # a row's limit cuts its draft
        for _ in range(6):   # row 0's drafts all accepted: its p rises, and the width with it
            spec.verified(0, 1, 1, [4, 9])
        assert spec.cost.width(2, [e + 0.5 for e in spec._paces[0].expected(2)]) == 2

    def test_with_plain_every_a_plain_step_follows_that_many_verify_passes(self):
        cost = SpecCost(plain_every=3)
        for _ in range(3):
            assert cost.width(rows=2, expected=[2.0, 4.0]) == 2  # not measured: drafts
            cost.observe(rows=2, width=2, seconds=0.0)
        assert cost.width(rows=2, expected=[2.0, 4.0]) == 0
        cost.observe(rows=2, width=0, seconds=0.0)  # the plain step
        assert cost.width(rows=2, expected=[2.0, 4.0]) == 2
        assert SpecCost().plain_every == Speculation(4).cost.plain_every == 0  # prompt lookup

    def test_max_k_is_checked(self):
        with pytest.raises(ValueError, match="speculate_max_k must be 1 to 8, got 9"):
            Speculation(9)
