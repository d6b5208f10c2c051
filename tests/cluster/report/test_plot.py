"""The report's plot (``cluster.report.plot``): idle gaps compressed on the time axis, their
labels stepped up where they would overlap, and the PNG it writes.
"""
from __future__ import annotations

from cluster.report.plot import gap_label_levels


def test_idle_gap_labels_close_together_step_up():
    # an axis 100 wide: gaps 1 apart (under 3%) step up, cycling through 3 heights
    assert gap_label_levels([10, 11, 12, 13, 50, 51], 100.0) == [0, 1, 2, 0, 0, 1]
    assert gap_label_levels([], 100.0) == []
