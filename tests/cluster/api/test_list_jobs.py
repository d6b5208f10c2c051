"""Listing jobs in the job store (``cluster.jobs.store``): pages, state and creation-time
filters. They belong in tests/cluster/jobs/test_store.py, which is held unchanged while its
mutation score is measured; over gRPC: tests/cluster/api/test_servicer.py, in ``orchard jobs``:
tests/cluster/commands/test_jobs.py."""
import pytest

from cluster.jobs.store import JobNotFound, JobState, JobStore, StagedRequest


def _request(i: int) -> StagedRequest:
    return StagedRequest(0, f"r{i}", b"", b"")


@pytest.fixture
def store(tmp_path):
    now = [1_000]
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: now[0])
    ids = []
    for i in range(5):
        now[0] = 1_000 + i * 100  # jobs 100 ms apart; job 4 is the newest
        ids.append(store.create_job("acme", "m", [_request(i)]).job_id)
    store.create_job("beta", "m", [_request(9)])
    store.cancel(ids[1])
    yield store, ids
    store.close()


def test_pages_walk_newest_first_without_gaps_or_repeats(store):
    store, ids = store
    first = store.list_jobs("acme", 2)
    second = store.list_jobs("acme", 2, after=first[-1].job_id)
    third = store.list_jobs("acme", 2, after=second[-1].job_id)
    assert [j.job_id for j in first + second + third] == ids[::-1]
    assert store.list_jobs("acme", 2, after=ids[0]) == []


def test_filters_by_state_and_creation_time(store):
    store, ids = store
    assert [j.job_id for j in store.list_jobs("acme", states=(JobState.CANCELLED,))] == [ids[1]]
    assert [j.job_id for j in store.list_jobs("acme", since_ms=1_300)] == [ids[4], ids[3]]
    queued = store.list_jobs("acme", states=(JobState.QUEUED,), since_ms=1_100)
    assert [j.job_id for j in queued] == [ids[4], ids[3], ids[2]]


def test_another_tenants_job_is_no_page_token(store):
    store, _ = store
    beta = store.list_jobs("beta")[0].job_id
    with pytest.raises(JobNotFound):
        store.list_jobs("acme", after=beta)
