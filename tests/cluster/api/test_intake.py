"""Big batch files: acceptance checks shapes only, refuses whole, and leaves nothing behind.

A real frontend over in-process workers (``running_frontend``); files are generated in the
test's temp dir. The job store is read directly to check that a refused job left no rows.

Acceptance into the store: the dispatch order follows shared prefixes, not the file.
"""
from tests.support.paths import REPO
import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
import pytest
from cluster.api.client import Client, OrchardError
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
from tests.support.small_disk import small_disk
import random
from cluster.api.intake import BatchIntake
from cluster.api.validate import LimitExceeded
from cluster.backend.protocol import ModelInfo
from cluster.jobs.store import JobStore, StagedRequest


ROOT = REPO

def chat_line(i: int, content: str = "", max_tokens: int = 2) -> str:
    body = {"model": "tiny", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content or f"question {i}"}]}
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": body})

def write_file(path: Path, n: int, pad: int = 0, last: str | None = None) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(chat_line(i, f"question {i} " + "x" * pad) + "\n")
        if last is not None:
            f.write(last)
    return path

def stored_rows(db_path: Path) -> tuple[int, int]:
    """(jobs, requests) in the job store's file, read as any SQLite client would."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return (db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0],
                db.execute("SELECT COUNT(*) FROM job_requests").fetchone()[0])
    finally:
        db.close()

@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)  # default limits: 50,000 per job
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness

def _start(run_dir: Path) -> subprocess.Popen:
    (run_dir / "frontend.json").unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "cluster.api.frontend", "--run-dir",
                             str(run_dir), "--workers", "1"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(run_dir / "log", "ab"))
    deadline = time.monotonic() + 120
    while not (run_dir / "frontend.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the frontend did not start"
        time.sleep(0.1)
    return proc


class TestBatchIntake:
    def test_a_prompt_over_the_context_fails_at_dispatch_with_its_reason(self, frontend, tmp_path):
        path = tmp_path / "mixed.jsonl"
        path.write_text(chat_line(0) + "\n" + chat_line(1, "word " * 3000) + "\n" + chat_line(2))
        with frontend.client("acme") as client:
            job = client.submit_file(path)
            assert job.total == 3
            job = client.wait(job.job_id, timeout_s=120)
            results = {r.custom_id: r for r in client.results(job.job_id)}
        assert (job.state, job.completed, job.failed) == ("succeeded", 2, 1)
        bad = results["r1"]
        assert (bad.ok, bad.error_code) == (False, "INVALID_ARGUMENT")
        assert "reach the model's context of 2048" in bad.error_message
        assert results["r0"].ok and results["r2"].ok

    def test_a_file_sent_again_with_its_idempotency_key_is_the_same_job(self, frontend, tmp_path):
        path = write_file(tmp_path / "again.jsonl", 5)
        with frontend.client("acme") as client:
            first = client.submit_file(path, idempotency_key="file-1")
            again = client.submit_file(path, idempotency_key="file-1")
            assert again.job_id == first.job_id and again.total == 5
            assert [j.job_id for j in client.jobs()].count(first.job_id) == 1
            client.wait(first.job_id, timeout_s=120)
        assert frontend.frontend.runner.pending() == {}  # the retry admitted nothing

    def test_50001_requests_are_refused_naming_the_limit(self, frontend, tmp_path):
        path = write_file(tmp_path / "big.jsonl", 50_001)
        with frontend.client("acme") as client:
            before = client.jobs()
            with pytest.raises(OrchardError) as err:
                client.submit_file(path)
            assert client.jobs() == before
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert "limit of 50000 requests per job" in err.value.message
        assert stored_rows(frontend.config.db_path)[1] == sum(j.total for j in before)

    @pytest.mark.slow
    def test_a_200mb_file_with_a_broken_last_line_is_named_and_nothing_stored(self, frontend, tmp_path):
        path = write_file(tmp_path / "huge.jsonl", 49_999, pad=3_950, last='{"custom_id": "r-last", ')
        assert 200e6 < path.stat().st_size < 200 << 20
        with frontend.client("acme") as client:
            before = client.jobs()
            with pytest.raises(OrchardError) as err:
                client.submit_file(path)
            assert client.jobs() == before
        assert err.value.code == "INVALID_ARGUMENT"
        assert err.value.message.startswith("huge.jsonl:50000: not valid JSON")
        assert stored_rows(frontend.config.db_path)[1] == sum(j.total for j in before)

    def test_a_disk_that_fills_during_acceptance_refuses_the_job(self, tmp_path):
        with small_disk(tmp_path / "disk", megabytes=24) as run_dir:
            (run_dir / "orchard.toml").write_text(ACME_CONFIG)
            path = write_file(tmp_path / "fills.jsonl", 12_000, pad=3_000)  # 37 MB
            with running_frontend(run_dir, tiny_model(), workers=1) as harness:
                with harness.client("acme") as client:
                    with pytest.raises(OrchardError) as err:
                        client.submit_file(path)
                    assert client.jobs() == []
                    ok = client.submit_file(write_file(tmp_path / "small.jsonl", 3))
                    assert client.wait(ok.job_id, timeout_s=120).completed == 3  # still serving
            assert err.value.code == "RESOURCE_EXHAUSTED"
            assert "disk is full; the job was not created" in err.value.message
            assert stored_rows(run_dir / "jobs.sqlite3") == (1, 3)

    @pytest.mark.slow
    def test_a_frontend_killed_during_acceptance_leaves_no_job(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(ACME_CONFIG + f'\n[model]\ndir = "{tiny_model()}"\n')
        path = write_file(tmp_path / "slow.jsonl", 20_000, pad=200)
        proc = _start(tmp_path)
        try:
            client = Client.from_run_dir(tmp_path, api_key="key-acme")
            db_path = tmp_path / "jobs.sqlite3"

            def kill_once_some_are_stored(sent: int) -> None:
                if proc.poll() is not None:
                    return
                deadline = time.monotonic() + 60
                while stored_rows(db_path)[1] == 0 and sent >= 8 * (256 << 10):
                    assert time.monotonic() < deadline, "the intake stored nothing"
                    time.sleep(0.05)
                if stored_rows(db_path)[1]:  # part of the file stored, the rest still to come
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(30)
            with pytest.raises(OrchardError) as err:
                client.submit_file(path, chunk_bytes=256 << 10, on_sent=kill_once_some_are_stored)
            client.close()
            assert err.value.code == "UNAVAILABLE"
            jobs, requests = stored_rows(db_path)
            assert jobs == 0 and 0 < requests < 20_000  # part stored, but no job: absent, not half
            proc = _start(tmp_path)  # the restarted frontend sweeps what the intake stored
            assert stored_rows(tmp_path / "jobs.sqlite3") == (0, 0)
            with Client.from_run_dir(tmp_path, api_key="key-acme") as client:
                assert client.jobs() == []
        finally:
            proc.kill()
            proc.wait(30)


MODEL = ModelInfo("m", "r", vocab_size=100, max_context=64, model_dir="", block_size=4,
                  kv_bytes_per_token=64)

SYSTEMS = ["You are A.", "You are B.", "You are C."]

def line(i: int) -> bytes:
    body = {"max_tokens": 2, "messages": [{"role": "system", "content": SYSTEMS[i % 3]},
                                          {"role": "user", "content": f"q{i}"}]}
    return json.dumps({"custom_id": f"c{i}", "body": body}).encode() + b"\n"

def accept(store: JobStore, lines: list[bytes], chunk: int = 7):
    batch = BatchIntake(store.intake("acme", "m"), MODEL, max_requests=100, name="f.jsonl")
    data = b"".join(lines)
    for start in range(0, len(data), chunk):  # chunks that split lines anywhere
        batch.feed(data[start:start + chunk])
    batch.end()
    job, _ = batch.commit()
    batch.intake.close()
    return job

def dispatch_order(store: JobStore, job_id: str) -> list[str]:
    return [r.custom_id for r in store.next_requests(job_id, limit=1000)]

@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    yield s
    s.close()


class TestOrder:
    def test_requests_sharing_a_system_prompt_dispatch_together_whatever_the_file_order(self, store):
        lines = [line(i) for i in range(12)]
        shuffled = lines[:]
        random.Random(7).shuffle(shuffled)
        first = dispatch_order(store, accept(store, lines).job_id)
        second = dispatch_order(store, accept(store, shuffled).job_id)
        assert first == second
        groups = [int(c[1:]) % 3 for c in first]
        assert groups == sorted(groups, key=groups.index)  # each system prompt's requests adjacent
        assert [r.index for r in store.next_requests(accept(store, lines).job_id, limit=1)] == [
            int(first[0][1:])]  # each request keeps its own index (its place in the file)

    def test_the_limit_and_a_bad_line_are_named(self, store):
        with pytest.raises(LimitExceeded, match="limit of 100 requests per job"):
            accept(store, [line(i) for i in range(101)])
        with pytest.raises(ValueError, match=r"^f.jsonl:3: not valid JSON"):
            accept(store, [line(0), line(1), b"{oops\n"])
        with pytest.raises(ValueError, match=r"f.jsonl:2: body.messages\[1\].role: unknown role"):
            accept(store, [line(0), line(1).replace(b'"user"', b'"robot"')])
        assert store.list_jobs("acme") == []


class _HeldRequests(list):
    """Requests whose reading, in the intake's thread, waits until released."""

    def __init__(self, items):
        super().__init__(items)
        self.entered, self.release = threading.Event(), threading.Event()

    def __iter__(self):
        self.entered.set()
        assert self.release.wait(60), "never released"
        return super().__iter__()


def _requests(n: int) -> list:
    from cluster.api.incoming import RequestIn, SamplingIn, Tokens
    return [RequestIn(f"c{i}", Tokens((1, 2, 3)), SamplingIn(max_tokens=2)) for i in range(n)]


def _open_intakes(store: JobStore) -> int:
    with sqlite3.connect(store.path) as db:
        return db.execute("SELECT COUNT(*) FROM intakes").fetchone()[0]


def test_requests_are_accepted_in_one_thread_and_a_caller_cancelled_before_the_commit_leaves_nothing(store):
    from cluster.api.intake import accept_requests
    from tests.support.bounded import run_bounded, wait_until

    async def scenario():
        job, created = await accept_requests(store, "acme", MODEL, 100, _requests(3))
        held = _HeldRequests(_requests(2))
        task = asyncio.create_task(accept_requests(store, "acme", MODEL, 100, held))
        await asyncio.to_thread(held.entered.wait, 60)   # the intake's thread reads them
        task.cancel()
        with pytest.raises(asyncio.CancelledError) as cancelled:
            await task            # the caller's cancel is answered at once ...
        held.release.set()        # ... and the thread, let go after it, does not commit
        await wait_until(lambda: _open_intakes(store) == 0, "the cancelled intake's abort")
        return job, created, cancelled.type

    job, created, raised = run_bounded(scenario(), 60, "a cancelled intake")
    assert raised is asyncio.CancelledError
    assert created and job.total == 3
    assert [j.job_id for j in store.list_jobs("acme")] == [job.job_id]
    assert dispatch_order(store, job.job_id) == ["c0", "c1", "c2"]
    assert _job_requests(store) == 3   # nothing of the cancelled one remains


class _HeldCommit:
    """``store.intake`` whose intakes' commits wait, in the intake's thread, until released."""

    def __init__(self, store: JobStore):
        self._intake = store.intake
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        intake = self._intake(*args, **kwargs)
        commit = intake.commit

        def held_commit(key: str = ""):
            self.entered.set()
            assert self.release.wait(60), "never released"
            return commit(key)

        intake.commit = held_commit
        return intake


def _job_requests(store: JobStore) -> int:
    with sqlite3.connect(store.path) as db:
        return db.execute("SELECT COUNT(*) FROM job_requests").fetchone()[0]


def test_a_caller_cancelled_after_the_commit_began_gets_the_job_with_its_cancel(store, monkeypatch):
    """A commit cannot be taken back: the cancel still propagates, carrying the whole job."""
    from cluster.api.intake import accept_requests
    from cluster.api.intake_threads import CancelledAfterCommit
    from tests.support.bounded import run_bounded

    held = _HeldCommit(store)
    monkeypatch.setattr(store, "intake", held)

    async def scenario():
        task = asyncio.create_task(accept_requests(store, "acme", MODEL, 100, _requests(2)))
        await asyncio.to_thread(held.entered.wait, 60)
        task.cancel()
        held.release.set()
        with pytest.raises(CancelledAfterCommit) as late:
            await task
        return late.value

    late = run_bounded(scenario(), 60, "a cancel during the commit")
    assert late.created and late.job.total == 2
    assert [j.job_id for j in store.list_jobs("acme")] == [late.job.job_id]
    assert dispatch_order(store, late.job.job_id) == ["c0", "c1"]
    assert _open_intakes(store) == 0


async def _chunks(lines: list[bytes]):
    for text in lines:
        yield text


def test_a_file_cancelled_during_its_commit_keeps_every_request_of_its_job(store, monkeypatch):
    """The abort that follows a cancel must not delete what the commit made the job's."""
    from cluster.api.intake import accept_file
    from cluster.api.intake_threads import CancelledAfterCommit
    from tests.support.bounded import run_bounded

    held = _HeldCommit(store)
    monkeypatch.setattr(store, "intake", held)

    async def scenario():
        task = asyncio.create_task(accept_file(store, "acme", MODEL, 100,
                                               _chunks([line(i) for i in range(4)])))
        await asyncio.to_thread(held.entered.wait, 60)
        task.cancel()
        held.release.set()
        with pytest.raises(CancelledAfterCommit) as late:
            await task
        return late.value.job

    job = run_bounded(scenario(), 60, "a file cancelled during its commit")
    assert job.total == 4 and _job_requests(store) == 4
    assert len(dispatch_order(store, job.job_id)) == 4


def test_an_intake_aborted_after_its_commit_deletes_nothing(store):
    intake = store.intake("acme", "m")
    intake.add([StagedRequest(0, "a", b"p", b"J{}")])
    job, created = intake.commit()
    intake.abort()
    intake.close()
    assert created and _job_requests(store) == 1
    assert [r.custom_id for r in store.next_requests(job.job_id, limit=10)] == ["a"]


def test_a_submission_cancelled_after_its_commit_began_still_runs_its_job(tmp_path, monkeypatch):
    """The service launches the job a late cancel carries: a client that disconnected finds
    it done (by its idempotency key), and the runner's admission counts it until then."""
    from functools import partial

    from cluster.api.intake import JobIntakeService, prepare
    from cluster.api.intake_threads import CancelledAfterCommit
    from cluster.backend.local import LocalBackend
    from cluster.jobs.runner import JobRunner, RunnerLimits
    from cluster.jobs.store import JobState
    from router.kv.key import Namespace
    from tests.support.bounded import run_bounded, wait_until
    from workers.engine.engine import EngineConfig

    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    held = _HeldCommit(store)
    monkeypatch.setattr(store, "intake", held)

    async def scenario():
        backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=16))
        await backend.start()
        model = backend.model_info()
        runner = JobRunner(store, backend, partial(prepare, model=model, render=None),
                           RunnerLimits(max_concurrent=2, max_pending_per_tenant=100,
                                        max_pending_total=100, request_timeout_s=30.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=16)
        service = JobIntakeService(store, runner, model, 100)
        task = asyncio.create_task(service.submit_requests("acme", _requests(2), "key-1"))
        await asyncio.to_thread(held.entered.wait, 60)
        task.cancel()
        held.release.set()
        with pytest.raises(CancelledAfterCommit) as late:
            await task
        counted = runner.pending()
        job = await wait_until(
            lambda: (j := store.get_job(late.value.job.job_id)).state is JobState.SUCCEEDED
            and j, "the late-cancelled job to finish")
        found = store.find_job("acme", "key-1")
        after = runner.pending()
        await runner.close()
        await backend.close()
        return counted, job, found, after

    counted, job, found, after = run_bounded(scenario(), 120, "a late-cancelled submission")
    store.close()
    assert counted == {"acme": 2}
    assert job.total == 2 and job.completed == 2 and job.failed == 0
    assert found.job_id == job.job_id
    assert after == {}


def test_a_small_job_is_prepared_beside_its_commit_once_and_a_larger_one_by_its_forecast(tmp_path):
    """A job of at most ``PREPARE_AT_INTAKE`` requests is templated and tokenized in the
    runner's threads while its intake commits, once a request; a larger one is not: its
    forecast prepares its requests and each but the first is prepared again when
    dispatched."""
    from functools import partial

    from cluster.api.intake import JobIntakeService, prepare
    from cluster.backend.local import LocalBackend
    from cluster.jobs.runner import PREPARE_AT_INTAKE, JobRunner, RunnerLimits
    from cluster.jobs.store import JobState
    from cluster.telemetry.job_tracing import JobTracing
    from cluster.telemetry.observe import RequestObserver, ServedCache
    from proto.orchard.v1 import orchard_pb2 as pb
    from router.cost import PriceTable
    from router.kv.key import Namespace
    from tests.support.bounded import run_bounded, wait_until
    from tests.support.telemetry_factories import in_memory
    from workers.engine.engine import EngineConfig

    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    calls: list[tuple[str, str]] = []   # (custom id, the preparing thread's name)

    async def scenario():
        backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=16))
        await backend.start()
        model = backend.model_info()
        plain = partial(prepare, model=model, render=None)

        def counted(body: bytes):
            calls.append((pb.Request.FromString(body[1:]).custom_id,
                          threading.current_thread().name))
            return plain(body)

        tel, _, _ = in_memory(tmp_path)
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", 16, 300.0, 10_000)))
        runner = JobRunner(store, backend, counted,
                           RunnerLimits(max_concurrent=2, max_pending_per_tenant=100,
                                        max_pending_total=100, request_timeout_s=30.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=16,
                           tracing=tracing)
        service = JobIntakeService(store, runner, model, 100)
        seen = []
        for n in (1, PREPARE_AT_INTAKE, PREPARE_AT_INTAKE + 1):
            calls.clear()
            job = await service.submit_requests("acme", _requests(n))
            done = await wait_until(
                lambda: (j := store.get_job(job.job_id)).state is JobState.SUCCEEDED and j,
                f"the job of {n} to finish")
            seen.append((done.completed, list(calls)))
        await runner.close()
        await backend.close()
        return seen

    (one, small, larger) = run_bounded(scenario(), 120, "jobs prepared at intake")
    store.close()
    assert PREPARE_AT_INTAKE == 8
    assert one[0] == 1 and [c for c, _ in one[1]] == ["c0"]
    assert small[0] == 8 and sorted(c for c, _ in small[1]) == [f"c{i}" for i in range(8)]
    assert {name.split("_")[0] for _, name in one[1] + small[1]} == {"orchard-prepare"}
    counts = {}
    for custom_id, _ in larger[1]:
        counts[custom_id] = counts.get(custom_id, 0) + 1
    assert larger[0] == 9 and sorted(counts.values()) == [1] + [2] * 8
    assert not any(name.startswith("orchard-prepare") for _, name in larger[1])
