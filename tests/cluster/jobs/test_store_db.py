"""The job store's SQLite connection (``cluster.jobs.store_db``): its pragmas, a job row read
by id (scoped to a tenant when one is named) and by idempotency key, and one transaction's
commit or rollback."""
from __future__ import annotations

import pytest

from cluster.jobs.records import JobNotFound, JobRecord, JobState
from cluster.jobs.schema import open_schema
from cluster.jobs.store_db import Transaction, connect, find_job, get_job
from workers.messages import Priority

JOB = JobRecord("job-1", "acme", JobState.RUNNING, 4, 2, 1, "m", 5, 0, owner="fe-1",
                priority=Priority.INTERACTIVE)


@pytest.fixture
def db(tmp_path):
    db = connect(str(tmp_path / "jobs.sqlite3"))
    open_schema(db)
    db.execute("INSERT INTO jobs (job_id, tenant, state, total, completed, failed, model, "
               "created_ms, finished_ms, owner, priority) VALUES "
               "('job-1', 'acme', 'running', 4, 2, 1, 'm', 5, 0, 'fe-1', 'interactive')")
    db.execute("INSERT INTO job_keys VALUES ('acme', 'k1', 'job-1')")
    yield db
    db.close()


class TestConnection:
    def test_a_connection_has_the_stores_pragmas(self, db):
        pragma = lambda name: db.execute(f"PRAGMA {name}").fetchone()[0]  # noqa: E731
        assert (pragma("journal_mode"), pragma("synchronous"), pragma("busy_timeout"),
                pragma("wal_autocheckpoint"), pragma("journal_size_limit")) == (
            "wal", 1, 5000, 1000, 8 << 20)


class TestJobRows:
    def test_a_job_is_read_by_id_and_for_its_own_tenant_only(self, db):
        assert get_job(db, "job-1") == JOB
        assert get_job(db, "job-1", "acme") == JOB
        with pytest.raises(JobNotFound, match="^job_id: no job 'job-1'$"):
            get_job(db, "job-1", "beta")
        with pytest.raises(JobNotFound, match="^job_id: no job 'job-2'$"):
            get_job(db, "job-2")

    def test_a_job_is_found_by_its_tenants_idempotency_key(self, db):
        assert find_job(db, "acme", "k1") == JOB
        assert find_job(db, "acme", "k2") is None
        assert find_job(db, "beta", "k1") is None


class TestTransaction:
    def test_a_transaction_commits_or_rolls_back_on_an_exception(self, db):
        with Transaction(db):
            db.execute("UPDATE jobs SET completed = 3")
        assert get_job(db, "job-1").completed == 3
        with pytest.raises(RuntimeError, match="stop"):
            with Transaction(db):
                db.execute("UPDATE jobs SET completed = 4")
                raise RuntimeError("stop")
        assert get_job(db, "job-1").completed == 3
        assert not db.in_transaction
