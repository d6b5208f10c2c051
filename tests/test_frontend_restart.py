"""Durability: SIGKILL the frontend mid-job, start it again, every result arrives exactly once.

The frontend is a real subprocess (``python -m cluster.api.frontend``); the job is submitted and
read back with the real ``orchard`` command line.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.api.client import Client
from cluster.jobs.store import JobStore
from forged_models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
ORCHARD = [sys.executable, "-m", "cluster.cli"]
REQUESTS = 16


def write_config(run_dir: Path) -> None:
    (run_dir / "orchard.toml").write_text(f"""
[[tenants]]
name = "acme"
api_keys = ["key-acme"]

[admin]
api_keys = ["key-admin"]

[limits]
max_concurrent = 2

[model]
dir = "{tiny_model()}"
""")


def write_batch(path: Path) -> None:
    with path.open("w") as f:
        for i in range(REQUESTS):
            body = {"model": "tiny", "max_tokens": 120, "temperature": 0,
                    "messages": [{"role": "system", "content": "Answer at length. " * 8},
                                 {"role": "user", "content": f"Tell me about topic {i}."}]}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def start_frontend(run_dir: Path) -> subprocess.Popen:
    (run_dir / "frontend.json").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "cluster.api.frontend", "--run-dir", str(run_dir),
                             "--workers", "1"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=open(run_dir / "frontend.log", "ab"))
    deadline = time.monotonic() + 120
    while not (run_dir / "frontend.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((run_dir / "frontend.log").read_text()[-3000:])
        time.sleep(0.05)
    return proc


def orchard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ORCHARD, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "ORCHARD_API_KEY": "key-acme"})


@pytest.mark.slow
def test_sigkill_mid_job_then_restart_finishes_with_every_result_once(tmp_path):
    write_config(tmp_path)
    batch = tmp_path / "batch.jsonl"
    write_batch(batch)
    proc = start_frontend(tmp_path)
    try:
        submitted = orchard("submit", str(batch), "--json", "--run-dir", str(tmp_path))
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]
        client = Client.from_run_dir(tmp_path, api_key="key-acme")
        deadline = time.monotonic() + 120
        while (done := client.job(job_id).done) < 3:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.02)
        before = {r.custom_id: r for r in client.results(job_id)}
        client.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert 3 <= done < REQUESTS, "kill landed after the job finished: make it longer"

    proc = start_frontend(tmp_path)
    try:
        waited = orchard("results", job_id, "--wait", "--out", str(tmp_path / "out.jsonl"),
                         "--run-dir", str(tmp_path))
        assert waited.returncode == 0, waited.stderr
        client = Client.from_run_dir(tmp_path, api_key="key-acme")
        job = client.job(job_id)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    assert (job.state, job.completed, job.failed) == ("succeeded", REQUESTS, 0)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(REQUESTS))
    by_id = {line["custom_id"]: line for line in lines}
    for custom_id, result in before.items():  # results from before the kill are kept as they were
        assert by_id[custom_id]["response"]["body"]["choices"][0]["message"]["content"] == result.text
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    stored = store.results(job_id)
    store.close()
    assert sorted(r.index for r in stored) == list(range(REQUESTS))
    assert [r.seq for r in stored] == list(range(REQUESTS))
