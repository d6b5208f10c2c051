"""``orchard submit/results/jobs/cancel`` (``cluster.commands.jobs``): how ``--since`` reads a
duration or a UTC time. The commands against a frontend are tested with it: submitting and
results in ``tests/cluster/api/test_submit.py``, listing in ``tests/cluster/api/test_list_jobs.py``,
pruning in ``tests/cluster/jobs/test_store.py``."""
from __future__ import annotations

import time

import pytest

from cluster.cli import main
from cluster.commands.jobs import parse_since


class TestTheSinceOption:
    def test_since_takes_durations_and_utc_times(self):
        assert parse_since("90m", 10_000.0) == (10_000 - 5_400) * 1000
        assert parse_since("2d", 200_000.0) == (200_000 - 172_800) * 1000
        assert parse_since("2026-11-30", 0) == 1_795_996_800_000
        assert parse_since("2026-11-30T08:00", 0) == 1_795_996_800_000 + 8 * 3_600_000
        with pytest.raises(ValueError, match="--since: 'yesterday'"):
            parse_since("yesterday", 0)

    def test_a_fractional_duration_and_spaces_around_it(self):
        assert parse_since(" 1.5h ", 10_000.0) == (10_000 - 5_400) * 1000
        assert parse_since("30s", 100.5) == 70_500
        assert parse_since("0d", 7.0) == 7_000

    def test_a_time_without_an_offset_is_utc_whatever_the_machines_zone(self, monkeypatch):
        monkeypatch.setenv("TZ", "America/New_York")
        time.tzset()
        try:
            assert parse_since("2026-11-30T08:00", 0) == 1_795_996_800_000 + 8 * 3_600_000
        finally:
            monkeypatch.undo()
            time.tzset()

    def test_a_time_with_its_own_offset_keeps_it(self):
        assert parse_since("2026-11-30T09:00+01:00", 0) == 1_795_996_800_000 + 8 * 3_600_000

    @pytest.mark.parametrize("text", ["5w", "h", "1.2.3h", "-2d", ""])
    def test_anything_else_says_both_forms(self, text):
        with pytest.raises(ValueError) as refused:
            parse_since(text, 0)
        assert str(refused.value) == (
            f"--since: {text.strip()!r} is neither a duration (90m, 6h, 2d) nor a UTC date or "
            "time (2026-11-30, 2026-11-30T08:00)")

    def test_the_command_refuses_it_before_asking_a_frontend(self, tmp_path, capsys):
        assert main(["jobs", "--run-dir", str(tmp_path), "--since", "yesterday"]) == 2
        assert capsys.readouterr().err.startswith("orchard: error: --since: 'yesterday' is ")
