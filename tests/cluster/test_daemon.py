"""The cluster process (``cluster.daemon``) through the real command line.

The fast tests check its placement and state file without a cluster; the slow one starts a
detached cluster (embedded Ray, two workers on a tiny forged model), scales and drains it
while a job runs, and stops it. What ``orchard up/down/workers`` print for bad input is in
``tests/cluster/commands/test_cluster_ops.py``.
"""
from __future__ import annotations

from tests.support.paths import REPO
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
import pytest
from cluster.backend.bootstrap import NODE_RESOURCE, Placement
from cluster.config import update_config, write_default_config
from cluster.daemon import STATE_NAME, ClusterState
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import frontend_process
from tests.support.orchard_process import orchard


ROOT = REPO


def _workers(run_dir: Path) -> list[dict]:
    done = orchard("workers", "--run-dir", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class TestClusterOps:
    def test_placement_takes_a_share_of_a_node_slot(self):
        assert Placement().actor_options() == {"num_cpus": 1.0, "resources": {NODE_RESOURCE: 1.0}}
        assert Placement(2.0, 4).actor_options()["resources"] == {NODE_RESOURCE: 0.25}
        with pytest.raises(ValueError, match="CPUs reserved"):
            Placement(cpus_per_worker=0)
        with pytest.raises(ValueError, match="per node"):
            Placement(workers_per_node=0)

    def test_a_corrupt_state_file_names_itself(self, tmp_path):
        (tmp_path / STATE_NAME).write_text("{not json")
        with pytest.raises(ValueError, match=STATE_NAME):
            ClusterState.read(tmp_path)

    def test_a_stale_state_file_does_not_block_down(self, tmp_path):
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        ClusterState(dead.pid, "127.0.0.1:1", "127.0.0.1:2", 1, time.time()).write(tmp_path)
        down = orchard("down", "--run-dir", str(tmp_path))
        assert down.returncode == 0, down.stderr
        assert not (tmp_path / STATE_NAME).exists()

    @pytest.mark.slow
    def test_up_scale_drain_down_while_a_job_runs(self, tmp_path):
        from cluster.api.client import Client, token_request

        run_dir = tmp_path / "run"
        write_default_config(run_dir, model_dir=str(tiny_model()), max_concurrent=4)
        up = orchard("up", "--run-dir", str(run_dir), "--workers", "2", "--detach", timeout=600)
        assert up.returncode == 0, up.stderr + (run_dir / "cluster.log").read_text()[-3000:]
        state = ClusterState.read(run_dir)
        try:
            again = orchard("up", "--run-dir", str(run_dir), "--detach")
            assert again.returncode == 2 and "already runs" in again.stderr
            assert [w["state"] for w in _workers(run_dir)] == ["ready", "ready"]

            shared = list(range(200, 264))
            with Client.from_run_dir(run_dir) as client:
                job = client.submit([token_request(f"r{i}", shared + [300 + i] * 20, 32)
                                     for i in range(16)])
                scaled = orchard("scale", "--run-dir", str(run_dir), "--workers", "3", "--json")
                assert scaled.returncode == 0, scaled.stderr
                assert sum(w["state"] == "ready" for w in json.loads(scaled.stdout)) == 3
                drained = orchard("drain", "w0", "--run-dir", str(run_dir), "--json")
                assert drained.returncode == 0, drained.stderr
                assert json.loads(drained.stdout)[0]["state"] == "draining"
                final = client.wait(job.job_id, poll_s=0.2, timeout_s=300)
                results = list(client.results(job.job_id))
            assert final.completed == 16 and len(results) == 16 and all(r.ok for r in results)

            deadline = time.monotonic() + 30
            while any(w["worker_id"] == "w0" for w in _workers(run_dir)) \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
            after = _workers(run_dir)
            assert [w["worker_id"] for w in after] == ["w1", "w2"]
            unknown = orchard("drain", "nope", "--run-dir", str(run_dir))
            assert unknown.returncode == 2 and "NOT_FOUND" in unknown.stderr
        finally:
            down = orchard("down", "--run-dir", str(run_dir), timeout=120)
        assert down.returncode == 0, down.stderr
        assert not (run_dir / STATE_NAME).exists()
        with pytest.raises(ProcessLookupError):
            os.kill(state.pid, 0)


KILLED_JOB = 12


def _attach(run_dir: Path, log_name: str) -> tuple[subprocess.Popen, dict]:
    """A second frontend process on ``orchard up``'s workers."""
    return frontend_process(run_dir, ["--attach"], log_name)


def _result(client, custom_id: str, tokens: list[int]):
    from cluster.api.client import token_request

    events = list(client.generate(token_request(custom_id, tokens, 4)))
    return events[-1].result


class TestAttachedFrontend:
    def test_attach_without_a_cluster_says_how_to_start_one(self, tmp_path):
        write_default_config(tmp_path, model_dir=str(tiny_model()))
        done = subprocess.run([sys.executable, "-m", "cluster.api.frontend", "--run-dir",
                               str(tmp_path), "--attach"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2
        assert (f"no Ray workers to attach to in {tmp_path} (no workers.json): start them "
                f"with `orchard up --detach --run-dir {tmp_path}`") in done.stderr
        both = subprocess.run([sys.executable, "-m", "cluster.api.frontend", "--run-dir",
                               str(tmp_path), "--attach", "--workers", "2"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert both.returncode == 2 and "give one of the two" in both.stderr

    @pytest.mark.slow
    def test_a_second_frontend_serves_on_the_clusters_workers_and_leaves_them_running(
            self, tmp_path):
        from cluster.api.client import Client, OrchardError

        run_dir = tmp_path / "run"
        write_default_config(run_dir, model_dir=str(tiny_model()), max_concurrent=2)
        update_config(run_dir, "frontend", {"lease_s": 1})
        up = orchard("up", "--run-dir", str(run_dir), "--workers", "2", "--detach", timeout=600)
        assert up.returncode == 0, up.stderr + (run_dir / "cluster.log").read_text()[-3000:]
        attached = None
        try:
            directory = run_dir / "workers.json"
            assert directory.stat().st_mode & 0o777 == 0o600   # it holds the stream secret
            attached, record = _attach(run_dir, "attached.log")
            first = Client.from_run_dir(run_dir)
            second = Client.from_run_dir(run_dir, address=record["address"])
            admin = Client.from_run_dir(run_dir, admin=True, address=record["address"])
            assert sorted(w.worker_id for w in admin.workers()) == ["w0", "w1"]
            shared = list(range(200, 264))   # 4 blocks of 16
            served = _result(second, "b0", shared + [300] * 20)
            assert served.ok and served.worker_id in ("w0", "w1")
            assert served.usage.cached_tokens == 0
            # the first frontend's router learned the blocks from its own feed of the worker
            deadline = time.monotonic() + 30
            while True:
                home = _result(first, "a0", shared + [301] * 20)
                if home.usage.cached_tokens or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert (home.worker_id, home.usage.cached_tokens) == (served.worker_id, 64)
            # a job it accepts runs there, on the same workers
            from cluster.api.client import token_request
            job = second.submit([token_request(f"j{i}", shared + [310 + i] * 20, 4)
                                 for i in range(4)])
            final = second.wait(job.job_id, poll_s=0.2, timeout_s=300)
            results = list(second.results(job.job_id))
            assert final.completed == 4 and all(r.ok for r in results)
            assert {r.worker_id for r in results} <= {"w0", "w1"}
            with pytest.raises(OrchardError) as refused:
                admin.scale(3)
            assert refused.value.code == "FAILED_PRECONDITION"
            assert "scale them through that frontend" in refused.value.message
            # a job the second frontend runs, when it is killed with kill -9: the first one
            # takes it over at its lease's end and finishes it, each request once
            long = second.submit([token_request(f"k{i}", shared + [400 + i] * 20, 200)
                                  for i in range(KILLED_JOB)])
            deadline = time.monotonic() + 120
            while (done := second.job(long.job_id).done) < 1:
                assert time.monotonic() < deadline, "the job made no progress"
                time.sleep(0.02)
            for client in (second, admin):
                client.close()
            attached.send_signal(signal.SIGKILL)
            attached.wait(30)
            assert done < KILLED_JOB, "the kill landed after the job finished: make it longer"
            final = first.wait(long.job_id, poll_s=0.2, timeout_s=300)
            results = list(first.results(long.job_id))
            assert (final.completed, final.failed) == (KILLED_JOB, 0)
            assert sorted(r.custom_id for r in results) == sorted(
                f"k{i}" for i in range(KILLED_JOB))   # each exactly once
            # the second frontend's death left the workers to the first
            assert [w["state"] for w in _workers(run_dir)] == ["ready", "ready"]
            again = _result(first, "a1", shared + [302] * 20)
            assert again.ok and again.usage.cached_tokens == 64   # both hold it since the job
            first.close()
        finally:
            if attached is not None and attached.poll() is None:
                attached.kill()
            down = orchard("down", "--run-dir", str(run_dir), timeout=120)
        assert down.returncode == 0, down.stderr
        assert not (run_dir / "workers.json").exists()


class TestTakeover:
    @pytest.mark.slow
    def test_on_a_ray_cluster_of_its_own_an_attached_frontend_takes_over_a_killed_owner(
            self, tmp_path, monkeypatch):
        """``orchard up --address``: its actors are detached; killed with kill -9, its job is
        finished and its workers taken over (scaled, then stopped) by the attached frontend."""
        from cluster.api.client import Client, token_request
        from cluster.backend.ray_attach import WorkerDirectory
        from tests.support.ray_head import HEAD_ENV, ray_head

        for name, value in HEAD_ENV.items():
            monkeypatch.setenv(name, value)
        run_dir = tmp_path / "run"
        write_default_config(run_dir, model_dir=str(tiny_model()), max_concurrent=2)
        update_config(run_dir, "frontend", {"lease_s": 1})
        with ray_head() as address:
            up = orchard("up", "--run-dir", str(run_dir), "--workers", "2", "--address",
                         address, "--detach", timeout=600)
            assert up.returncode == 0, up.stderr + (run_dir / "cluster.log").read_text()[-3000:]
            owner = ClusterState.read(run_dir)
            directory = WorkerDirectory.read(run_dir)
            assert directory.detached and directory.owner_pid == owner.pid
            attached = None
            try:
                attached, record = _attach(run_dir, "attached.log")
                with Client.from_run_dir(run_dir) as first:
                    shared = list(range(200, 264))
                    job = first.submit([token_request(f"k{i}", shared + [400 + i] * 20, 200)
                                        for i in range(KILLED_JOB)])
                    deadline = time.monotonic() + 120
                    while (done := first.job(job.job_id).done) < 1:
                        assert time.monotonic() < deadline, "the job made no progress"
                        time.sleep(0.02)
                os.kill(owner.pid, signal.SIGKILL)
                with Client.from_run_dir(run_dir, address=record["address"]) as second, \
                        Client.from_run_dir(run_dir, admin=True,
                                            address=record["address"]) as admin:
                    final = second.wait(job.job_id, poll_s=0.2, timeout_s=300)
                    results = list(second.results(job.job_id))
                    assert done < KILLED_JOB, "the kill landed after the job: make it longer"
                    assert (final.completed, final.failed) == (KILLED_JOB, 0)
                    assert sorted(r.custom_id for r in results) == sorted(
                        f"k{i}" for i in range(KILLED_JOB))   # each exactly once
                    deadline = time.monotonic() + 60
                    while WorkerDirectory.read(run_dir).owner_pid != attached.pid:
                        assert time.monotonic() < deadline, "the workers were not taken over"
                        time.sleep(0.2)
                    grown = admin.scale(3)
                    assert sorted((w.worker_id, w.state) for w in grown) == [
                        ("w0", "ready"), ("w1", "ready"), ("w2", "ready")]
                attached.send_signal(signal.SIGTERM)
                assert attached.wait(120) == 0
                assert not (run_dir / "workers.json").exists()
                # its workers stopped with it: none of them is left on the Ray cluster
                listed = subprocess.run(
                    [sys.executable, "-c", "import json, ray; ray.init(address=%r, "
                     "namespace='orchard', logging_level='ERROR'); "
                     "print(json.dumps(ray.util.list_named_actors()))" % address],
                    capture_output=True, text=True, timeout=120)
                assert listed.returncode == 0, listed.stderr[-2000:]
                names = json.loads(listed.stdout.strip().splitlines()[-1])
                assert [n for n in names if n.startswith(directory.names)] == []
            finally:
                if attached is not None and attached.poll() is None:
                    attached.kill()
                orchard("down", "--run-dir", str(run_dir), timeout=120)
