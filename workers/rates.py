"""The moving average every rate a worker measures goes through (one formula, one weight).

The scheduler's step budget (decode step time, prefill tokens per second) and the disk tier's
read bandwidth each keep an exponentially weighted average of their measurements: the newest
counts ``EMA_WEIGHT`` (0.3), so a figure follows a machine whose load changes within a few
steps or reads while one slow outlier moves it by less than a third.
"""
from __future__ import annotations

EMA_WEIGHT = 0.3  # weight of the newest measurement


def moving_average(old: float | None, new: float) -> float:
    """``old`` moved towards ``new``; the first measurement (``old`` None or 0.0) stands alone."""
    return new if not old else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new
