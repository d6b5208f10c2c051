"""``workers.lab.verify_cases``: when a case passes (every token equal, the logits within the
tolerance, and a reuse where one was expected) and what a report sums over its cases and store
settings. The comparison itself runs on engines in ``test_verify.py``."""
from __future__ import annotations

import pytest

from workers.lab.verify_cases import TOLERANCE, CaseResult, VerifyReport
from workers.lab.verify_tiers import SettingResult


def case(equal: int = 10, diff: float = 0.0, cached: int = 16, expect_reuse: bool = True,
         compared: int = 10, name: str = "chat") -> CaseResult:
    return CaseResult(name, 2, compared, equal, diff, cached, expect_reuse)


class TestWhenACasePasses:
    def test_every_token_equal_within_the_tolerance_with_its_reuse(self):
        assert TOLERANCE == 1e-4
        assert case().passed
        assert case(diff=TOLERANCE).passed                   # the tolerance itself is within

    @pytest.mark.parametrize("failing", [dict(equal=9), dict(diff=2e-4), dict(cached=0)])
    def test_one_token_off_a_logit_past_the_tolerance_or_no_reuse_fails(self, failing):
        assert not case(**failing).passed

    def test_a_case_that_expects_no_reuse_passes_without_one(self):
        assert case(cached=0, expect_reuse=False).passed


class TestAReport:
    def test_agreement_and_the_largest_difference_over_its_cases(self):
        report = VerifyReport("m", (case(equal=10, diff=1e-5), case(equal=5, diff=3e-5,
                                                                     compared=10)))
        assert (report.agreement, report.max_abs_logit_diff) == (0.75, 3e-5)
        assert not report.passed                             # the second is 5 tokens off

    def test_an_empty_report_agrees_nowhere_and_passes(self):
        report = VerifyReport("m", ())
        assert (report.agreement, report.max_abs_logit_diff, report.passed) == (0.0, 0.0, True)

    def test_a_failed_store_setting_fails_the_report(self):
        exact = SettingResult("disk", True, 100, 1.0, tokens_compared=4, tokens_equal=3,
                              reused_tokens=16)
        assert not VerifyReport("m", (case(),), settings=(exact,)).passed
        assert VerifyReport("m", (case(),), settings=()).passed
