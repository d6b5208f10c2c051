"""``orchard report`` (``cluster.commands.report``): which trace directory it reads, how it
counts lines it cannot read, and a recorded run: real engines and router, traces written as
OTLP JSON lines under the run directory, then read back by the CLI (JSON, text and the plot;
a job filter; clear errors for bad arguments). The report's figures built from spans are in
``tests/cluster/report/``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.cli import main
from cluster.telemetry.setup import TelemetrySettings, setup_telemetry
from tests.support.traced_cluster import TracedCluster, Turn
from router.kv.key import hash_blocks
from tests.conftest import Clock
from tests.support.forged_models import tiny_model

SYSTEM = "You are a careful assistant for orchard. Answer briefly and cite the manual. " * 3


def conversation(tc, tenant, name, job, turns, drift_at=None):
    """Turns of a chat; from ``drift_at`` on, the system prompt carries a changing stamp."""
    history = []
    out = []
    for i in range(turns):
        system = SYSTEM if drift_at is None or i < drift_at else f"[turn {i}] " + SYSTEM
        history.append({"role": "user", "content": f"question {i} about {name}: how do I prune?"})
        prompt = tc.render([{"role": "system", "content": system}, *history])
        out.append(Turn(f"{name}-{i}", tenant, prompt, 4, job, name, i))
        history.append({"role": "assistant", "content": f"answer {i}: cut above the node."})
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    tel = setup_telemetry(TelemetrySettings("orchard-frontend", run_dir))
    clock = Clock()
    tc = TracedCluster(tiny_model("llama"), 2, tel, block_size=16, ttl_s=300.0, clock=clock)
    job1 = (conversation(tc, "acme", "c1", "job-1", 3)
            + conversation(tc, "acme", "c2", "job-1", 3, drift_at=2))
    job2 = conversation(tc, "beta", "c3", "job-2", 2)
    cached = {}  # the engines' own counts, per job: what the report must read back
    for job_id, turns in (("job-1", job1), ("job-2", job2)):
        chains = [hash_blocks(t.prompt, 16, tc.engine().namespace(t.tenant)) for t in turns]
        plans, held = tc.observer.plan_job(chains, [len(t.prompt) for t in turns],
                                           [t.max_tokens for t in turns], 1, 1.0)
        tc.observer.submit_job(job_id, turns[0].tenant, plans, held)
        for turn in turns:
            cached[job_id] = cached.get(job_id, 0) + tc.run(turn).result.cached_tokens
            clock.now += 1.0
    tel.shutdown()
    return Recorded(run_dir, cached)


@dataclass(frozen=True)
class Recorded:
    run_dir: Path
    cached_tokens: dict[str, int]


def report_json(capsys, *args):
    assert main(["report", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_per_job(recorded, capsys):
    report = report_json(capsys, "--run-dir", str(recorded.run_dir))
    jobs = {j["job_id"]: j for j in report["jobs"]}
    assert set(jobs) == {"job-1", "job-2"}
    j1 = jobs["job-1"]
    for key in ("requests", "input_tokens", "cached_tokens", "written_tokens",
                "forecast_multiplier", "measured_multiplier", "miss_causes"):
        assert key in j1
    assert j1["requests"] == 6 and j1["cached_tokens"] == recorded.cached_tokens["job-1"]
    assert jobs["job-2"]["cached_tokens"] == recorded.cached_tokens["job-2"]
    assert 0 < j1["measured_multiplier"] < 1.25
    assert abs(j1["forecast_multiplier"] - j1["measured_multiplier"]) < 0.25
    assert sum(j1["miss_causes"].values()) <= j1["input_tokens"] - j1["cached_tokens"]
    assert "first_sight" in j1["miss_causes"]
    assert {t["key"] for t in report["tenants"]} == {"acme", "beta"}
    assert report["unreadable_lines"] == 0
    # recorded without speculation: nothing drafted, no acceptance rate
    assert (j1["drafted_tokens"], j1["accepted_tokens"], j1["acceptance"]) == (0, 0, None)


def test_template_drift_and_near_misses(recorded, capsys):
    report = report_json(capsys, "--run-dir", str(recorded.run_dir))
    drift = report["template_drift"]
    assert [(d["conversation"], d["turn"]) for d in drift] == [("c2", 2)]
    assert drift[0]["diverged_at_block"] < drift[0]["previous_prompt_blocks"]
    near = report["near_misses"]
    assert near and near[0]["line"].startswith("common=")
    # The stamped system prompt shares at most the template's first tokens with anything stored.
    drifted = next(n for n in near if n["request_id"] == "c2-2")
    assert drifted["common_prefix"] < 16 and drifted["cached_tokens"] == 0
    # Where the worker held the shared run, the decoded text around the divergence is there.
    # It reused the common prefix's whole blocks and, from a kept cache, possibly the partial
    # block up to the divergence: never past it.
    shown = [n for n in near if n["prompt_next"]]
    assert shown and shown[0]["common_prefix"] // 16 * 16 <= shown[0]["cached_tokens"]
    assert shown[0]["cached_tokens"] <= shown[0]["common_prefix"]
    assert shown[0]["text_before"] and shown[0]["stored_next"]
    # the stamped template's near misses are counted under their template
    assert report["near_miss_positions"] and report["near_miss_positions"][0]["near_misses"] >= 1


def test_job_filter_text_and_plot(recorded, capsys, tmp_path):
    report = report_json(capsys, "--traces", str(recorded.run_dir / "traces"), "--job", "job-2")
    assert [j["job_id"] for j in report["jobs"]] == ["job-2"] and report["requests"] == 2
    plot = tmp_path / "m.png"
    assert main(["report", "--run-dir", str(recorded.run_dir), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "Per job" in text and "job-1" in text and "Worst near misses" in text
    assert "Near-miss positions by prompt template" in text
    assert "drafts accepted" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_get_clear_errors(recorded, tmp_path, capsys):
    assert main(["report", "--run-dir", str(recorded.run_dir), "--job", "nope"]) == 2
    assert "no requests of job 'nope'" in capsys.readouterr().err
    assert main(["report", "--traces", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", "--run-dir", str(recorded.run_dir), "--plot", str(tmp_path / "x.svg")]) == 2
    assert "PNG" in capsys.readouterr().err


def test_the_report_counts_writes_by_ttl_bypasses_and_salts(tmp_path, capsys):
    from workers.messages import CacheControls

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tel = setup_telemetry(TelemetrySettings("orchard-frontend", run_dir))
    tc = TracedCluster(tiny_model("llama"), 1, tel, block_size=16, ttl_s=300.0, clock=Clock())
    prompt = lambda i: tuple(range(1000 * i, 1000 * i + 40))  # noqa: E731  2 full blocks
    turns = [Turn("hour", "acme", prompt(1), 4, cache=CacheControls(ttl_s=3600.0)),
             Turn("store", "acme", prompt(2), 4),
             Turn("cold", "acme", prompt(2), 4, cache=CacheControls(read=False)),
             Turn("bypass", "acme", prompt(3), 4, cache=CacheControls(write=False)),
             Turn("salted", "acme", prompt(4), 4, salt="team-secret")]
    for turn in turns:
        tc.run(turn)
    tc.close()
    tel.shutdown()
    assert main(["report", "--run-dir", str(run_dir), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    assert total["written_by_ttl"] == {"5m": 64, "1h": 32}  # store and salted; hour
    assert total["bypassed"] == {"read": 1, "write": 1}
    assert total["salted_requests"] == 1
    assert main(["report", "--run-dir", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert ("  prompt tokens written: 64 at 5 minutes, 32 at 1 hour\n"
            "  bypassed: 1 read nothing, 1 wrote nothing; salted: 1 requests\n") in text
    assert "team-secret" not in text
    assert not any("team-secret" in p.read_text() for p in run_dir.rglob("*") if p.is_file())


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
