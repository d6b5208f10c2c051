"""``orchard simulate`` (``cluster.commands.simulate``): how it reads ``--spec WIDTH:ACCEPTED``,
a profile it refuses or takes, the pulls setting it reports. More of the command's output on
replays is in ``tests/router/sim/test_simulator.py``."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.commands.simulate import _speculation
from router.sim.steps import Speculation
from router.sim.trace import TraceRequest, write_trace
from tests.support.engine_profiles import profile
from tests.support.sim_traces import BS, HOT


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


class TestAProfile:
    def test_simulate_refuses_a_profile_of_another_block_size(self, tmp_path, capsys):
        path, trace = tmp_path / "p.json", tmp_path / "t.jsonl"
        profile().write(path)
        write_trace([TraceRequest(0.0, 600, 5, (1, 2))], trace)
        assert main(["simulate", "--trace", str(trace), "--profile", str(path), "--quiet"]) == 2
        assert "measured with block size 16 (the run uses 512)" in capsys.readouterr().err
        assert main(["simulate", "--trace", str(trace), "--profile", str(path), "--block-size",
                     "16", "--policies", "orchard", "--json", "--quiet"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["service"] == "profile" and out["policies"][0]["itl_p99_s"] == 0.5

    def test_simulate_spec_takes_width_and_acceptance_on_a_profile_with_verify_passes(self, 
            tmp_path, capsys):
        path, trace = tmp_path / "p.json", tmp_path / "t.jsonl"
        profile(draft_widths=(2,), verify_s=((0.6, 0.9),), verify_context=100).write(path)
        write_trace([TraceRequest(0.0, 100, 5, (1,))], trace)
        base = ["simulate", "--trace", str(trace), "--profile", str(path), "--block-size", "16",
                "--policies", "orchard", "--json", "--quiet"]
        assert main([*base, "--spec", "2:1.5"]) == 0
        assert json.loads(capsys.readouterr().out)["policies"][0]["itl_p99_s"] == pytest.approx(0.6)
        assert main([*base, "--spec", "2"]) == 2
        assert "--spec must be WIDTH:ACCEPTED (e.g. 4:2.5), got '2'" in capsys.readouterr().err
        assert main([*base, "--spec", "2:3"]) == 2
        assert "--spec 2:3: speculation: need width >= 1" in capsys.readouterr().err


class TestPulls:
    def test_the_cli_reports_the_setting_and_each_policys_pulled_tokens(self, tmp_path, capsys):
        path = tmp_path / "hot.jsonl"
        write_trace(HOT, path)
        assert main(["simulate", "--trace", str(path), "--workers", "2", "--policies",
                     "orchard,round_robin", "--link-gbps", "10", "--json", "--quiet"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["pulls"] == {"link_gbps": 10.0, "link_fixed_s": 0.002}
        assert [(p["name"], p["pulled_tokens"]) for p in out["policies"]] == [
            ("orchard", 8 * BS), ("round_robin", 0)]


class TestTheDecisionBench:
    def test_decision_bench_json_names_what_the_checks_read(self, capsys):
        code = main(["simulate", "--decision-bench", "--json", "--bench-workers", "3",
                     "--indexed-blocks", "3000", "--block-size", "16", "--prompt-tokens", "256",
                     "--iterations", "20", "--index-bytes", "1048576"])
        assert code == 0
        out = json.loads(capsys.readouterr().out)
        assert {"bytes_per_block", "fill_s", "route_p50_us", "route_p99_us"} <= set(out)
        assert out["index_bytes"] == 1 << 20 and out["indexed_blocks"] >= 3000
