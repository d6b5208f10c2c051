"""Listing jobs: pages, state and creation-time filters, in the store, over gRPC and in
``orchard jobs`` (how ``--since`` reads is in ``tests/cluster/commands/test_jobs.py``)."""
import json

import pytest

from cluster.api.client import OrchardError, token_request
from cluster.cli import main as orchard
from cluster.jobs.store import JobNotFound, JobState, JobStore, StagedRequest
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend


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


def test_list_jobs_over_grpc_and_the_command(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as api:
        with api.client("acme") as client:
            made = [client.submit([token_request("a", [5, 6, 7], 1)]) for _ in range(3)]
            for job in made:
                client.wait(job.job_id, poll_s=0.05, timeout_s=60)
            page, token = client.jobs_page(page_size=2)
            rest, last = client.jobs_page(page_size=2, page_token=token)
            assert [j.job_id for j in page + rest] == [j.job_id for j in made[::-1]]
            assert token and last == ""
            assert client.jobs(states=["running"]) == []
            assert len(client.jobs(states=["succeeded"], since_ms=made[1].created_unix_ms)) == 2
            with pytest.raises(OrchardError, match="INVALID_ARGUMENT: page_token"):
                client.jobs_page(page_token="bm9wZQ==")
        assert orchard(["jobs", "--run-dir", str(run_dir), "--state", "succeeded",
                        "--since", "1h", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [j["job_id"] for j in listed] == [j.job_id for j in made[::-1]]
        assert all(j["finished_unix_ms"] >= j["created_unix_ms"] > 0 for j in listed)
