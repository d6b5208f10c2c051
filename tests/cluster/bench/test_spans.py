"""``cluster.bench.spans`` (``orchard bench spans``): what drawing spans costs, on the tiny
model and a few calls (behind the ``slow`` marker: each opens an engine): the figures it
reports, per call; and the setups it refuses, before any model opens. The timings
themselves are only checked to be times; what they should be is the benchmark's to say."""
from __future__ import annotations

import pytest

from cluster.bench.spans import bench_spans
from cluster.cli import main
from tests.support.forged_models import tiny_model

FIGURES = ["worker_spans_wall_s", "worker_spans_cpu_s", "route_untraced_wall_s",
           "route_untraced_cpu_s", "route_traced_wall_s", "route_traced_cpu_s"]


@pytest.mark.slow  # each runs the tiny model's engine: a second or two
class TestWhatTheBenchReports:
    def test_its_setup_and_six_times_per_call(self):
        model = tiny_model()
        result = bench_spans(model, calls=2, workers=3)
        assert list(result) == ["model", "calls", "workers", *FIGURES]
        assert (result["model"], result["calls"], result["workers"]) == (str(model), 2, 3)
        assert all(isinstance(result[k], float) and 0 <= result[k] < 1 for k in FIGURES)

    def test_the_command_prints_one_line_per_figure_pair(self, capsys):
        assert main(["bench", "spans", "--model", str(tiny_model()), "--calls", "2",
                     "--workers", "3"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == "2 calls each; router over 3 workers"
        assert [line[:30] for line in lines[1:]] == [
            "worker spans (record_engine)  ", "route + started, untraced     ",
            "route + started, traced       "]
        assert [line.endswith(end) for line, end in zip(lines[1:], (
            "us CPU with export", "us CPU", "us CPU with export"))] == [True] * 3


@pytest.mark.parametrize("calls, workers", [(0, 4), (10, 0)])
def test_no_calls_or_no_workers_is_refused_before_any_model_opens(calls, workers):
    with pytest.raises(ValueError) as refused:
        bench_spans(tiny_model() / "absent", calls=calls, workers=workers)
    assert str(refused.value) == "--calls and --workers must be positive"
