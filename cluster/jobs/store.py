"""The durable job store: jobs, their requests and their results in SQLite (WAL).

It owns every job's state; the frontend's job runner asks it for the next requests to run, in
dispatch order, a page at a time, and hands it each result. The tables are in
``cluster.jobs.schema``; a request is stored once, as the client sent it (``body``, opaque
here), and templated and tokenized only when it is dispatched.

Acceptance (``JobIntake``): a job's requests are written in pieces on a connection of their
own, off the event loop, under an ``intakes`` row; the job itself (its ``jobs`` row, and the
idempotency key) appears only in the last, fsynced (``synchronous=FULL``) transaction. A job
is therefore whole or absent: a refused, failed or killed intake leaves only rows no query
reads, and they are deleted at once, or when the store is next opened.

Exactly once: a result is inserted with ``UNIQUE(job_id, idx)``, so a request that runs again
after a crash (its result was not committed yet) yields one stored result, never two; its
``seq`` (the position in the job's result stream, used to resume a stream) is the job's count
of results, kept on its ``jobs`` row and bumped in the same transaction, so recording a result
costs the same for the first request of a job as for its 50,000th. Results commit with
``synchronous=NORMAL`` in WAL mode, which survives a killed process; a result lost to a power
cut is simply run again.

The write-ahead log is checkpointed automatically every ``AUTOCHECKPOINT_PAGES`` and cut back
to ``WAL_LIMIT_BYTES`` after each checkpoint, so a 44 MB intake does not leave a 44 MB log;
``prune`` deletes finished jobs with their requests and results. The store is used from one
thread (the frontend's event loop), an intake from one worker thread at a time; every call is
one short transaction. The clock is injected (milliseconds since the epoch).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from pathlib import Path
from typing import Callable, Sequence

from cluster.jobs.records import (JobFinished, JobNotFound, JobRecord, JobState, NewRequest,
                                  PendingRequest, StagedRequest, StoredRequest, StoredResult,
                                  StoreFull)
from cluster.jobs.schema import open_schema

__all__ = ["JobFinished", "JobNotFound", "JobRecord", "JobState", "JobStore", "JobIntake",
           "NewRequest", "PendingRequest", "StagedRequest", "StoredRequest", "StoredResult",
           "StoreFull"]

AUTOCHECKPOINT_PAGES = 1000       # SQLite's default: the log is folded back every 4 MB
WAL_LIMIT_BYTES = 8 << 20         # ... and truncated to at most this much after a checkpoint
PAGE_ROWS = 256                   # requests read per page by the runner
DISK_RESERVE_BYTES = 4 << 20      # an intake stops while this much is free (room to undo it)

# The statements. Out of mutation testing's reach: SQLite reads keywords, table and column
# names and pragma values without regard to letter case and none of these holds a quoted
# literal, so a mutant that only changes their case (88 of the module's did) cannot change
# what the store does. What they do is tested through the store all the same.
# pragma: no mutate start
JOB_COLUMNS = ("job_id, tenant, state, total, completed, failed, model, created_ms, finished_ms, "
               "owner")
CONNECTION_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL",
                      "PRAGMA busy_timeout=5000", f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}",
                      f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
SYNC_FULL, SYNC_NORMAL = "PRAGMA synchronous=FULL", "PRAGMA synchronous=NORMAL"
CHECKPOINT = "PRAGMA wal_checkpoint(TRUNCATE)"
VACUUM = "PRAGMA incremental_vacuum"
BEGIN, COMMIT, ROLLBACK = "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"

GET_JOB = f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ?"
FIND_JOB = "SELECT job_id FROM job_keys WHERE tenant = ? AND idempotency_key = ?"
LIST_JOBS = (f"SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = ? AND created_ms >= ?{{states}}"
             "{after} ORDER BY created_ms {order}, rowid {order} LIMIT ?")
LIST_STATES = " AND state IN ({})"  # one placeholder per state
LIST_AFTER = " AND (created_ms, rowid) < (SELECT created_ms, rowid FROM jobs WHERE job_id = ?)"
LIST_BEFORE = " AND (created_ms, rowid) > (SELECT created_ms, rowid FROM jobs WHERE job_id = ?)"
UNFINISHED_JOBS = (f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN (?, ?) "
                   "ORDER BY created_ms, rowid")
MARK_RUNNING = "UPDATE jobs SET state = ? WHERE job_id = ? AND state = ?"
CANCEL = "UPDATE jobs SET state = ?, finished_ms = ? WHERE job_id = ?"
PRUNABLE = "SELECT job_id FROM jobs WHERE state IN (?, ?) AND finished_ms < ?"
DELETE_JOB = tuple(f"DELETE FROM {table} WHERE job_id = ?"
                   for table in ("job_requests", "results", "job_keys", "jobs"))

NEXT_REQUESTS = (
    "SELECT r.prefix, r.idx, r.custom_id, r.body FROM job_requests r "
    "WHERE r.job_id = ? AND (r.prefix, r.idx) > (?, ?) AND NOT EXISTS "
    "(SELECT 1 FROM results s WHERE s.job_id = r.job_id AND s.idx = r.idx) "
    "ORDER BY r.prefix, r.idx LIMIT ?")
PENDING_BY_TENANT = ("SELECT tenant, SUM(total - completed - failed) FROM jobs "
                     "WHERE state IN (?, ?) GROUP BY tenant")
INSERT_RESULT = ("INSERT OR IGNORE INTO results (job_id, seq, idx, ok, body) "
                 "SELECT job_id, completed + failed, ?, ?, ? FROM jobs WHERE job_id = ? "
                 "AND state IN (?, ?)")
COUNT_RESULT = ("UPDATE jobs SET completed = completed + ?, failed = failed + ? "
                "WHERE job_id = ? RETURNING completed + failed - 1")
FINISH_JOB = ("UPDATE jobs SET state = ?, finished_ms = ? WHERE job_id = ? AND state IN (?, ?) "
              "AND total = completed + failed")
RESULTS = "SELECT seq, body FROM results WHERE job_id = ? AND seq >= ? ORDER BY seq LIMIT ?"

INSERT_INTAKE = "INSERT INTO intakes VALUES (?, ?)"
INSERT_REQUESTS = "INSERT INTO job_requests VALUES (?, ?, ?, ?, ?)"
INSERT_JOB = ("INSERT INTO jobs (job_id, tenant, state, total, model, created_ms, owner) "
              "VALUES (?, ?, ?, ?, ?, ?, ?)")
INSERT_KEY = "INSERT INTO job_keys VALUES (?, ?, ?)"
END_INTAKE = "DELETE FROM intakes WHERE job_id = ?"
DROP_INTAKE = ("DELETE FROM job_requests WHERE job_id = ?", END_INTAKE)
INTAKES = "SELECT job_id FROM intakes"
JOBS_BY_STATE = "SELECT state, COUNT(*) FROM jobs GROUP BY state"
# pragma: no mutate end


class JobStore:
    def __init__(self, path: Path | str, clock_ms: Callable[[], int], owner: str = ""):
        """``owner``: the frontend whose jobs this store's intakes create (its lease,
        ``cluster.jobs.lease``); ``""`` makes them nobody's, for any frontend to take."""
        self._path = str(path)
        self._clock_ms = clock_ms
        self._owner = owner
        self._db = connect(self._path)
        open_schema(self._db)
        sweep_intakes(self._db)  # requests of intakes a killed frontend left behind

    def close(self) -> None:
        self._db.close()

    @property
    def path(self) -> str:
        return self._path

    @property
    def owner(self) -> str:
        """The frontend whose jobs this store's intakes create (``""``: nobody's)."""
        return self._owner

    # ------------------------------------------------------------------ jobs

    def intake(self, tenant: str, model: str) -> JobIntake:
        """Start accepting a job: its requests go in pieces, the job appears on ``commit``."""
        return JobIntake(self._path, self._clock_ms, tenant, model, self._owner)

    def create_job(self, tenant: str, model: str, requests: Sequence[StagedRequest]
                   ) -> JobRecord:
        """Persist a job and all its requests (a small job, in one go)."""
        job, _ = self.submit(tenant, model, requests)
        return job

    def submit(self, tenant: str, model: str, requests: Sequence[StagedRequest],
               idempotency_key: str = "") -> tuple[JobRecord, bool]:
        """Persist a job unless ``idempotency_key`` already names one of ``tenant``'s jobs.

        Returns the job and whether it was created now: a client that retries a submission
        whose answer it lost gets the first job back, and nothing runs twice.
        """
        intake = self.intake(tenant, model)
        try:
            intake.add(requests)
            return intake.commit(idempotency_key)
        finally:
            intake.close()

    def find_job(self, tenant: str, idempotency_key: str) -> JobRecord | None:
        return find_job(self._db, tenant, idempotency_key)

    def get_job(self, job_id: str, tenant: str | None = None) -> JobRecord:
        return get_job(self._db, job_id, tenant)

    def list_jobs(self, tenant: str, limit: int = 50, states: Sequence[JobState] = (),
                  since_ms: int = 0, after: str = "", before: str = "") -> list[JobRecord]:
        """``tenant``'s jobs, newest first: in ``states`` (any if empty), created at or after
        ``since_ms``, and older than the job ``after`` (a page's last job) or newer than the
        job ``before`` (a page's first: the ``limit`` newer jobs next to it, still newest
        first). A cursor that is not the tenant's job is JobNotFound."""
        if after and before:
            raise ValueError("give one cursor: after (older jobs) or before (newer ones)")
        args = [tenant, since_ms, *(state.value for state in states)]
        cursor = after or before
        if cursor:
            self.get_job(cursor, tenant)
            args.append(cursor)
        sql = LIST_JOBS.format(
            states=LIST_STATES.format(", ".join("?" * len(states))) if states else "",
            after=LIST_AFTER if after else LIST_BEFORE if before else "",
            order="ASC" if before else "DESC")
        rows = self._db.execute(sql, (*args, limit)).fetchall()
        jobs = [_job(row) for row in rows]
        return jobs[::-1] if before else jobs

    def unfinished_jobs(self) -> list[JobRecord]:
        """Queued and running jobs, oldest first: what a restarted frontend resumes."""
        rows = self._db.execute(UNFINISHED_JOBS, (JobState.QUEUED.value,
                                                  JobState.RUNNING.value)).fetchall()
        return [_job(row) for row in rows]

    def mark_running(self, job_id: str) -> None:
        self._db.execute(MARK_RUNNING, (JobState.RUNNING.value, job_id, JobState.QUEUED.value))

    def cancel(self, job_id: str, tenant: str | None = None) -> JobRecord:
        job = self.get_job(job_id, tenant)
        if job.state.finished:
            raise JobFinished(f"job_id: job {job_id} is already {job.state.value}; "
                              "only queued or running jobs can be cancelled")
        self._db.execute(CANCEL, (JobState.CANCELLED.value, self._clock_ms(), job_id))
        return self.get_job(job_id)

    def prune(self, finished_before_ms: int) -> int:
        """Delete jobs that finished before ``finished_before_ms``, with their requests and
        results; returns how many. Freed pages go back to the file system when the store was
        created by this version (``auto_vacuum``)."""
        ids = [row[0] for row in self._db.execute(
            PRUNABLE, (JobState.SUCCEEDED.value, JobState.CANCELLED.value, finished_before_ms))]
        for job_id in ids:
            with self._transaction():
                for statement in DELETE_JOB:
                    self._db.execute(statement, (job_id,))
        if ids:
            self._db.execute(VACUUM)
            self.checkpoint()
        return len(ids)

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database and cut it back to nothing."""
        self._db.execute(CHECKPOINT)

    # -------------------------------------------------------------- requests

    def next_requests(self, job_id: str, after: tuple[bytes, int] = (b"", -1),
                      limit: int = PAGE_ROWS) -> list[StoredRequest]:
        """Up to ``limit`` requests of ``job_id`` without a result, in dispatch order (by
        shared prefix, then by place in the file), from just after ``after``."""
        rows = self._db.execute(NEXT_REQUESTS,
                                (job_id, after[0], after[1], limit)).fetchall()
        return [StoredRequest(job_id, idx, custom_id, body, (prefix, idx))
                for prefix, idx, custom_id, body in rows]

    def pending_by_tenant(self) -> dict[str, int]:
        """Requests accepted but without a result, per tenant, over unfinished jobs."""
        rows = self._db.execute(PENDING_BY_TENANT, (JobState.QUEUED.value,
                                                    JobState.RUNNING.value)).fetchall()
        return {tenant: pending for tenant, pending in rows if pending}

    def jobs_by_state(self) -> dict[JobState, int]:
        """How many jobs the store holds in each state (every state, 0 when none)."""
        counts = dict(self._db.execute(JOBS_BY_STATE).fetchall())
        return {state: counts.get(state.value, 0) for state in JobState}

    # --------------------------------------------------------------- results

    def record_result(self, job_id: str, result: StoredResult) -> StoredResult | None:
        """Store ``result`` once; ``None`` if that request already has one (a rerun) or its
        job has ended (a result that came back as its job was cancelled: the cancel counted it).

        The job turns ``succeeded`` in the same transaction when this was its last result.
        """
        with self._transaction():
            cursor = self._db.execute(
                INSERT_RESULT, (result.index, int(result.ok), result.to_json(), job_id,
                                JobState.QUEUED.value, JobState.RUNNING.value))
            if cursor.rowcount == 0:
                return None
            ok = int(result.ok)
            seq = self._db.execute(COUNT_RESULT, (ok, 1 - ok, job_id)).fetchone()[0]
            self._db.execute(
                FINISH_JOB,
                (JobState.SUCCEEDED.value, self._clock_ms(), job_id, JobState.QUEUED.value,
                 JobState.RUNNING.value))
        return StoredResult.from_json(seq, result.to_json())

    def results(self, job_id: str, offset: int = 0, limit: int = 1000) -> list[StoredResult]:
        """Results of ``job_id`` with ``seq >= offset``, in ``seq`` order."""
        rows = self._db.execute(RESULTS, (job_id, offset, limit)).fetchall()
        return [StoredResult.from_json(seq, body) for seq, body in rows]

    def _transaction(self):
        return _Transaction(self._db)


class JobIntake:
    """One job being accepted, on a connection of its own (used from one thread at a time).

    ``add`` stores a piece of the job's requests in one transaction; ``commit`` makes the job
    exist (queued) in one fsynced transaction; ``abort`` (or a failed ``add``) deletes what was
    stored. Until ``commit`` nothing else in the store sees the job.
    """

    def __init__(self, path: str, clock_ms: Callable[[], int], tenant: str, model: str,
                 owner: str = ""):
        self._clock_ms = clock_ms
        self._owner = owner
        self._tenant = tenant
        self._model = model
        self._path = path
        self._db = connect(path)
        self.job_id = f"job-{secrets.token_hex(8)}"
        self.count = 0
        with _disk_full_refuses():
            self._db.execute(INSERT_INTAKE, (self.job_id, clock_ms()))

    def add(self, requests: Sequence[StagedRequest]) -> None:
        rows = [(self.job_id, r.index, r.prefix, r.custom_id, r.body) for r in requests]
        # Refuse while there is still room to delete what was stored: in WAL mode even a
        # DELETE needs log space, so an intake that ran the disk to the last byte could not
        # clean up after itself (the next start would).
        needed = 2 * sum(len(r.body) + len(r.prefix) + len(r.custom_id) for r in requests)
        if _free_bytes(self._path) < needed + DISK_RESERVE_BYTES:
            raise StoreFull(_FULL)
        with _disk_full_refuses(), _Transaction(self._db):
            self._db.executemany(INSERT_REQUESTS, rows)
        self.count += len(rows)

    def commit(self, idempotency_key: str = "") -> tuple[JobRecord, bool]:
        """Create the job, or return the one ``idempotency_key`` already names (then this
        intake's requests are dropped)."""
        if self.count == 0:
            raise ValueError("requests: a job needs at least one request")
        if idempotency_key and (existing := find_job(self._db, self._tenant,
                                                     idempotency_key)) is not None:
            self.abort()
            return existing, False
        self._db.execute(SYNC_FULL)
        try:
            with _disk_full_refuses(), _Transaction(self._db):
                self._db.execute(INSERT_JOB, (self.job_id, self._tenant, JobState.QUEUED.value,
                                              self.count, self._model, self._clock_ms(),
                                              self._owner))
                if idempotency_key:
                    self._db.execute(INSERT_KEY, (self._tenant, idempotency_key, self.job_id))
                self._db.execute(END_INTAKE, (self.job_id,))
        finally:
            self._db.execute(SYNC_NORMAL)
        try:  # the intake's pages went through the log: fold them back now, off the loop
            self._db.execute(CHECKPOINT)
        except sqlite3.OperationalError:
            pass  # busy: the next automatic checkpoint does it
        return get_job(self._db, self.job_id), True

    def abort(self) -> None:
        """Delete what this intake stored (if the disk is too full even for that, the store
        deletes it when next opened: nothing reads an intake's rows meanwhile)."""
        try:
            with _Transaction(self._db):
                for statement in DROP_INTAKE:
                    self._db.execute(statement, (self.job_id,))
        except sqlite3.OperationalError:
            pass

    def close(self) -> None:
        self._db.close()


@contextlib.contextmanager
def _disk_full_refuses():
    """SQLite's "database or disk is full" as ``StoreFull`` (the transaction is rolled back)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
            raise
        raise StoreFull(_FULL) from None


_FULL = ("the job store's disk is full; the job was not created: free space (or `orchard jobs "
         "prune --older-than DAYS`) and submit again")


def _free_bytes(path: str) -> int:
    stat = os.statvfs(os.path.dirname(os.path.abspath(path)))
    return stat.f_bavail * stat.f_frsize


def _job(row) -> JobRecord:
    return JobRecord(job_id=row[0], tenant=row[1], state=JobState(row[2]), total=row[3],
                     completed=row[4], failed=row[5], model=row[6], created_ms=row[7],
                     finished_ms=row[8], owner=row[9])


def connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    for pragma in CONNECTION_PRAGMAS:
        db.execute(pragma)
    return db


def get_job(db: sqlite3.Connection, job_id: str, tenant: str | None = None) -> JobRecord:
    row = db.execute(GET_JOB, (job_id,)).fetchone()
    if row is None or (tenant is not None and row[1] != tenant):
        raise JobNotFound(f"job_id: no job {job_id!r}")
    return _job(row)


def find_job(db: sqlite3.Connection, tenant: str, idempotency_key: str) -> JobRecord | None:
    row = db.execute(FIND_JOB, (tenant, idempotency_key)).fetchone()
    return None if row is None else get_job(db, row[0])


def sweep_intakes(db: sqlite3.Connection) -> None:
    """Delete the requests of intakes that never committed (a killed or refused acceptance)."""
    for (job_id,) in db.execute(INTAKES).fetchall():
        with _Transaction(db):
            for statement in DROP_INTAKE:
                db.execute(statement, (job_id,))


class _Transaction:
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
