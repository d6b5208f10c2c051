"""The job store: jobs persist, results are recorded exactly once, state follows results."""
import pytest
from small_disk import small_disk

from cluster.jobs.store import (JobFinished, JobNotFound, JobState, JobStore, StagedRequest,
                                StoreFull, StoredResult)


class Clock:
    def __init__(self):
        self.now = 1_000

    def __call__(self) -> int:
        self.now += 1
        return self.now


def make_requests(n, prefixes=None):
    return [StagedRequest(i, f"c{i}", prefixes[i] if prefixes else b"", f"body-{i}".encode())
            for i in range(n)]


def ok_result(index):
    return StoredResult(index=index, custom_id=f"c{index}", request_id=f"r{index}", ok=True,
                        text="hi", output_tokens=(5, 6), prompt_tokens=3, cached_tokens=1)


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite3", Clock())
    yield s
    s.close()


def test_create_and_reopen(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path, Clock())
    job = store.create_job("acme", "m", make_requests(3))
    store.close()
    reopened = JobStore(path, Clock())
    assert reopened.get_job(job.job_id) == job
    pending = reopened.next_requests(job.job_id)
    assert [p.index for p in pending] == [0, 1, 2]
    assert (pending[2].custom_id, pending[2].body) == ("c2", b"body-2")
    assert [j.job_id for j in reopened.unfinished_jobs()] == [job.job_id]


def test_result_recorded_exactly_once_and_job_finishes(store):
    job = store.create_job("acme", "m", make_requests(2))
    first = store.record_result(job.job_id, ok_result(1))
    assert first is not None and first.seq == 0
    assert store.record_result(job.job_id, ok_result(1)) is None  # a rerun: ignored
    assert store.get_job(job.job_id).state is JobState.QUEUED
    assert [p.index for p in store.next_requests(job.job_id)] == [0]
    failed = StoredResult(index=0, custom_id="c0", request_id="r0", ok=False,
                          error_code="DEADLINE_EXCEEDED", error_message="too slow")
    assert store.record_result(job.job_id, failed).seq == 1
    done = store.get_job(job.job_id)
    assert (done.state, done.completed, done.failed, done.finished_ms > 0) == (
        JobState.SUCCEEDED, 1, 1, True)
    assert [r.index for r in store.results(job.job_id)] == [1, 0]
    assert [r.index for r in store.results(job.job_id, offset=1)] == [0]
    assert store.results(job.job_id)[0].output_tokens == (5, 6)
    assert store.unfinished_jobs() == []


def test_cancel_and_tenant_scoping(store):
    job = store.create_job("acme", "m", make_requests(3))
    store.record_result(job.job_id, ok_result(0))
    with pytest.raises(JobNotFound):
        store.cancel(job.job_id, tenant="other")
    cancelled = store.cancel(job.job_id, tenant="acme")
    assert (cancelled.state, cancelled.completed, cancelled.cancelled) == (JobState.CANCELLED, 1, 2)
    with pytest.raises(JobFinished, match="already cancelled"):
        store.cancel(job.job_id)
    assert store.pending_by_tenant() == {}


def test_pending_by_tenant_and_listing(store):
    a = store.create_job("acme", "m", make_requests(3))
    store.create_job("beta", "m", make_requests(2))
    store.record_result(a.job_id, ok_result(0))
    assert store.pending_by_tenant() == {"acme": 2, "beta": 2}
    assert [j.job_id for j in store.list_jobs("acme")] == [a.job_id]
    with pytest.raises(JobNotFound, match="job_id"):
        store.get_job("job-missing")
    with pytest.raises(ValueError, match="at least one"):
        store.create_job("acme", "m", [])


def test_dispatch_order_is_by_prefix_then_place_and_pages_resume(store):
    prefixes = [b"\x02", b"\x01", b"\x02", b"\x01\x05", b"\x01"]
    job = store.create_job("acme", "m", make_requests(5, prefixes))
    first = store.next_requests(job.job_id, limit=2)
    assert [p.index for p in first] == [1, 4]
    rest = store.next_requests(job.job_id, first[-1].position)
    assert [p.index for p in rest] == [3, 0, 2]
    store.record_result(job.job_id, ok_result(3))  # a request with a result is not read again
    assert [p.index for p in store.next_requests(job.job_id)] == [1, 4, 0, 2]


def test_an_intake_is_invisible_until_committed_and_gone_when_aborted(tmp_path, store):
    intake = store.intake("acme", "m")
    intake.add(make_requests(3))
    assert store.list_jobs("acme") == [] and store.pending_by_tenant() == {}
    assert store.next_requests(intake.job_id) != []  # stored, but no job names it yet
    intake.abort()
    intake.close()
    assert store.next_requests(intake.job_id) == []
    left = store.intake("acme", "m")  # an intake left behind by a killed frontend ...
    left.add(make_requests(2))
    left.close()
    reopened = JobStore(store.path, Clock())  # ... is swept when the store is opened
    assert reopened.next_requests(left.job_id) == [] and reopened.list_jobs("acme") == []
    reopened.close()


def test_a_full_disk_refuses_the_job_and_keeps_nothing(tmp_path):
    with small_disk(tmp_path / "disk", megabytes=12) as disk:
        store = JobStore(disk / "jobs.sqlite3", Clock())
        kept = store.create_job("acme", "m", make_requests(2))
        intake = store.intake("acme", "m")
        with pytest.raises(StoreFull, match="disk is full"):
            for start in range(0, 10_000, 500):  # 30 MB of requests for a 12 MB disk
                intake.add([StagedRequest(i, f"c{i}", b"", bytes(3000))
                            for i in range(start, start + 500)])
        intake.abort()
        intake.close()
        assert [j.job_id for j in store.list_jobs("acme")] == [kept.job_id]
        assert store.next_requests(intake.job_id) == []
        assert len(store.next_requests(kept.job_id)) == 2
        store.close()


def test_prune_removes_old_finished_jobs_with_their_rows(store):
    done = store.create_job("acme", "m", make_requests(2))
    for i in range(2):
        store.record_result(done.job_id, ok_result(i))
    running = store.create_job("acme", "m", make_requests(2))
    finished_ms = store.get_job(done.job_id).finished_ms
    assert store.prune(finished_ms) == 0  # not older than the cut-off
    assert store.prune(finished_ms + 1) == 1
    with pytest.raises(JobNotFound):
        store.get_job(done.job_id)
    assert store.results(done.job_id) == [] and store.next_requests(done.job_id) == []
    assert [j.job_id for j in store.list_jobs("acme")] == [running.job_id]


def test_idempotency_key_returns_the_first_job(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path, Clock())
    first, created = store.submit("acme", "m", make_requests(2), idempotency_key="k1")
    assert created
    again, created = store.submit("acme", "m", make_requests(3), idempotency_key="k1")
    assert (again, created) == (first, False)
    other, created = store.submit("beta", "m", make_requests(1), idempotency_key="k1")
    assert created and other.job_id != first.job_id  # keys are per tenant
    store.close()
    reopened = JobStore(path, Clock())  # survives a restart
    assert reopened.find_job("acme", "k1") == first
    assert reopened.find_job("acme", "k2") is None
    reopened.close()


V1_SCHEMA = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL,
    model TEXT NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL DEFAULT 0);
CREATE TABLE requests (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
    prompt TEXT NOT NULL, sampling TEXT NOT NULL,
    PRIMARY KEY (job_id, idx), UNIQUE (job_id, custom_id));
CREATE TABLE job_keys (
    tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL, job_id TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key));
CREATE TABLE results (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (job_id, seq), UNIQUE (job_id, idx));
INSERT INTO jobs VALUES ('job-old', 'acme', 'running', 2, 'm', 5, 0);
INSERT INTO requests VALUES ('job-old', 0, 'a', '[1, 2, 3]', '{"max_tokens": 4, "temperature": 0.5, "top_p": 1.0, "seed": 3, "stop": ["x"]}');
INSERT INTO requests VALUES ('job-old', 1, 'b', '[4, 5]', '{"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": []}');
"""


def test_a_store_written_by_version_1_is_upgraded_and_resumes(tmp_path):
    import sqlite3

    from cluster.api.intake import PROTO_BODY
    from proto.orchard.v1 import orchard_pb2 as pb

    path = tmp_path / "jobs.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(V1_SCHEMA)
    old.execute("INSERT INTO results VALUES ('job-old', 0, 0, 1, ?)", (ok_result(0).to_json(),))
    old.commit()
    old.close()
    store = JobStore(path, Clock())
    job = store.get_job("job-old")
    assert (job.state, job.total, job.completed, job.failed) == (JobState.RUNNING, 2, 1, 0)
    pending = store.next_requests("job-old")
    assert [(p.index, p.custom_id) for p in pending] == [(1, "b")]
    assert pending[0].body[:1] == PROTO_BODY
    request = pb.Request.FromString(pending[0].body[1:])
    assert (list(request.tokens.ids), request.sampling.max_tokens) == ([4, 5], 2)
    assert store.record_result("job-old", ok_result(1)).seq == 1
    assert store.get_job("job-old").state is JobState.SUCCEEDED
    store.close()


def test_orchard_jobs_prune_at_the_command_line(tmp_path, capsys):
    import time

    from cluster.cli import main
    from frontend_harness import ACME_CONFIG

    (tmp_path / "orchard.toml").write_text(ACME_CONFIG)
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: time.time_ns() // 1_000_000)
    done = store.create_job("acme", "m", make_requests(1))
    store.record_result(done.job_id, ok_result(0))
    queued = store.create_job("acme", "m", make_requests(1))
    store.close()
    time.sleep(0.01)  # the job finished strictly before "now" of the prune
    assert main(["jobs", "prune", "--older-than", "1", "--run-dir", str(tmp_path)]) == 0
    assert "pruned 0 finished job(s) older than 1 days" in capsys.readouterr().out
    assert main(["jobs", "prune", "--older-than", "0", "--run-dir", str(tmp_path)]) == 0
    assert "pruned 1 finished job(s)" in capsys.readouterr().out
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
    assert [j.job_id for j in store.list_jobs("acme")] == [queued.job_id]
    store.close()
    assert main(["jobs", "prune", "--older-than", "-1", "--run-dir", str(tmp_path)]) == 2
    assert "--older-than must be >= 0" in capsys.readouterr().err
