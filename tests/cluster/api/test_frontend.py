"""Admission (backpressure) in the job runner: per tenant and over all tenants.

Durability: SIGKILL the frontend mid-job, start it again, every result arrives exactly once.

The frontend is a real subprocess (``python -m cluster.api.frontend``); the job is submitted and
read back with the real ``orchard`` command line.
"""
import pytest
from cluster.jobs.store import JobStore
from cluster.jobs.admission import Overloaded
from cluster.jobs.runner import JobRunner, RunnerLimits
from router.kv.key import Namespace
from tests.support.frontend_harness import write_process_config
from tests.support.paths import REPO
import subprocess
import sys
from pathlib import Path
import workers  # noqa: F401
from tests.support.forged_models import tiny_model
import json
import os
import signal
import time
from cluster.api.client import Client


class TestRunner:
    def test_admit_limits_per_tenant_and_in_total(self, tmp_path):
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
        runner = JobRunner(store, None, None,
                           RunnerLimits(max_concurrent=2, max_pending_per_tenant=5,
                                        max_pending_total=8, request_timeout_s=10.0),
                           namespace=lambda t: Namespace(t, "m"), block_size=16)
        runner.admit("a", 5)          # exactly the tenant's limit
        with pytest.raises(Overloaded, match=r"^requests: tenant 'a' has 5 requests pending and the "
                                             r"limit is 5; wait for jobs to finish and retry$"):
            runner.admit("a", 1)
        runner.admit("b", 3)          # exactly the cluster's limit
        assert runner.pending() == {"a": 5, "b": 3}
        with pytest.raises(Overloaded, match=r"^requests: the cluster has 8 requests pending and "
                                             r"the limit is 8; retry later$"):
            runner.admit("c", 1)
        assert runner.pending() == {"a": 5, "b": 3}   # a refused admission counts nothing
        runner.release("a", 2)
        runner.admit("c", 2)
        assert runner.pending() == {"a": 3, "b": 3, "c": 2}
        runner.release("c", 2)        # down to zero: the tenant is gone from the counts
        assert runner.pending() == {"a": 3, "b": 3}
        with pytest.raises(RuntimeError, match=r"^pending count for 'b' went negative \(-1\)$"):
            runner.release("b", 4)
        runner.release("z", 0)        # nothing pending, nothing released: no count appears
        assert runner.pending() == {"a": 3, "b": 3}
        with pytest.raises(RuntimeError, match=r"^pending count for 'z' went negative \(-1\)$"):
            runner.release("z", 1)
        store.close()


ROOT = REPO

ORCHARD = [sys.executable, "-m", "cluster.cli"]

REQUESTS = 16

def write_config(run_dir: Path) -> None:
    write_process_config(run_dir)

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


class TestRestart:
    @pytest.mark.slow
    def test_sigkill_mid_job_then_restart_finishes_with_every_result_once(self, tmp_path):
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


class TestAddressFiles:
    def test_a_frontend_writes_its_own_file_and_frontend_json_only_when_its_holder_is_gone(
            self, tmp_path):
        from cluster.api.frontend import claim_shared_address, write_addresses

        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (tmp_path / "frontends").mkdir()
        (tmp_path / "frontends" / "fe-dead.json").write_text(json.dumps({"pid": dead.pid}))
        live_other = {"pid": os.getppid(), "frontend_id": "fe-other"}
        (tmp_path / "frontend.json").write_text(json.dumps(live_other))
        mine = {"pid": os.getpid(), "frontend_id": "fe-me", "address": "127.0.0.1:1"}
        paths = write_addresses(tmp_path, "fe-me", mine)
        assert paths == (tmp_path / "frontends" / "fe-me.json",)   # frontend.json is held
        assert sorted(p.name for p in (tmp_path / "frontends").iterdir()) == ["fe-me.json"]
        assert json.loads((tmp_path / "frontend.json").read_text()) == live_other
        (tmp_path / "frontend.json").write_text(json.dumps({"pid": dead.pid}))  # holder died
        assert claim_shared_address(tmp_path, mine) == (tmp_path / "frontend.json",)
        assert json.loads((tmp_path / "frontend.json").read_text()) == mine
        assert claim_shared_address(tmp_path, mine) == (tmp_path / "frontend.json",)  # ours


class TestOverload:
    """A tenant's quota over both edges of a real frontend: refused with RESOURCE_EXHAUSTED
    and a retry-after trailer (gRPC), 429 and Retry-After (HTTP); the quota raised in
    orchard.toml applies to the next request, without a restart."""

    QUOTA = "\n[quotas.acme]\ntokens_per_minute = {tokens}\n"

    def test_a_request_over_the_tenants_quota_is_refused_until_the_file_raises_it(
            self, tmp_path):
        import http.client
        from urllib.parse import urlsplit

        from cluster.api.client import OrchardError, chat_request
        from proto.orchard.v1 import orchard_pb2 as pb
        from tests.support.frontend_harness import ACME_CONFIG, running_frontend

        config = tmp_path / "orchard.toml"
        config.write_text(ACME_CONFIG + self.QUOTA.format(tokens=20))
        hello = [{"role": "user", "content": "Say hello."}]
        with running_frontend(tmp_path, tiny_model(), workers=1) as harness:
            client = harness.client("acme")
            # prompt + 30 output tokens > 20 a minute: it never fits, retry after the minute
            with pytest.raises(OrchardError) as caught:
                list(client.generate(chat_request("", hello, 30)))
            assert (caught.value.code, caught.value.retry_after_s) == ("RESOURCE_EXHAUSTED", 60)
            assert "tokens_per_minute quota of 20" in caught.value.message
            with pytest.raises(OrchardError) as caught:  # a priority no version defines
                list(client.generate(chat_request("", hello, 3), priority=7))
            assert caught.value.code == "INVALID_ARGUMENT"
            assert caught.value.message.startswith("priority: unknown value 7")
            address = json.loads((tmp_path / "frontend.json").read_text())["http_address"]
            url = urlsplit(address)
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            body = json.dumps({"model": harness.backend.model_info().model_id,
                               "messages": hello, "max_tokens": 30})
            connection.request("POST", "/v1/chat/completions", body,
                               {"authorization": "Bearer key-acme",
                                "content-type": "application/json"})
            answer = connection.getresponse()
            error = json.loads(answer.read())["error"]
            assert (answer.status, answer.getheader("retry-after")) == (429, "60")
            assert error["type"] == "rate_limit_error", error
            config.write_text(ACME_CONFIG + self.QUOTA.format(tokens=100_000))
            os.utime(config, ns=(10**18, 10**18))  # seen as changed, whatever the clock
            events = list(client.generate(chat_request("", hello, 3),
                                          priority=pb.PRIORITY_BATCH))
            assert events[-1].result.ok and len(events[-1].result.output_tokens) == 3
