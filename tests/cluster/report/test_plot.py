"""The report's plot (``cluster.report.plot``): idle gaps compressed on the time axis, their
labels stepped up where they would overlap, and the PNG it writes.
"""
from __future__ import annotations

import pytest

from cluster.report.plot import compressed_axis, gap_label_levels, render_plot


class TestTheTimeAxis:
    def test_idle_gaps_over_gap_s_are_drawn_shown_s_wide(self):
        # gaps of 100 s and 194 s, each drawn 2 s wide; 1 s and 4 s steps are kept
        plotted, gaps = compressed_axis([300.0, 0.0, 1.0, 5.0, 105.0, 106.0, 5.0])
        assert [plotted(t) for t in (0.0, 1.0, 5.0, 105.0, 106.0, 300.0)] == [
            0.0, 1.0, 5.0, 7.0, 8.0, 10.0]
        assert gaps == [(6.0, 100.0), (9.0, 194.0)]   # (the gap's middle as drawn, idle s)

    def test_a_gap_of_exactly_gap_s_is_kept(self):
        plotted, gaps = compressed_axis([0.0, 10.0, 30.0], gap_s=10.0, shown_s=2.0)
        assert ([plotted(t) for t in (0.0, 10.0, 30.0)], gaps) == ([0.0, 10.0, 12.0],
                                                                   [(11.0, 20.0)])

    def test_no_times_no_gaps(self):
        plotted, gaps = compressed_axis([])
        assert (plotted(42.0), gaps) == (42.0, [])


class TestGapLabels:
    def test_idle_gap_labels_close_together_step_up(self):
        # an axis 100 wide: gaps 1 apart (under 3%) step up, cycling through 3 heights
        assert gap_label_levels([10, 11, 12, 13, 50, 51], 100.0) == [0, 1, 2, 0, 0, 1]
        assert gap_label_levels([], 100.0) == []


class TestThePng:
    def test_a_path_that_is_not_a_png_is_refused_with_the_fix(self, tmp_path):
        with pytest.raises(ValueError, match=r"give a path ending in .png, not 'm.svg'"):
            render_plot({}, tmp_path / "m.svg")
        assert not (tmp_path / "m.svg").exists()
