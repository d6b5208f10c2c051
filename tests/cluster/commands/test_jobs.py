"""``orchard submit/results/jobs/cancel`` (``cluster.commands.jobs``): through the real CLI
against a real frontend over a LocalBackend, the OpenAI Batch formats in and out (a file
submitted and waited on, its results written, a priority carried, errors naming the file's
line, a response format and log-probabilities); and how ``--since`` reads a duration or a UTC time. Listing over gRPC is in
``tests/cluster/api/test_servicer.py``, pruning in ``tests/cluster/jobs/test_store.py``."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from cluster.cli import main
from cluster.commands.jobs import parse_since
from router.cost import load_price_table
from tests.support.batch_lines import USER, line
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG as CONFIG, running_frontend
from tests.support.paths import REPO
from tests.support.structured_jobs import BROKEN, BROKEN_PATH, PET, batch_line, fmt


EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=2) as harness:
        yield harness


def cli(frontend, *args):
    return main([*args, "--address", frontend.address, "--api-key", "key-acme"])


def test_submit_wait_json_then_results_in_openai_format(frontend, tmp_path, capsys):
    assert cli(frontend, "submit", str(EXAMPLES / "demo_batch.jsonl"), "--wait", "--json",
               "--run-dir", str(frontend.config.run_dir)) == 0
    captured = capsys.readouterr()
    job = json.loads(captured.out)
    assert (job["state"], job["total"], job["completed"], job["failed"]) == (
        "succeeded", 24, 24, 0)
    assert "24/24 done" in captured.err  # progress while waiting
    out = tmp_path / "results.jsonl"
    assert cli(frontend, "results", job["job_id"], "--out", str(out)) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [
        json.loads(x)["custom_id"] for x in (EXAMPLES / "demo_batch.jsonl").read_text().splitlines()]
    usage = [x["response"]["body"]["usage"] for x in lines]
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in lines)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert sum(cached) > 0.5 * sum(u["prompt_tokens"] for u in usage)  # shared prefixes reused
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usage)
    # --wait ends with the job's summary line, its counts the results' own.
    summary = captured.err.strip().splitlines()[-1]
    computed = sum(u["prompt_tokens"] for u in usage) - sum(cached)
    assert summary.startswith(f"{job['job_id']}: 24 requests (0 failed), {sum(cached)} cached + "
                              f"{computed} computed input tokens; M forecast 0.")
    version = load_price_table(None).version
    assert "measured 0." in summary and summary.endswith(f"uncached-token units (price table "
                                                         f"{version})")
    assert cli(frontend, "jobs", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["job_id"] == job["job_id"]


def test_submit_with_a_priority_prints_it_with_the_job(frontend, tmp_path, capsys):
    path = tmp_path / "one.jsonl"
    path.write_text(line("a", USER, max_tokens=1) + "\n")
    assert cli(frontend, "submit", str(path), "--json", "--priority", "interactive") == 0
    job = json.loads(capsys.readouterr().out)
    assert (job["total"], job["priority"]) == (1, "interactive")
    assert cli(frontend, "submit", str(path), "--json") == 0
    batch = json.loads(capsys.readouterr().out)
    assert batch["priority"] == "batch"
    with frontend.client("acme") as client:   # both ended before the next test lists jobs
        assert [client.wait(j["job_id"]).priority for j in (job, batch)] == [
            "interactive", "batch"]
    with pytest.raises(SystemExit):   # argparse names the choices
        cli(frontend, "submit", str(path), "--priority", "urgent")
    assert "invalid choice: 'urgent'" in capsys.readouterr().err


def test_server_side_errors_name_the_line(frontend, tmp_path, capsys):
    with frontend.client("acme") as client:
        before = client.jobs()
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([line("a", USER), line("b", [{"role": "robot", "content": "x"}]),
                               line("c", [{"role": "user", "content": 3}])]) + "\n")
    assert cli(frontend, "submit", str(path)) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT: bad.jsonl:2: body.messages[0].role: unknown role 'robot'" in err
    path.write_text(line("a", USER) + "\n" + line("a", USER) + "\n")
    assert cli(frontend, "submit", str(path)) == 2
    assert ("bad.jsonl:2: custom_id: duplicate 'a' (first at bad.jsonl:1)"
            in capsys.readouterr().err)
    with frontend.client("acme") as client:
        assert client.jobs() == before  # refused files leave no job


def test_values_protobuf_cannot_hold_and_bytes_that_are_not_utf8_name_their_line(
        frontend, tmp_path, capsys):
    path = tmp_path / "batch.jsonl"
    path.write_text(line("a", USER) + "\n" + line("b", USER, seed=1.5) + "\n")
    assert cli(frontend, "submit", str(path)) == 2
    err = capsys.readouterr().err
    assert ("batch.jsonl:2: body.seed must be an integer from 0 to 18446744073709551615, got 1.5"
            in err) and "Traceback" not in err
    path.write_bytes(line("a", USER).encode() + b"\n\xff\xfe\n")
    assert cli(frontend, "submit", str(path)) == 2
    assert "batch.jsonl:2: not UTF-8 text (byte 0xff at column 1)" in capsys.readouterr().err


def test_malformed_file_and_unknown_job_at_the_command_line(frontend, tmp_path, capsys):
    path = tmp_path / "broken.jsonl"
    path.write_text(line("a", USER) + "\n{oops\n")
    assert cli(frontend, "submit", str(path)) == 2
    assert "broken.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert cli(frontend, "results", "job-nope") == 1
    assert "NOT_FOUND" in capsys.readouterr().err


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
