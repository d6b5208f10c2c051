"""Two frontends on one job store: a job whose frontend stops ticking is taken over and
finished by the other with every result exactly once, and the stalled one stops it.

In one process, the lease keepers tick by hand on an injected clock (nothing sleeps to decide
who owns a job): two runners, each its own store connection and lease, over one in-process
backend and a forged tiny model. Then with two real frontend processes
(``python -m cluster.api.frontend``, each its own ports and workers, one run directory): the
one running a job is killed with SIGKILL mid-job and the other finishes it.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.api.client import Client
from cluster.backend.local import LocalBackend
from cluster.jobs.lease import FrontendLease
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import JobState, JobStore
from cluster.jobs.takeover import LeaseKeeper
from router.kv.key import Namespace
from tests.support.bounded import run_bounded, wait_until
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import frontend_process, write_process_config
from tests.support.paths import REPO
from tests.support.runner_bodies import prepare_body, staged_requests
from workers.engine.engine import EngineConfig

BLOCK = 16
TTL_MS = 1_000


class Clock:
    def __init__(self) -> None:
        self.now = 50_000

    def __call__(self) -> int:
        return self.now


def _side(path: Path, name: str, clock: Clock, backend: LocalBackend
          ) -> tuple[JobStore, JobRunner, LeaseKeeper]:
    store = JobStore(path, clock, owner=name)
    runner = JobRunner(store, backend, prepare_body,
                       RunnerLimits(max_concurrent=1, max_pending_per_tenant=100,
                                    max_pending_total=100, request_timeout_s=30.0),
                       namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
    return store, runner, LeaseKeeper(FrontendLease(path, name, clock, TTL_MS), runner)


def test_a_silent_frontends_job_is_finished_by_the_other_and_the_stalled_one_lets_go(tmp_path):
    async def scenario():
        clock = Clock()
        backend = LocalBackend(tiny_model(), workers=1,
                               engine=EngineConfig(block_size=BLOCK, kept_bytes=0))
        await backend.start()
        path = tmp_path / "jobs.sqlite3"
        store_a, runner_a, keeper_a = _side(path, "fe-a", clock, backend)
        store_b, runner_b, keeper_b = _side(path, "fe-b", clock, backend)
        try:
            await keeper_a.tick()
            await keeper_b.tick()
            runner_a.admit("acme", 6)                  # accepted through A ...
            job = store_a.create_job("acme", "tiny", staged_requests(
                *[(list(range(10 + 20 * i, 30 + 20 * i)), 40) for i in range(6)]))
            runner_a.launch(job)                       # ... and run there
            await wait_until(lambda: store_a.get_job(job.job_id).completed >= 1,
                             "A's first result")
            clock.now += TTL_MS - 1
            assert (await keeper_b.tick()).taken == ()   # A's lease still runs
            clock.now += 1                               # A never ticked: its lease is over
            taken = (await keeper_b.tick()).taken
            assert [j.job_id for j in taken] == [job.job_id]
            assert runner_b.pending() == {"acme": 6 - taken[0].completed - taken[0].failed}
            lost = await keeper_a.tick()                 # A wakes up: the job is B's now
            assert (lost.lost, lost.taken) == ((job.job_id,), ())
            assert runner_a.running_jobs() == [] and runner_a.pending() == {}
            done = await wait_until(
                lambda: (j := store_b.get_job(job.job_id)).state is JobState.SUCCEEDED and j,
                "B to finish the job")
            await wait_until(lambda: runner_b.pending() == {}, "B's count to come back")
            results = store_b.results(job.job_id)
            return done, [r.index for r in results], [r.seq for r in results]
        finally:
            for runner in (runner_a, runner_b):
                await runner.close()
            await backend.close()
            for store in (store_a, store_b):
                store.close()

    done, indices, seqs = run_bounded(scenario(), 60, "takeover between two runners")
    assert (done.completed, done.failed, done.owner) == (6, 0, "fe-b")
    assert sorted(indices) == list(range(6)) and seqs == list(range(6))  # each exactly once


def test_a_job_cancelled_through_the_other_frontend_stops_where_it_runs(tmp_path):
    async def scenario():
        clock = Clock()
        backend = LocalBackend(tiny_model(), workers=1,
                               engine=EngineConfig(block_size=BLOCK, kept_bytes=0))
        await backend.start()
        path = tmp_path / "jobs.sqlite3"
        store_a, runner_a, keeper_a = _side(path, "fe-a", clock, backend)
        store_b, runner_b, keeper_b = _side(path, "fe-b", clock, backend)
        try:
            await keeper_a.tick()
            runner_a.admit("acme", 4)
            runner_b.admit("acme", 1)                 # a request B counts of its own
            job = store_a.create_job("acme", "tiny", staged_requests(
                *[(list(range(10 + 20 * i, 30 + 20 * i)), 1500) for i in range(4)]))
            runner_a.launch(job)
            await wait_until(lambda: runner_a.slots_in_use() == {"acme": 1}, "A running")
            cancelled = runner_b.cancel(job.job_id, "acme")
            counts = (runner_b.pending(), runner_a.pending())   # B counted none of it
            tick = await keeper_a.tick()
            return (cancelled.state, cancelled.cancelled, counts, tick.lost,
                    runner_a.running_jobs(), runner_a.pending(), runner_a.slots_in_use(),
                    store_a.results(job.job_id))
        finally:
            for runner in (runner_a, runner_b):
                await runner.close()
            await backend.close()
            for store in (store_a, store_b):
                store.close()

    state, n, counts, lost, running, pending, slots, results = run_bounded(
        scenario(), 60, "a cancel through another frontend")
    assert (state, n) == (JobState.CANCELLED, 4)
    assert counts == ({"acme": 1}, {"acme": 4})
    assert len(lost) == 1 and running == [] and pending == {} and slots == {}
    assert results == []                          # nothing recorded after the cancel


def test_a_stopped_keeper_gives_its_jobs_back_for_the_next_tick(tmp_path):
    async def scenario():
        clock = Clock()
        path = tmp_path / "jobs.sqlite3"
        store_a, runner_a, keeper_a = _side(path, "fe-a", clock, None)
        store_b, runner_b, keeper_b = _side(path, "fe-b", clock, None)
        await keeper_a.tick()
        job = store_a.create_job("acme", "tiny", staged_requests(([1, 2], 1)))
        await keeper_a.stop()
        keeper_a.release()
        taken = keeper_b.lease.tick()
        store_a.close()
        store_b.close()
        keeper_b.lease.close()
        return job, taken

    job, taken = run_bounded(scenario(), 10, "a released lease")
    assert [j.job_id for j in taken.taken] == [job.job_id]  # at once: no wait for the ttl


# ------------------------------------------------------------------ two frontend processes

REQUESTS = 12


def _config(run_dir: Path) -> None:
    write_process_config(run_dir, "\n[frontend]\nlease_s = 1.0\n")


def _batch(path: Path) -> None:
    with path.open("w") as f:
        for i in range(REQUESTS):
            body = {"model": "tiny", "max_tokens": 120, "temperature": 0,
                    "messages": [{"role": "system", "content": "Answer at length. " * 8},
                                 {"role": "user", "content": f"Tell me about topic {i}."}]}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


def _start(run_dir: Path, log_name: str) -> tuple[subprocess.Popen, dict]:
    """A frontend process with one in-process worker."""
    return frontend_process(run_dir, ["--workers", "1"], log_name)


@pytest.mark.slow
def test_sigkill_of_the_frontend_running_a_job_and_the_other_finishes_it_once(tmp_path):
    _config(tmp_path)
    batch = tmp_path / "batch.jsonl"
    _batch(batch)
    started: list[subprocess.Popen] = []
    try:
        a, record_a = _start(tmp_path, "a.log")
        started.append(a)
        b, record_b = _start(tmp_path, "b.log")
        started.append(b)
        assert record_a["address"] != record_b["address"]
        assert json.loads((tmp_path / "frontend.json").read_text()) == record_a
        listed = subprocess.run([sys.executable, "-m", "cluster.cli", "frontends", "--json",
                                 "--run-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        assert sorted((f["frontend_id"], f["address"], f["jobs"])
                      for f in json.loads(listed.stdout)["frontends"]) == sorted(
            (r["frontend_id"], r["address"], 0) for r in (record_a, record_b))
        client_a = Client(record_a["address"], "key-acme")
        job_id = client_a.submit_file(batch).job_id
        deadline = time.monotonic() + 120
        while (done := client_a.job(job_id).done) < 2:
            assert time.monotonic() < deadline, "the job made no progress on A"
            time.sleep(0.02)
        before = {r.custom_id: r.text for r in client_a.results(job_id)}
        client_a.close()
        a.send_signal(signal.SIGKILL)
        a.wait(30)
        assert 2 <= done < REQUESTS, "the kill landed after the job finished: make it longer"

        client_b = Client(record_b["address"], "key-acme")
        deadline = time.monotonic() + 180
        while (job := client_b.job(job_id)).state != "succeeded":
            assert time.monotonic() < deadline, f"B did not finish the job: {job}"
            time.sleep(0.05)
        after = {r.custom_id: r for r in client_b.results(job_id)}
        client_b.close()
        # frontend.json: A's while A served, B's from B's first lease tick after A died
        shared = json.loads((tmp_path / "frontend.json").read_text())
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)

    assert (job.completed, job.failed) == (REQUESTS, 0)
    assert sorted(after) == sorted(f"req-{i}" for i in range(REQUESTS))
    for custom_id, text in before.items():   # A's results stand as A recorded them
        assert after[custom_id].text == text
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    stored = store.results(job_id)
    owner = store.get_job(job_id).owner
    store.close()
    assert sorted(r.index for r in stored) == list(range(REQUESTS))   # each exactly once
    assert [r.seq for r in stored] == list(range(REQUESTS))
    assert owner == record_b["frontend_id"]
    assert shared == record_b
