"""The job store's intake commit, prune and transactions, with exact rows, states and instants."""
import sqlite3

import pytest

from cluster.jobs.records import JobRecord
from cluster.jobs.store import JobNotFound, JobState, JobStore

from tests.test_jobstore import Clock, make_requests, ok_result


@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite3", Clock())
    yield s
    s.close()


def _rows(store, table):
    db = sqlite3.connect(store.path)
    try:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        db.close()


def test_commit_creates_a_queued_job_with_exact_fields(store):
    job, created = store.submit("acme", "tiny", make_requests(3), idempotency_key="k")
    assert created
    assert job == JobRecord(job.job_id, "acme", JobState.QUEUED, 3, 0, 0, "tiny", 1002, 0)
    assert (_rows(store, "job_requests"), _rows(store, "job_keys"), _rows(store, "intakes")) == (
        3, 1, 0)


def test_a_repeated_key_drops_the_second_intake_and_its_requests(store):
    first, _ = store.submit("acme", "tiny", make_requests(2), idempotency_key="k")
    again, created = store.submit("acme", "other", make_requests(5), idempotency_key="k")
    assert (again, created) == (first, False)
    assert (_rows(store, "jobs"), _rows(store, "job_requests"), _rows(store, "job_keys")) == (
        1, 2, 1)
    no_key, created = store.submit("acme", "tiny", make_requests(1))
    assert created and no_key.job_id != first.job_id
    assert _rows(store, "job_keys") == 1                  # no key, no row


def test_commit_without_requests_is_a_value_error(store):
    intake = store.intake("acme", "tiny")
    try:
        with pytest.raises(ValueError) as info:
            intake.commit("k")
        assert str(info.value) == "requests: a job needs at least one request"
    finally:
        intake.close()
    assert _rows(store, "jobs") == 0


def test_prune_takes_succeeded_and_cancelled_jobs_before_the_cut_off_only(store):
    done = store.create_job("acme", "m", make_requests(1))
    store.record_result(done.job_id, ok_result(0))
    cancelled, _ = store.submit("acme", "m", make_requests(2), idempotency_key="c")
    store.cancel(cancelled.job_id)
    queued = store.create_job("acme", "m", make_requests(1))
    running = store.create_job("acme", "m", make_requests(1))
    store.mark_running(running.job_id)
    cut = store.get_job(cancelled.job_id).finished_ms
    assert store.prune(cut) == 1                           # only the job finished before it
    with pytest.raises(JobNotFound):
        store.get_job(done.job_id)
    assert store.get_job(cancelled.job_id).state is JobState.CANCELLED
    assert store.prune(cut + 1) == 1
    assert store.prune(10**12) == 0                        # queued and running stay
    assert [j.job_id for j in store.list_jobs("acme")] == [running.job_id, queued.job_id]
    assert (_rows(store, "job_requests"), _rows(store, "results"), _rows(store, "job_keys")) == (
        2, 0, 0)
    again, created = store.submit("acme", "m", make_requests(1), idempotency_key="c")
    assert created and again.job_id != cancelled.job_id   # the pruned job's key is free


def test_a_failed_transaction_leaves_nothing_behind(store):
    job = store.create_job("acme", "m", make_requests(1))
    with pytest.raises(RuntimeError):
        with store._transaction():
            store._db.execute("DELETE FROM jobs WHERE job_id = ?", (job.job_id,))
            raise RuntimeError("stop")
    assert store.get_job(job.job_id) == job
    assert not store._db.in_transaction


def test_an_intake_in_pieces_counts_every_piece_and_names_its_job_exactly(store):
    intake = store.intake("acme", "m")
    try:
        assert len(intake.job_id) == 20 and intake.job_id.startswith("job-")
        int(intake.job_id[4:], 16)                        # 16 hex digits
        intake.add(make_requests(2))
        intake.add(make_requests(5)[2:])
        job, created = intake.commit()
    finally:
        intake.close()
    assert created and job.total == 5
    assert _rows(store, "job_keys") == 0                  # committed without a key
    assert [(r.job_id, r.index) for r in store.next_requests(job.job_id)] == [
        (job.job_id, i) for i in range(5)]


def test_cancelling_a_finished_job_says_so_exactly(store):
    from cluster.jobs.store import JobFinished
    job = store.create_job("acme", "m", make_requests(1))
    store.record_result(job.job_id, ok_result(0))
    with pytest.raises(JobFinished) as info:
        store.cancel(job.job_id)
    assert str(info.value) == (f"job_id: job {job.job_id} is already succeeded; "
                               "only queued or running jobs can be cancelled")
