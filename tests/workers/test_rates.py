"""The moving average every measured rate goes through (``workers.rates.moving_average``)."""
from __future__ import annotations

from workers.rates import EMA_WEIGHT, moving_average


class TestMovingAverage:
    def test_the_newest_measurement_weighs_0_3(self):
        assert EMA_WEIGHT == 0.3
        assert moving_average(10.0, 20.0) == 0.7 * 10.0 + 0.3 * 20.0 == 13.0

    def test_the_first_measurement_stands_alone(self):
        assert moving_average(None, 5.5) == 5.5
        assert moving_average(0.0, 5.5) == 5.5

    def test_a_run_of_measurements_converges_on_them(self):
        value = None
        for _ in range(40):
            value = moving_average(value, 8.0 if value is not None else 2.0)
        assert abs(value - 8.0) < 1e-5
        assert moving_average(moving_average(2.0, 8.0), 8.0) == 0.7 * 3.8 + 0.3 * 8.0
