"""``orchard plan`` (``cluster.commands.plan``): how it reads the grid's comma-separated lists
and how it writes token counts and TTLs in its tables. The plans themselves, and the command's
output on a workload whose answer is known, are in ``tests/router/sim/test_planner.py``."""
from __future__ import annotations

import pytest

from cluster.cli import build_parser, main
from cluster.commands.plan import _tokens, _ttl


def _plan_args(*argv: str):
    return build_parser().parse_args(["plan", *argv])


class TestTheGridLists:
    def test_integers_take_underscores_and_skip_empty_items(self):
        args = _plan_args("--workers", "1, 2,", "--memory-tokens", "250_000,1_000_000",
                          "--disk-tokens", "0")
        assert (args.workers, args.memory_tokens, args.disk_tokens) == (
            (1, 2), (250_000, 1_000_000), (0,))

    def test_ttls_are_numbers(self):
        assert _plan_args("--ttls-s", "300,1.5e3").ttls_s == (300.0, 1500.0)

    def test_the_defaults(self):
        args = _plan_args()
        assert (args.workers, args.memory_tokens, args.disk_tokens, args.ttls_s) == (
            (4, 8, 16), (250_000, 1_000_000), (0, 8_000_000), (300.0, 3600.0))

    @pytest.mark.parametrize("flag, value, message", [
        ("--workers", "4,eight", "argument --workers: expected comma-separated integers, "
                                 "got '4,eight'"),
        ("--memory-tokens", "1.5", "argument --memory-tokens: expected comma-separated "
                                   "integers, got '1.5'"),
        ("--ttls-s", "5m", "argument --ttls-s: expected comma-separated numbers, got '5m'"),
    ])
    def test_a_list_it_cannot_read_is_a_usage_error(self, capsys, flag, value, message):
        with pytest.raises(SystemExit) as exited:
            main(["plan", flag, value])
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"orchard plan: error: {message}"


class TestHowTablesWriteSizes:
    @pytest.mark.parametrize("tokens, shown", [
        (0, "0"), (999, "999"), (1000, "1k"), (250_000, "250k"), (999_999, "999.999k"),
        (1_000_000, "1M"), (8_500_000, "8.5M")])
    def test_token_counts(self, tokens, shown):
        assert _tokens(tokens) == shown

    @pytest.mark.parametrize("seconds, shown", [
        (3600.0, "1 h"), (7200.0, "2 h"), (300.0, "5 min"), (5400.0, "90 min"), (50.0, "50 s"),
        (30.0, "30 s"), (90.5, "90.5 s")])
    def test_ttls_in_the_largest_whole_unit(self, seconds, shown):
        assert _ttl(seconds) == shown
