"""``cluster.jobs.store_intake``: a job accepted in pieces, under an ``intakes`` row stamped with
the clock, that exists whole (with its owner, model and priority) only once committed; the bytes
an intake counts; an abort after a commit that keeps the job; the sweep of intakes a killed
frontend left; SQLite's full disk as ``StoreFull`` and every other error as it was."""
from __future__ import annotations

import sqlite3

import pytest

from cluster.jobs.records import JobRecord, JobState, StagedRequest, StoreFull
from cluster.jobs.store import JobStore
from cluster.jobs.store_intake import JobIntake, disk_full_refuses, sweep_intakes
from tests.conftest import Clock
from workers.messages import Priority


def staged(n: int, start: int = 0) -> list[StagedRequest]:
    return [StagedRequest(i, f"c{i}", b"pp", f"body-{i}".encode()) for i in range(start, n)]


def rows(path: str, statement: str) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return db.execute(statement).fetchall()
    finally:
        db.close()


@pytest.fixture
def path(tmp_path) -> str:
    """A job store's file, its tables made (by ``JobStore``, as the frontend opens it)."""
    where = str(tmp_path / "jobs.sqlite3")
    JobStore(where, Clock()).close()
    return where


class TestWhatAnIntakeWrites:
    def test_an_intake_row_stamped_with_the_clock_until_the_commit_ends_it(self, path):
        clock = Clock(7_000)
        intake = JobIntake(path, clock, "acme", "m")
        try:
            assert rows(path, "SELECT * FROM intakes") == [(intake.job_id, 7_000)]
            intake.add(staged(2))
            clock.now = 7_500
            job, created = intake.commit()
        finally:
            intake.close()
        assert created and intake.committed
        assert rows(path, "SELECT * FROM intakes") == []
        assert job == JobRecord(intake.job_id, "acme", JobState.QUEUED, 2, 0, 0, "m", 7_500, 0,
                                owner="", priority=Priority.BATCH)

    def test_the_job_carries_the_intakes_owner_model_and_priority(self, path):
        intake = JobIntake(path, Clock(5), "acme", "tiny", owner="front-1",
                           priority=Priority.INTERACTIVE)
        try:
            intake.add(staged(1))
            job, _ = intake.commit()
        finally:
            intake.close()
        assert (job.tenant, job.model, job.owner, job.priority, job.created_ms) == (
            "acme", "tiny", "front-1", Priority.INTERACTIVE, 5)
        assert rows(path, "SELECT job_id, idx, prefix, custom_id, body FROM job_requests") == [
            (job.job_id, 0, b"pp", "c0", b"body-0")]

    def test_count_and_bytes_sum_every_piece(self, path):
        intake = JobIntake(path, Clock(), "acme", "m")
        try:
            intake.add(staged(2))                       # 2 + 2 + 6 bytes each
            intake.add([StagedRequest(2, "c-two", b"", bytes(100))])
            assert (intake.count, intake.bytes) == (3, 2 * 10 + 5 + 100)
        finally:
            intake.abort()
            intake.close()

    def test_a_repeated_key_returns_the_first_job_and_drops_this_intakes_rows(self, path):
        first = JobIntake(path, Clock(1), "acme", "m")
        first.add(staged(1))
        job, _ = first.commit("key")
        first.close()
        again = JobIntake(path, Clock(2), "acme", "other")
        try:
            again.add(staged(4))
            assert again.commit("key") == (job, False)
            assert not again.committed
        finally:
            again.close()
        assert rows(path, "SELECT job_id, COUNT(*) FROM job_requests GROUP BY job_id") == [
            (job.job_id, 1)]
        assert rows(path, "SELECT * FROM intakes") == []


class TestWhatAnAbortKeeps:
    def test_an_abort_before_the_commit_leaves_no_row(self, path):
        intake = JobIntake(path, Clock(), "acme", "m")
        intake.add(staged(3))
        intake.abort()
        intake.close()
        assert (rows(path, "SELECT * FROM job_requests"), rows(path, "SELECT * FROM intakes")) == (
            [], [])

    def test_an_abort_after_the_commit_keeps_the_job_and_its_requests(self, path):
        intake = JobIntake(path, Clock(), "acme", "m")
        intake.add(staged(3))
        job, _ = intake.commit()
        intake.abort()
        intake.close()
        assert rows(path, "SELECT job_id, total FROM jobs") == [(job.job_id, 3)]
        assert rows(path, "SELECT idx FROM job_requests ORDER BY idx") == [(0,), (1,), (2,)]


class TestTheSweepOfLeftIntakes:
    def test_the_sweep_drops_only_the_requests_of_intakes_never_committed(self, path):
        done = JobIntake(path, Clock(), "acme", "m")
        done.add(staged(2))
        job, _ = done.commit()
        done.close()
        left = [JobIntake(path, Clock(), "acme", "m") for _ in range(2)]
        for intake in left:
            intake.add(staged(3))
            intake.close()                               # a frontend killed before its commit
        db = sqlite3.connect(path, isolation_level=None)
        try:
            sweep_intakes(db)
        finally:
            db.close()
        assert rows(path, "SELECT job_id, COUNT(*) FROM job_requests GROUP BY job_id") == [
            (job.job_id, 2)]
        assert rows(path, "SELECT * FROM intakes") == []


class TestAFullDisk:
    def test_sqlite_full_is_store_full_with_what_to_do(self):
        db = sqlite3.connect(":memory:")
        db.execute("CREATE TABLE t (x BLOB)")
        db.execute("PRAGMA max_page_count = 2")          # a database that cannot grow
        with pytest.raises(StoreFull) as refused:
            with disk_full_refuses():
                db.execute("INSERT INTO t VALUES (?)", (bytes(100_000),))
        assert str(refused.value) == (
            "the job store's disk is full; the job was not created: free space (or `orchard jobs "
            "prune --older-than DAYS`) and submit again")
        assert refused.value.__cause__ is None

    def test_any_other_sqlite_error_passes_unchanged(self):
        db = sqlite3.connect(":memory:")
        with pytest.raises(sqlite3.OperationalError, match="no such table: nowhere"):
            with disk_full_refuses():
                db.execute("SELECT * FROM nowhere")
