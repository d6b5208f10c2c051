"""The job store: jobs persist, results are recorded exactly once, state follows results."""
import pytest

from cluster.jobs.store import (JobFinished, JobNotFound, JobState, JobStore, NewRequest,
                              StoredResult)
from workers.messages import SamplingParams


class Clock:
    def __init__(self):
        self.now = 1_000

    def __call__(self) -> int:
        self.now += 1
        return self.now


def make_requests(n):
    return [NewRequest(f"c{i}", (1, 2, i), SamplingParams(max_tokens=4, stop=("x",)))
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
    pending = reopened.pending_requests(job.job_id)
    assert [p.index for p in pending] == [0, 1, 2]
    assert pending[2].prompt == (1, 2, 2)
    assert pending[2].sampling == SamplingParams(max_tokens=4, stop=("x",))
    assert [j.job_id for j in reopened.unfinished_jobs()] == [job.job_id]


def test_result_recorded_exactly_once_and_job_finishes(store):
    job = store.create_job("acme", "m", make_requests(2))
    first = store.record_result(job.job_id, ok_result(1))
    assert first is not None and first.seq == 0
    assert store.record_result(job.job_id, ok_result(1)) is None  # a rerun: ignored
    assert store.get_job(job.job_id).state is JobState.QUEUED
    assert [p.index for p in store.pending_requests(job.job_id)] == [0]
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


def test_duplicate_custom_id_is_refused(store):
    import sqlite3
    reqs = make_requests(2)
    with pytest.raises(sqlite3.IntegrityError):
        store.create_job("acme", "m", [reqs[0], reqs[0]])
    assert store.list_jobs("acme") == []  # nothing half-written


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
