"""The one percentile that every benchmark, the simulator and the reports use.

Nearest rank: the smallest value with at least ``q`` of the values at or below it, so a p99
of 100 samples is the 99th smallest and a p50 of an even count is the lower middle value.
Always a value that was measured, never an interpolation between two.
"""
from __future__ import annotations

import math
from typing import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``0 < q <= 1``) of ``values``; 0.0 when there are none."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q must be in (0, 1], got {q}: pass 0.99 for a p99")
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
