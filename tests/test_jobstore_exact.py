"""The job store's listing and result stream with exact ids, states and sequence numbers."""
import pytest

from cluster.jobs.store import JobNotFound, JobState, StoredResult

from tests.test_jobstore import make_requests, ok_result
from tests.test_jobstore import store  # noqa: F401 (the fixture)


def _failed(index: int) -> StoredResult:
    return StoredResult(index=index, custom_id=f"c{index}", request_id=f"r{index}", ok=False,
                        error_code="INTERNAL", error_message="boom")


def test_list_jobs_filters_by_state_time_and_page(store):
    first = store.create_job("acme", "m", make_requests(1))
    second = store.create_job("acme", "m", make_requests(2))
    third = store.create_job("acme", "m", make_requests(1))
    store.create_job("bravo", "m", make_requests(1))
    store.cancel(second.job_id)
    store.record_result(third.job_id, ok_result(0))            # third succeeds
    ids = lambda jobs: [j.job_id for j in jobs]                # noqa: E731
    assert ids(store.list_jobs("acme")) == [third.job_id, second.job_id, first.job_id]
    assert ids(store.list_jobs("acme", states=[JobState.QUEUED])) == [first.job_id]
    assert ids(store.list_jobs("acme", states=[JobState.CANCELLED, JobState.SUCCEEDED])) == [
        third.job_id, second.job_id]
    assert ids(store.list_jobs("acme", since_ms=1004)) == [third.job_id, second.job_id]
    assert ids(store.list_jobs("acme", after=third.job_id)) == [second.job_id, first.job_id]
    assert ids(store.list_jobs("acme", limit=1, after=second.job_id)) == [first.job_id]
    with pytest.raises(JobNotFound, match=f"no job '{third.job_id}'"):
        store.list_jobs("bravo", after=third.job_id)


def test_results_stream_in_order_with_exact_counts(store):
    job = store.create_job("acme", "m", make_requests(3))
    store.mark_running(job.job_id)
    assert store.get_job(job.job_id).state is JobState.RUNNING
    assert store.record_result(job.job_id, _failed(2)).seq == 0
    assert store.record_result(job.job_id, ok_result(0)).seq == 1
    assert store.record_result(job.job_id, ok_result(0)) is None  # a rerun: not stored
    assert store.pending_by_tenant() == {"acme": 1}
    assert [r.index for r in store.next_requests(job.job_id)] == [1]
    assert store.record_result(job.job_id, ok_result(1)).seq == 2
    done = store.get_job(job.job_id)
    assert (done.state, done.completed, done.failed, done.finished_ms) == (
        JobState.SUCCEEDED, 2, 1, done.finished_ms)
    assert done.finished_ms > done.created_ms
    assert [(r.seq, r.index, r.ok) for r in store.results(job.job_id)] == [
        (0, 2, False), (1, 0, True), (2, 1, True)]
    assert [r.seq for r in store.results(job.job_id, offset=1, limit=1)] == [1]
    assert store.pending_by_tenant() == {}
    assert store.results(job.job_id)[0].error_message == "boom"


def test_a_result_for_a_cancelled_job_is_not_stored(store):
    job = store.create_job("acme", "m", make_requests(3))
    assert store.record_result(job.job_id, ok_result(0)).seq == 0
    assert store.cancel(job.job_id).cancelled == 2
    assert store.record_result(job.job_id, ok_result(1)) is None   # came back too late
    assert store.record_result(job.job_id, _failed(2)) is None
    again = store.get_job(job.job_id)
    assert (again.state, again.completed, again.failed, again.cancelled) == (
        JobState.CANCELLED, 1, 0, 2)
    assert [r.index for r in store.results(job.job_id)] == [0]
    assert [r.index for r in store.next_requests(job.job_id)] == [1, 2]
