"""Job forecasts against the simulator on a synthetic trace the forecast was not tuned on."""
import pytest

from router.sim.forecast_replay import forecast_replay
from router.sim.simulator import SimConfig
from router.sim.trace import SynthShape, synthesize


@pytest.fixture(scope="module")
def result():
    trace = synthesize(SynthShape(requests=1500, rate_per_s=2.0), seed=11)
    config = SimConfig(workers=4, capacity_tokens=200_000, block_size=512, ttl_s=300.0)
    return forecast_replay(trace, config, window_s=120.0)


def test_forecast_tracks_the_measured_multiplier(result):
    assert result.requests == 1500
    assert result.write_rate == 1.25            # a 5-minute TTL
    assert 0.0 < result.measured_hit_ratio < 1.0
    assert result.error <= 0.05
    assert len(result.windows) >= 5
    assert sum(w.requests for w in result.windows) == 1500


def test_windows_are_forecast_without_their_own_outcomes(result):
    # The first window has no history: the one-cache model alone, so it may be optimistic,
    # never pessimistic about reuse (the union of the workers' stores bounds each worker's).
    first = result.windows[0]
    assert first.forecast_m <= first.measured_m + 1e-9
    js = result.as_json()
    assert {"forecast_multiplier", "measured_multiplier", "forecast_error",
            "window_error_max", "windows"} <= set(js)


def test_empty_trace_is_refused():
    with pytest.raises(ValueError, match="empty"):
        forecast_replay([], SimConfig())


def test_bench_forecast_command_on_a_trace_file(tmp_path, capsys):
    import json

    from cluster.cli import main
    from router.sim.trace import write_trace

    path = tmp_path / "small.jsonl"
    write_trace(synthesize(SynthShape(requests=300, rate_per_s=2.0), seed=3), path)
    assert main(["bench", "forecast", "--trace", str(path), "--workers", "2",
                 "--capacity-tokens", "100000", "--window", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 300 and out["workers"] == 2
    assert out["forecast_error"] == abs(out["forecast_multiplier"] - out["measured_multiplier"])
    assert main(["bench", "forecast"]) == 2
    assert "--demo FILE.jsonl" in capsys.readouterr().err
