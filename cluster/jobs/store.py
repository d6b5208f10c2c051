"""The durable job store: jobs, their requests and their results in SQLite (WAL).

It owns every job's state; the frontend's job runner asks it for the next requests to run, in
dispatch order, a page at a time, and hands it each result. The tables are in
``cluster.jobs.schema``; a request is stored once, as the client sent it (``body``, opaque
here), and templated and tokenized only when it is dispatched.

Acceptance (``JobIntake``, ``cluster.jobs.store_intake``): a job's requests are written in
pieces off the event loop, and the job (with its priority: the lane its requests take) appears
only in the last, fsynced transaction, so it is whole or absent.

Exactly once: a result is inserted with ``UNIQUE(job_id, idx)``, so a request that runs again
after a crash (its result was not committed yet) yields one stored result, never two; its
``seq`` (the position in the job's result stream, used to resume a stream) is the job's count
of results, kept on its ``jobs`` row and bumped in the same transaction, so recording a result
costs the same for the first request of a job as for its 50,000th. Results commit with
``synchronous=NORMAL`` in WAL mode, which survives a killed process; a result lost to a power
cut is simply run again.

The write-ahead log is checkpointed automatically every ``AUTOCHECKPOINT_PAGES`` and cut back
to ``WAL_LIMIT_BYTES`` after each checkpoint, so a 44 MB intake does not leave a 44 MB log
(an intake of ``FOLD_AFTER_BYTES`` or more folds it back as it commits; a small job's does not);
``prune`` deletes finished jobs with their requests and results. The store is used from one
thread (the frontend's event loop), an intake from one worker thread at a time; every call is
one short transaction. The clock is injected (milliseconds since the epoch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from cluster.jobs.records import (JobFinished, JobNotFound, JobRecord, JobState, NewRequest,
                                  PendingRequest, StagedRequest, StoredRequest, StoredResult,
                                  StoreFull)
from cluster.jobs.schema import open_schema
from cluster.jobs.store_db import (AUTOCHECKPOINT_PAGES, CHECKPOINT, JOB_COLUMNS,
                                   WAL_LIMIT_BYTES, Transaction, connect, find_job, get_job,
                                   job_of)
from cluster.jobs.store_intake import DISK_RESERVE_BYTES, JobIntake, sweep_intakes
from workers.messages import Priority

__all__ = ["AUTOCHECKPOINT_PAGES", "DISK_RESERVE_BYTES", "JobFinished", "JobNotFound",
           "JobRecord", "JobState", "JobStore", "JobIntake", "NewRequest", "PendingRequest",
           "StagedRequest", "StoredRequest", "StoredResult", "StoreFull", "WAL_LIMIT_BYTES",
           "connect", "get_job"]

PAGE_ROWS = 256                   # requests read per page by the runner

# The statements. Out of mutation testing's reach: SQLite reads keywords, table and column
# names and pragma values without regard to letter case and none of these holds a quoted
# literal, so a mutant that only changes their case (88 of the module's did) cannot change
# what the store does. What they do is tested through the store all the same.
# pragma: no mutate start
VACUUM = "PRAGMA incremental_vacuum"
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

    def intake(self, tenant: str, model: str, priority: Priority = Priority.BATCH
               ) -> JobIntake:
        """Start accepting a job: its requests go in pieces, the job appears on ``commit``.
        ``priority``: the lane the job's requests take (``cluster.jobs.slots``, the engine)."""
        return JobIntake(self._path, self._clock_ms, tenant, model, self._owner, priority)

    def create_job(self, tenant: str, model: str, requests: Sequence[StagedRequest],
                   priority: Priority = Priority.BATCH) -> JobRecord:
        """Persist a job and all its requests (a small job, in one go)."""
        job, _ = self.submit(tenant, model, requests, priority=priority)
        return job

    def submit(self, tenant: str, model: str, requests: Sequence[StagedRequest],
               idempotency_key: str = "", priority: Priority = Priority.BATCH
               ) -> tuple[JobRecord, bool]:
        """Persist a job unless ``idempotency_key`` already names one of ``tenant``'s jobs.

        Returns the job and whether it was created now: a client that retries a submission
        whose answer it lost gets the first job back (with its own priority), and nothing
        runs twice.
        """
        intake = self.intake(tenant, model, priority)
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
        jobs = [job_of(row) for row in rows]
        return jobs[::-1] if before else jobs

    def unfinished_jobs(self) -> list[JobRecord]:
        """Queued and running jobs, oldest first: what a restarted frontend resumes."""
        rows = self._db.execute(UNFINISHED_JOBS, (JobState.QUEUED.value,
                                                  JobState.RUNNING.value)).fetchall()
        return [job_of(row) for row in rows]

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
        return Transaction(self._db)
