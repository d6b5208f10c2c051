"""``orchard submit`` / ``results`` / ``jobs``: the OpenAI Batch formats through the real CLI."""
from tests.support.paths import REPO
import json
import sys
from pathlib import Path

import pytest

from cluster.api.batchfile import parse_batch
from cluster.cli import main
from router.cost import load_price_table
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG as CONFIG, running_frontend

EXAMPLES = REPO / "examples"
sys.path.insert(0, str(EXAMPLES))
import make_batch  # noqa: E402


def line(custom_id, messages, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": messages, **body}})


USER = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("text, lineno, what", [
    ("{not json", 2, "not valid JSON"),
    ('["a list"]', 2, "must be a JSON object"),
    (json.dumps({"method": "POST", "body": {"messages": USER}}), 2, "custom_id"),
    (json.dumps({"custom_id": "x", "url": "/v1/embeddings", "body": {"messages": USER}}), 2,
     "url must be /v1/chat/completions"),
    (json.dumps({"custom_id": "x", "method": "GET", "body": {"messages": USER}}), 2, "method"),
    (json.dumps({"custom_id": "x", "body": {"messages": "hi"}}), 2, "body.messages"),
    (line("x", USER, max_tokens="ten"), 2, "body.max_tokens"),
    (line("x", USER, stop=[1]), 2, "body.stop"),
])
def test_malformed_lines_name_their_line(text, lineno, what):
    with pytest.raises(ValueError) as err:
        parse_batch([line("ok", USER), text, line("ok2", USER)], name="batch.jsonl")
    assert f"batch.jsonl:{lineno}:" in str(err.value) and what in str(err.value)


def test_blank_lines_are_skipped_and_fields_carried():
    batch = parse_batch(["", line("a", USER, max_tokens=7, temperature=0.5, stop="END"), "  "])
    (request,) = batch.requests
    assert batch.lines == [2]
    assert (request.custom_id, request.sampling.max_tokens, request.sampling.stop) == (
        "a", 7, ["END"])
    assert request.sampling.temperature == pytest.approx(0.5)
    with pytest.raises(ValueError, match="empty"):
        parse_batch(["", "\n"], name="e.jsonl")


def test_demo_batch_is_what_the_generator_writes():
    lines = make_batch.batch_lines(8, 3, 2, 16, "default")
    assert (EXAMPLES / "demo_batch.jsonl").read_text().splitlines() == lines
    batch = parse_batch(lines)
    assert len(batch.requests) == 24
    systems = {r.messages.messages[0].content.string_value for r in batch.requests}
    assert len(systems) == 2


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
