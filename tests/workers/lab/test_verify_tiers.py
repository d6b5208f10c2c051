"""``workers.lab.verify_tiers``: what a store setting's result says: an exact setting (the
disk tier) judged as ``orchard verify``'s cases are, a quantized or skipped one measured and
never failed, and its cases summed. The settings themselves run on engines in
``test_verify.py``."""
from __future__ import annotations

from workers.lab.verify_cases import CaseResult
from workers.lab.verify_tiers import SettingResult, _combine


def setting(exact: bool = True, equal: int = 8, diff: float = 0.0, reused: int = 32,
            skipped: str = "") -> SettingResult:
    return SettingResult("disk", exact, 9216, 1.0, 8, equal, diff, reused, skipped)


class TestWhenASettingPasses:
    def test_an_exact_setting_needs_every_token_a_reuse_and_the_tolerance(self):
        assert setting().passed
        assert not setting(equal=7).passed
        assert not setting(reused=0).passed
        assert not setting(diff=1e-3).passed

    def test_a_quantized_or_skipped_setting_is_measured_not_judged(self):
        assert setting(exact=False, equal=0, reused=0, diff=5.0).passed
        assert setting(equal=0, skipped="head_dim 48 is not a multiple of 64").passed

    def test_agreement_is_the_share_of_tokens_equal(self):
        assert setting(equal=6).agreement == 0.75
        assert SettingResult("kv8", False, 100, 0.5).agreement == 0.0


class TestCombiningCases:
    def test_tokens_and_reuse_summed_the_largest_difference_kept(self):
        cases = [CaseResult("chat", 2, 10, 9, 2e-3, 16, True),
                 CaseResult("random", 2, 6, 6, 5e-4, 0, False)]
        assert _combine("kv8", False, 4608, 0.5, cases) == SettingResult(
            "kv8", False, 4608, 0.5, tokens_compared=16, tokens_equal=15,
            max_abs_logit_diff=2e-3, reused_tokens=16)
