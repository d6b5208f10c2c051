"""``orchard bench overload``: its figures from known outcomes, exactly, and the command end to
end at a small size (every figure measured, none made up)."""
import json

import pytest

from cluster.bench.overload import OverloadSettings, Outcome, figures_of
from cluster.cli import main


def test_the_figures_of_known_outcomes():
    settings = OverloadSettings(seconds=10.0, deadline_s=1.0)
    outcomes = ([Outcome(0.4)] * 6 + [Outcome(1.5)] * 2            # 8 accepted, 2 late
                + [Outcome(None, "RESOURCE_EXHAUSTED", 3)] * 9     # refused with a Retry-After
                + [Outcome(None, "RESOURCE_EXHAUSTED")]            # ... one without
                + [Outcome(None, "UNAVAILABLE"), Outcome(0.2, "INTERNAL")])  # failures
    f = figures_of(outcomes, capacity=2.0, rate=4.0, progress=17, gap_s=1.5, settings=settings)
    assert (f.sent, f.accepted, f.served_late) == (20, 9, 2)
    assert (f.refused, f.refused_without_retry_after, f.failed) == (9, 1, 2)
    assert f.interactive_deadline_met_share == 7 / 9
    assert f.refused_share == 9 / 20
    assert (f.batch_progress, f.batch_longest_gap_s) == (17, 1.5)
    assert (f.capacity_per_s, f.rate_per_s, f.deadline_s) == (2.0, 4.0, 1.0)


def test_nothing_accepted_reads_zero_not_a_division_by_zero():
    f = figures_of([Outcome(None, "RESOURCE_EXHAUSTED", 1)], 1.0, 2.0, 0, 0.0,
                   OverloadSettings())
    assert (f.interactive_deadline_met_share, f.refused_share, f.ttft_p50_s) == (0.0, 1.0, 0.0)


def test_bad_settings_are_refused_naming_the_flags():
    with pytest.raises(ValueError, match="--seconds, --calibrate, --deadline and --overload"):
        OverloadSettings(seconds=0).check()
    with pytest.raises(ValueError, match="--concurrent, --max-tokens and --batch-requests"):
        OverloadSettings(batch_requests=0).check()


@pytest.mark.slow
def test_bench_overload_json(capsys):
    from tests.support.forged_models import tiny_model

    assert main(["bench", "overload", "--seconds", "3", "--calibrate", "2",
                 "--batch-requests", "100", "--json", "--model", str(tiny_model())]) == 0
    figures = json.loads(capsys.readouterr().out)
    for name in ("interactive_deadline_met_share", "refused_share"):
        assert 0.0 <= figures[name] <= 1.0
    # every request is accepted or refused or failed (a stream failing after its first
    # token counts as accepted and as failed)
    assert figures["accepted"] + figures["refused"] + figures["refused_without_retry_after"] \
        <= figures["sent"] <= figures["accepted"] + figures["refused"] + figures[
            "refused_without_retry_after"] + figures["failed"]
    assert figures["served_late"] <= figures["accepted"]
    assert figures["capacity_per_s"] > 0 and figures["batch_progress"] >= 0
