"""The one percentile (``router.kv.stats.percentile``): nearest rank, always a measured value."""
from __future__ import annotations

import pytest

from router.kv.stats import percentile


class TestPercentile:
    def test_nearest_rank_of_100_values(self):
        values = list(range(100, 0, -1))   # 1..100, unsorted
        assert percentile(values, 0.99) == 99
        assert percentile(values, 1.0) == 100
        assert percentile(values, 0.5) == 50
        assert percentile(values, 0.001) == 1

    def test_an_even_count_takes_the_lower_middle_value_never_a_mean(self):
        assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
        assert percentile([1.5, 2.5], 0.5) == 1.5
        assert percentile([1.5, 2.5], 0.51) == 2.5

    def test_one_value_and_none(self):
        assert percentile([7.25], 0.01) == 7.25
        assert percentile(iter([]), 0.99) == 0.0

    @pytest.mark.parametrize("q", [0.0, -0.5, 1.01, 99])
    def test_a_quantile_outside_0_to_1_says_how_to_ask(self, q):
        with pytest.raises(ValueError) as refused:
            percentile([1.0], q)
        assert str(refused.value) == f"q must be in (0, 1], got {q}: pass 0.99 for a p99"
