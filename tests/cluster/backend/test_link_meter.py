"""A worker's links from its peers (``cluster.backend.link_meter``): each pull that ran to its
end moves that peer's figures by the pull-cost rule, exactly; a pull that ended early or
moved nothing measures nothing; the report is by peer id."""
from __future__ import annotations

import pytest

from cluster.backend.link_meter import LinkMeter
from cluster.backend.wire import PullOutcome
from router.pull_cost import LinkRate


def _pulled(peer: str, nbytes: int, seconds: float, refused: str = "") -> PullOutcome:
    return PullOutcome(peer, 1, 16, nbytes, seconds, refused)


def test_each_finished_pull_moves_its_peers_figures():
    meter = LinkMeter(LinkRate(1e6, 0.01))
    assert meter.report() == ()
    meter.observe(_pulled("w2", 1 << 20, 1.01))   # large: the bandwidth, 1 MiB in 1.0 s
    meter.observe(_pulled("w0", 1000, 0.02))      # small: the fixed cost, 0.02 - 0.001 s
    assert [(m.peer, m.bytes_s, m.fixed_s) for m in meter.report()] == [
        ("w0", 1e6, pytest.approx(0.7 * 0.01 + 0.3 * 0.019)),
        ("w2", pytest.approx(0.7e6 + 0.3 * (1 << 20)), 0.01)]
    meter.observe(_pulled("w2", 1 << 20, 1.01))   # the second moves on from the first
    bandwidth = 0.7e6 + 0.3 * (1 << 20)
    assert meter.report()[1].bytes_s == pytest.approx(0.7 * bandwidth
                                                      + 0.3 * (1 << 20) / (1.01 - 0.01))


def test_a_pull_that_ended_early_or_moved_nothing_measures_nothing():
    meter = LinkMeter(LinkRate(1e6, 0.01))
    meter.observe(_pulled("w0", 1 << 20, 30.0, refused="too slow: the pull's deadline passed"))
    meter.observe(_pulled("w0", 0, 0.5))
    meter.observe(_pulled("w0", 1000, 0.0))
    assert meter.report() == ()
