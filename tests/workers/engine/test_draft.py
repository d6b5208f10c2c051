"""Prompt-lookup drafts, each request's acceptance, and the step's cost model."""
from __future__ import annotations

import pytest

from workers.engine.draft import (FIRST_PAUSE, GIVE_UP, MARGIN, PROBE_AFTER, Pace,
                                  PromptLookup, SpecCost, Speculation)


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
    def test_each_pass_moves_the_chance_at_every_position_it_reached(self):
        pace = Pace(6)
        assert pace.q == [0.5] * 8
        assert pace.expected(3) == [0.5, 0.75, 0.875] and pace.expected(0) == []
        assert pace.allowance(8) == 6 and pace.allowance(1) == 1 and pace.allowance(0) == 0
        pace.verified(4, 4)  # positions 1 to 4 reached and accepted: 0.5 + 0.3 x 0.5
        assert pace.q == pytest.approx([0.65] * 4 + [0.5] * 4)
        pace.verified(4, 1)  # position 1 accepted, position 2 rejected, 3 and 4 not reached
        assert pace.q == pytest.approx([0.755, 0.455, 0.65, 0.65] + [0.5] * 4)
        assert pace.expected(3) == pytest.approx(
            [0.755, 0.755 + 0.755 * 0.455, 0.755 + 0.755 * 0.455 + 0.755 * 0.455 * 0.65])
        pace.verified(0, 0)  # drafted nothing: nothing learnt
        assert pace.q == pytest.approx([0.755, 0.455, 0.65, 0.65] + [0.5] * 4)
        assert (pace.drafted, pace.accepted) == (8, 5)

    def test_passes_that_take_all_or_nothing_are_not_read_as_a_middling_chance(self):
        """Copies are all or nothing: a request whose passes take none or all 4 of its drafts
        (in turn) expects about half a token at width 1, not what a single per-token chance
        would say (0.8 from 4 tokens accepted per 1 stop)."""
        pace = Pace(4)
        for _ in range(10):
            pace.verified(4, 0)
            pace.verified(4, 4)
        q1, q2 = pace.q[0], pace.q[1]
        assert 0.55 < q1 < 0.65 and q2 > 0.95
        assert pace.expected(1) == pytest.approx([q1])

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
        assert spec._paces[0].q == [0.5] * 8   # the first request: FIRST_P
        spec.verified(0, 4, 0, [7])      # position 1 rejected: 0.5 - 0.05 x 0.5
        spec.verified(0, 4, 4, [1, 2, 3, 4, 7])  # positions 1 to 4 accepted
        spec.join(1, [5, 6], 7)
        assert spec._paces[1].q == pytest.approx([0.50125, 0.525, 0.525, 0.525] + [0.5] * 4)
        spec.leave(0)
        spec.join(2, [5, 6], 7)          # a request that left still counts
        assert spec._paces[2].q == spec._paces[1].q
        spec._paces[2].verified(2, 0)    # a request's own passes move its own copy only
        assert spec._paces[1].q[0] == pytest.approx(0.50125)

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
        # plain: 40 tokens/s, to be beaten by MARGIN (41.2); width w: (4 + A(w)) / (0.1 + 0.004 w)
        assert MARGIN == 0.03
        assert cost.width(rows=4, expected=[0.30, 0.40]) == 1   # 41.35 against 40.74
        assert cost.width(rows=4, expected=[0.30, 0.50]) == 2   # 41.35 against 41.67
        assert cost.width(rows=4, expected=[0.28, 0.44]) == 0   # 41.15 and 41.11: not by 3%

    def test_each_width_and_each_row_count_is_costed_as_measured(self):
        cost = SpecCost()
        cost.observe(rows=4, width=0, seconds=0.100)
        for seconds in (9.0, 0.108):    # width 2: 1 ms an extra position
            cost.observe(rows=4, width=2, seconds=seconds)
        for seconds in (9.0, 0.112):    # width 1: 3 ms an extra position
            cost.observe(rows=4, width=1, seconds=seconds)
        assert cost.pass_s(4, 1) == pytest.approx(0.112)
        assert cost.pass_s(4, 2) == pytest.approx(0.108)
        # width 3 not measured: the cost of any width, 0.7 x 1 + 0.3 x 3 = 1.6 ms
        assert cost.pass_s(4, 3) == pytest.approx(0.1 + 12 * 0.0016)
        # width 1 40.18, width 2 42.59, width 3 4.9 / 0.1192 = 41.11 tokens/s
        assert cost.width(rows=4, expected=[0.5, 0.6, 0.9]) == 2
        cost.observe(rows=8, width=0, seconds=0.2)
        cost.observe(rows=8, width=0, seconds=0.3)
        assert cost.plain(8) == pytest.approx(0.23) and cost.plain(4) == 0.1
        assert cost.plain(6) == 0.1 and cost.plain(7) == pytest.approx(0.23)  # the nearest
        assert cost.plain(1) == 0.1 and cost.plain(30) == pytest.approx(0.23)
        cost.observe(rows=8, width=2, seconds=0.262)  # against a plain step of 8: 2 ms each
        assert cost.pass_s(8, 2) == pytest.approx(0.23 + 16 * (0.7 * 0.001 + 0.3 * 0.002))

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
        cost.observe(rows=2, width=1, seconds=0.102)  # width 1 costs 1 ms a position
        assert cost.width(2, [0.5, 0.9]) == 1       # 2.5 / 0.102 = 24.5 tokens/s against 20
        assert cost.width(2, [0.0, 0.9]) == 0       # width 2 still at its own 0.1 s a position
        assert cost.width(2, []) == 0 and cost.width(2, []) == 0  # no drafts: not declined
        for _ in range(PROBE_AFTER - 1):
            cost.width(2, [0.0, 0.9])
        assert cost.width(2, [0.0, 0.9]) == 1

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
        for _ in range(6):   # row 0's drafts all accepted: its chances rise, and the width
            spec.verified(0, 2, 2, [4, 5, 6])
        assert spec._paces[0].q[:2] == pytest.approx([1 - 0.5 * 0.7 ** 6] * 2)
        # row 0 [0.94, 1.83] and row 1 about 0.5: width 1 3.44 / 0.13, width 2 4.33 / 0.16
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
