"""The job store's defaults and limits, exactly: the page sizes, the listing's time filter, the
intake's disk-space check at its boundary, and a store used from a thread other than its own."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from small_disk import small_disk

from cluster.jobs.store import DISK_RESERVE_BYTES, JobStore, StagedRequest, StoreFull

from tests.test_jobstore import Clock, make_requests, ok_result
from tests.test_jobstore import store  # noqa: F401 (the fixture)


def test_a_listing_is_fifty_jobs_unless_asked_and_starts_at_the_epoch(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)  # every job created at 0 ms
    ids = [store.create_job("acme", "m", make_requests(1)).job_id for _ in range(51)]
    listed = [j.job_id for j in store.list_jobs("acme")]
    assert listed == ids[::-1][:50]  # newest first (same instant: the later row first)
    assert len(store.list_jobs("acme", limit=51)) == 51
    assert store.list_jobs("acme", since_ms=1) == []
    store.close()


def test_a_page_of_results_is_a_thousand_unless_asked(store):
    job = store.create_job("acme", "m", make_requests(1001))
    for i in range(1001):
        store.record_result(job.job_id, ok_result(i))
    page = store.results(job.job_id)
    assert [r.seq for r in page] == list(range(1000))
    assert [(r.seq, r.index) for r in store.results(job.job_id, offset=1000)] == [(1000, 1000)]


def test_the_store_and_an_intake_answer_from_another_thread(store):
    """The frontend opens both on its event loop and runs an intake's pieces on a worker
    thread (``asyncio.to_thread``): the connections must not be tied to their thread."""
    intake = store.intake("acme", "m")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(intake.add, make_requests(2)).result(timeout=30)
        job, created = pool.submit(intake.commit).result(timeout=30)
        assert created and pool.submit(store.get_job, job.job_id).result(timeout=30) == job
    intake.close()


def _free(directory) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def test_an_intake_is_refused_exactly_when_twice_its_bytes_would_eat_the_reserve(tmp_path):
    """Refused while ``free < 2 x (body + prefix + custom_id) + DISK_RESERVE_BYTES``."""
    with small_disk(tmp_path / "disk", megabytes=8) as disk:
        store = JobStore(disk / "jobs.sqlite3", Clock())
        intake = store.intake("acme", "m")
        room = _free(disk) - DISK_RESERVE_BYTES  # what twice the piece's bytes may reach
        body = room // 2 - len(b"pp") - len("c0")

        def piece(size: int) -> list[StagedRequest]:
            return [StagedRequest(0, "c0", b"pp", bytes(size))]

        with pytest.raises(StoreFull) as refused:
            intake.add(piece(body + 1))  # two bytes over
        assert str(refused.value) == (
            "the job store's disk is full; the job was not created: free space (or `orchard "
            "jobs prune --older-than DAYS`) and submit again")
        assert intake.count == 0
        intake.add(piece(body))  # exactly at the reserve: taken
        job, _ = intake.commit()
        assert (job.total, len(store.next_requests(job.job_id)[0].body)) == (1, body)
        intake.close()
        store.close()
