"""``orchard bench`` (``cluster.commands.bench``): the benchmarks it registers and the arguments
it refuses before any model loads. What each benchmark measures is tested beside it
(``workers/lab/``, ``cluster/bench/``)."""
from __future__ import annotations

import pytest

from cluster.cli import build_parser, main


class TestWhatItRegisters:
    def test_every_benchmark_is_a_subcommand_and_bench_alone_prints_them(self, capsys):
        bench = build_parser()._subparsers._group_actions[0].choices["bench"]
        assert sorted(bench._subparsers._group_actions[0].choices) == [
            "agent-loop", "api", "batch", "cache-controls", "cluster", "disk", "engine",
            "forecast", "frontends", "outputs", "overload", "profile", "pull", "spans", "spec",
            "telemetry", "ttl-forecast", "vs-mlx-lm"]
        assert main(["bench"]) == 2
        assert "vs-mlx-lm" in capsys.readouterr().out


class TestWhatItRefuses:
    def test_bad_arguments_are_refused(self, capsys):
        assert main(["bench", "outputs", "--requests", "0"]) != 0
        assert "--requests, --max-tokens and --rounds must each be >= 1" in capsys.readouterr().err

    @pytest.mark.parametrize("extra", [["--turns", "0"], ["--block-size", "0"],
                                       ["--long-prompt", "0"], ["--prefill-tokens", "-1"]])
    def test_engine_needs_positive_sizes(self, tmp_path, capsys, extra):
        assert main(["bench", "engine", "--model", str(tmp_path), *extra]) == 2
        assert capsys.readouterr().err == (
            "orchard: error: --turns, --reply-tokens, --block-size, --long-prompt, "
            "--stall-rounds, --prefill-prompts and --prefill-tokens must be positive\n")

    @pytest.mark.parametrize("extra", [["--prefix-tokens", "31"], ["--trials", "0"],
                                       ["--decode-pairs", "0"]])
    def test_disk_needs_a_prefix_of_two_blocks_and_a_trial(self, tmp_path, capsys, extra):
        assert main(["bench", "disk", "--model", str(tmp_path), *extra]) == 2
        assert capsys.readouterr().err == (
            "orchard: error: --prefix-tokens must be >= 32, --trials and --decode-pairs >= 1\n")

    def test_a_prefix_of_32_tokens_passes_the_check(self, tmp_path, capsys):
        # past the check, the benchmark opens the model: a directory without one says so
        assert main(["bench", "disk", "--model", str(tmp_path / "none"),
                     "--prefix-tokens", "32"]) == 2
        assert "--prefix-tokens" not in capsys.readouterr().err
