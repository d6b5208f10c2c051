"""``orchard submit/results/jobs/cancel`` (``cluster.commands.jobs``): how ``--since`` reads a
duration or a UTC time, and structured outputs through ``submit`` and ``results`` against a
frontend. More of the commands against a frontend: submitting and results in
``tests/cluster/api/test_submit.py``, listing in ``tests/cluster/api/test_list_jobs.py``,
pruning in ``tests/cluster/jobs/test_store.py``."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from cluster.cli import main
from cluster.commands.jobs import parse_since
from tests.support.structured_jobs import (BROKEN, BROKEN_PATH, PET, acme_frontend, batch_line,
                                           fmt)


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


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    with acme_frontend(tmp_path_factory.mktemp("run")) as harness:
        yield harness


def cli(frontend, *args):
    return main([*args, "--address", frontend.address, "--api-key", "key-acme"])


class TestStructuredOutputsAtTheCommandLine:
    """``orchard submit`` files take ``response_format`` (a schema that cannot compile named by
    its line and path, nothing stored); ``orchard results`` writes each token's log-probability
    in OpenAI's Batch output shape."""

    def test_orchard_submit_names_the_line_and_path_of_a_schema_that_cannot_compile(
            self, frontend, tmp_path, capsys):
        with frontend.client("acme") as client:
            before = client.jobs()
        path = tmp_path / "pets.jsonl"
        path.write_text(batch_line("a", response_format=fmt(PET)) + "\n"
                        + batch_line("b", response_format=fmt(BROKEN)) + "\n")
        assert cli(frontend, "submit", str(path)) == 2
        err = capsys.readouterr().err
        assert f"INVALID_ARGUMENT: pets.jsonl:2: body.{BROKEN_PATH}: " in err
        with frontend.client("acme") as client:
            assert client.jobs() == before

    def test_orchard_results_writes_logprobs_and_outputs_that_validate(self, frontend, tmp_path,
                                                                        capsys):
        path = tmp_path / "pets.jsonl"
        path.write_text("".join(batch_line(f"p{i}", response_format=fmt(PET), logprobs=True,
                                           top_logprobs=1, seed=i, temperature=1.0) + "\n"
                                for i in range(3)))
        assert cli(frontend, "submit", str(path), "--wait", "--json",
                   "--run-dir", str(frontend.config.run_dir)) == 0
        job = json.loads(capsys.readouterr().out)
        out = tmp_path / "results.jsonl"
        assert cli(frontend, "results", job["job_id"], "--out", str(out)) == 0
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [x["custom_id"] for x in lines] == ["p0", "p1", "p2"]
        for x in lines:
            body = x["response"]["body"]
            choice = body["choices"][0]
            jsonschema.validate(json.loads(choice["message"]["content"]), PET)
            entries = choice["logprobs"]["content"]
            assert len(entries) == body["usage"]["completion_tokens"]
            assert all(len(e["top_logprobs"]) == 1 and e["bytes"] == list(
                bytes(e["bytes"])) for e in entries)
            joined = b"".join(bytes(e["bytes"]) for e in entries).decode()
            assert joined.strip() == choice["message"]["content"].strip()
