"""``cluster.cli``: the ``orchard`` entry point finds every command module and turns the errors
meant for the user into one ``orchard: error:`` line and an exit status, never a traceback."""
from __future__ import annotations

import pkgutil

from cluster import commands
from cluster.cli import build_parser, main


def _commands() -> list[str]:
    return sorted(build_parser()._subparsers._group_actions[0].choices)


class TestWhatItRegisters:
    def test_every_command_module_adds_its_commands(self):
        assert sorted(m.name for m in pkgutil.iter_modules(commands.__path__)) == [
            "bench", "cache", "chat", "cluster_ops", "demo", "jobs", "keys", "model", "plan",
            "replay", "report", "simulate", "tls", "traces", "verify"]
        assert _commands() == [
            "bench", "cache", "cancel", "chat", "demo", "down", "drain", "frontends",
            "invalidate", "jobs", "keys", "model", "plan", "replay", "report", "results",
            "scale", "simulate", "submit", "tls", "traces", "up", "verify", "workers"]

    def test_no_command_prints_the_help_and_exits_2(self, capsys):
        assert main([]) == 2
        out = capsys.readouterr().out
        assert out.startswith("usage: orchard [-h] COMMAND ...")
        assert "Prefix-cache-aware LLM serving on a Ray cluster of Macs" in out


class TestHowErrorsEnd:
    def test_a_value_error_is_one_line_and_status_2(self, tmp_path, capsys):
        assert main(["report", "--run-dir", str(tmp_path), "--traces", str(tmp_path)]) == 2
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == (
            "", "orchard: error: give --run-dir or --traces, not both\n")

    def test_a_missing_file_is_one_line_and_status_2(self, tmp_path, capsys):
        missing = tmp_path / "batch.jsonl"
        assert main(["demo", "--batch", str(missing)]) == 2
        assert capsys.readouterr().err == (
            f"orchard: error: {missing} does not exist: pass --batch FILE.jsonl\n")
