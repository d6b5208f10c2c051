"""``orchard report`` (``cluster.commands.report``): which trace directory it reads, and how it
counts lines it cannot read. The report's figures from real traces are in
``tests/cluster/report/``."""
from __future__ import annotations

import json

from cluster.cli import main


def _missing(path) -> str:
    return (f"orchard: error: trace directory {path} does not exist; pass --traces DIR or the "
            "--run-dir of a cluster that has run\n")


class TestWhichTracesItReads:
    def test_traces_names_the_directory_and_run_dir_its_traces_folder(self, tmp_path, capsys):
        assert main(["report", "--traces", str(tmp_path / "mine")]) == 2
        assert capsys.readouterr().err == _missing(tmp_path / "mine")
        assert main(["report", "--run-dir", str(tmp_path)]) == 2
        assert capsys.readouterr().err == _missing(tmp_path / "traces")

    def test_without_either_it_reads_the_default_run_dir(self, tmp_path, monkeypatch, capsys):
        monkeypatch.setenv("ORCHARD_RUN_DIR", str(tmp_path / "run"))
        assert main(["report"]) == 2
        assert capsys.readouterr().err == _missing(tmp_path / "run" / "traces")


class TestUnreadableLines:
    def test_they_are_counted_in_the_json_and_named_under_the_tables(self, tmp_path, capsys):
        traces = tmp_path / "traces"
        traces.mkdir()
        (traces / "frontend.jsonl").write_text("{oops\nnot json either\n")
        assert main(["report", "--traces", str(traces), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["unreadable_lines"], result["requests"]) == (2, 0)
        assert "series" not in result
        assert main(["report", "--traces", str(traces)]) == 0
        assert capsys.readouterr().out.endswith("(2 unreadable trace lines skipped)\n")
