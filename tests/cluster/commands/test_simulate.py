"""``orchard simulate`` (``cluster.commands.simulate``): how it reads ``--spec WIDTH:ACCEPTED``.
The simulator's replays, and the command's output on them, are in ``tests/router/sim/``."""
from __future__ import annotations

import pytest

from cluster.commands.simulate import _speculation
from router.sim.steps import Speculation


class TestTheSpecOption:
    def test_no_option_is_no_speculation(self):
        assert _speculation(None) is None

    def test_width_and_mean_accepted_drafts(self):
        assert _speculation("4:2.5") == Speculation(4, 2.5)
        assert _speculation("1:0") == Speculation(1, 0.0)
        assert _speculation("3:3") == Speculation(3, 3.0)

    @pytest.mark.parametrize("value", ["4", "4:", ":2", "four:2", "4:half", "2.5:1"])
    def test_a_value_not_width_colon_accepted_shows_the_form(self, value):
        with pytest.raises(ValueError) as refused:
            _speculation(value)
        assert str(refused.value) == (
            f"--spec must be WIDTH:ACCEPTED (e.g. 4:2.5), got {value!r}")

    @pytest.mark.parametrize("value, width, accepted", [("0:0", 0, 0.0), ("4:4.5", 4, 4.5),
                                                         ("2:-1", 2, -1.0)])
    def test_numbers_outside_the_range_name_the_option(self, value, width, accepted):
        with pytest.raises(ValueError) as refused:
            _speculation(value)
        assert str(refused.value) == (
            f"--spec {value}: speculation: need width >= 1 and 0 <= accepted <= width, got "
            f"width {width}, accepted {accepted}")
