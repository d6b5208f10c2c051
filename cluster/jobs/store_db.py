"""The job store's SQLite connection and what the store and its intakes share of it.

``connect`` opens a connection with the store's pragmas (WAL, ``synchronous=NORMAL``, the
log's checkpoint and size limit); ``Transaction`` is one ``BEGIN IMMEDIATE`` ... ``COMMIT``;
``get_job`` and ``find_job`` read a job row (``JobStore`` and ``JobIntake``, in
``cluster.jobs.store`` and ``cluster.jobs.store_intake``, each on its own connection).
"""
from __future__ import annotations

import sqlite3

from cluster.jobs.records import JobNotFound, JobRecord, JobState
from workers.messages import Priority

AUTOCHECKPOINT_PAGES = 1000       # SQLite's default: the log is folded back every 4 MB
WAL_LIMIT_BYTES = 8 << 20         # ... and truncated to at most this much after a checkpoint

# The statements (see ``cluster.jobs.store`` on why they are out of mutation testing's reach).
# pragma: no mutate start
JOB_COLUMNS = ("job_id, tenant, state, total, completed, failed, model, created_ms, finished_ms, "
               "owner, priority")
CONNECTION_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL",
                      "PRAGMA busy_timeout=5000", f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}",
                      f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
SYNC_FULL, SYNC_NORMAL = "PRAGMA synchronous=FULL", "PRAGMA synchronous=NORMAL"
CHECKPOINT = "PRAGMA wal_checkpoint(TRUNCATE)"
BEGIN, COMMIT, ROLLBACK = "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"
GET_JOB = f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ?"
FIND_JOB = "SELECT job_id FROM job_keys WHERE tenant = ? AND idempotency_key = ?"
# pragma: no mutate end


def connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in CONNECTION_PRAGMAS:
        db.execute(pragma)
    return db


def job_of(row) -> JobRecord:
    """A job from a row of ``JOB_COLUMNS``."""
    return JobRecord(job_id=row[0], tenant=row[1], state=JobState(row[2]), total=row[3],
                     completed=row[4], failed=row[5], model=row[6], created_ms=row[7],
                     finished_ms=row[8], owner=row[9], priority=Priority(row[10]))


def get_job(db: sqlite3.Connection, job_id: str, tenant: str | None = None) -> JobRecord:
    row = db.execute(GET_JOB, (job_id,)).fetchone()
    if row is None or (tenant is not None and row[1] != tenant):
        raise JobNotFound(f"job_id: no job {job_id!r}")
    return job_of(row)


def find_job(db: sqlite3.Connection, tenant: str, idempotency_key: str) -> JobRecord | None:
    row = db.execute(FIND_JOB, (tenant, idempotency_key)).fetchone()
    return None if row is None else get_job(db, row[0])


class Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on an exception)."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute(BEGIN)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._db.execute(COMMIT)
        elif self._db.in_transaction:  # SQLite already rolled back after e.g. a full disk
            self._db.execute(ROLLBACK)
