"""The durable job store: jobs, their requests and their results in SQLite (WAL).

It owns every job's state; the frontend's job runner asks it what is left to run and hands it
each result. Three tables::

    jobs      job_id ─┬─ tenant, state, total, model, created/finished times
    requests  (job_id, idx) ─ custom_id (unique per job), prompt token ids, sampling params
    results   (job_id, seq) ─ idx (unique per job), the result as JSON
    job_keys  (tenant, idempotency_key) ─ job_id: a retried submission finds its first job

Exactly once: a result is inserted with ``UNIQUE(job_id, idx)``, so a request that runs again
after a crash (its result was not committed yet) yields one stored result, never two; its
``seq`` (the position in the job's result stream, used to resume a stream) is assigned in the
same transaction. A job is accepted only once its requests are committed with
``synchronous=FULL`` (they survive power loss); results commit with ``synchronous=NORMAL`` in
WAL mode, which survives a killed process — a result lost to a power cut is simply run again.

The store is used from one thread (the frontend's event loop); every call is one short
transaction. The clock is injected (milliseconds since the epoch).
"""
from __future__ import annotations

import json
import secrets
import sqlite3
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Sequence

from workers.messages import SamplingParams

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL,
    model TEXT NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created_ms);
CREATE TABLE IF NOT EXISTS requests (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
    prompt TEXT NOT NULL, sampling TEXT NOT NULL,
    PRIMARY KEY (job_id, idx), UNIQUE (job_id, custom_id));
CREATE TABLE IF NOT EXISTS job_keys (
    tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL, job_id TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key));
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (job_id, seq), UNIQUE (job_id, idx));
"""


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"   # every request has a result (ok or an error)
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.CANCELLED)


class JobNotFound(LookupError):
    """No job with that id (for that tenant)."""


class JobFinished(RuntimeError):
    """The job already finished; the operation needs a running or queued job."""


@dataclass(frozen=True, slots=True)
class NewRequest:
    custom_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class PendingRequest:
    job_id: str
    index: int
    custom_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams

    @property
    def request_id(self) -> str:
        """Stable across restarts, so a rerun after a crash is the same request."""
        return f"{self.job_id}-{self.index}"


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    tenant: str
    state: JobState
    total: int
    completed: int     # results with ok
    failed: int        # results with an error
    model: str
    created_ms: int
    finished_ms: int

    @property
    def cancelled(self) -> int:
        return self.total - self.completed - self.failed if self.state is JobState.CANCELLED else 0


@dataclass(frozen=True, slots=True)
class StoredResult:
    index: int
    custom_id: str
    request_id: str
    ok: bool
    error_code: str = ""
    error_message: str = ""
    text: str = ""
    output_tokens: tuple[int, ...] = ()
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    written_tokens: int = 0
    worker_id: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    attempts: int = 0
    worker_s: float = 0.0  # the worker's own time on the request (received -> finished)
    seq: int | None = None  # position in the job's result stream, assigned when recorded
    # Effective input multiplier forecast at routing time and measured (router.cost), and
    # the miss cause (router.attribution); None / "" when not traced or a hit.
    forecast_multiplier: float | None = None
    measured_multiplier: float | None = None
    miss_cause: str = ""

    def to_json(self) -> str:
        body = asdict(self)
        del body["seq"]
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, seq: int, body: str) -> StoredResult:
        data = json.loads(body)
        data["output_tokens"] = tuple(data["output_tokens"])
        return cls(seq=seq, **data)


class JobStore:
    def __init__(self, path: Path | str, clock_ms: Callable[[], int]):
        self._clock_ms = clock_ms
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------------ jobs

    def create_job(self, tenant: str, model: str, requests: Sequence[NewRequest]) -> JobRecord:
        """Persist a job and all its requests in one fsynced transaction."""
        job, _ = self.submit(tenant, model, requests)
        return job

    def submit(self, tenant: str, model: str, requests: Sequence[NewRequest],
               idempotency_key: str = "") -> tuple[JobRecord, bool]:
        """Persist a job unless ``idempotency_key`` already names one of ``tenant``'s jobs.

        Returns the job and whether it was created now: a client that retries a submission
        whose answer it lost gets the first job back, and nothing runs twice.
        """
        if idempotency_key:
            existing = self.find_job(tenant, idempotency_key)
            if existing is not None:
                return existing, False
        if not requests:
            raise ValueError("requests: a job needs at least one request")
        job_id = f"job-{secrets.token_hex(8)}"
        now = self._clock_ms()
        rows = [(job_id, i, r.custom_id, json.dumps(r.prompt), json.dumps(asdict(r.sampling)))
                for i, r in enumerate(requests)]
        self._db.execute("PRAGMA synchronous=FULL")
        try:
            with self._transaction():
                self._db.execute("INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, 0)",
                                 (job_id, tenant, JobState.QUEUED.value, len(rows), model, now))
                self._db.executemany("INSERT INTO requests VALUES (?, ?, ?, ?, ?)", rows)
                if idempotency_key:
                    self._db.execute("INSERT INTO job_keys VALUES (?, ?, ?)",
                                     (tenant, idempotency_key, job_id))
        finally:
            self._db.execute("PRAGMA synchronous=NORMAL")
        return self.get_job(job_id), True

    def find_job(self, tenant: str, idempotency_key: str) -> JobRecord | None:
        row = self._db.execute(
            "SELECT job_id FROM job_keys WHERE tenant = ? AND idempotency_key = ?",
            (tenant, idempotency_key)).fetchone()
        return None if row is None else self.get_job(row[0])

    def get_job(self, job_id: str, tenant: str | None = None) -> JobRecord:
        row = self._db.execute(
            "SELECT job_id, tenant, state, total, model, created_ms, finished_ms FROM jobs "
            "WHERE job_id = ?", (job_id,)).fetchone()
        if row is None or (tenant is not None and row[1] != tenant):
            raise JobNotFound(f"job_id: no job {job_id!r}")
        ok, failed = self._db.execute(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM results WHERE job_id = ?",
            (job_id,)).fetchone()
        return JobRecord(job_id=row[0], tenant=row[1], state=JobState(row[2]), total=row[3],
                         completed=ok, failed=failed, model=row[4], created_ms=row[5],
                         finished_ms=row[6])

    def list_jobs(self, tenant: str, limit: int = 50, states: Sequence[JobState] = (),
                  since_ms: int = 0, after: str = "") -> list[JobRecord]:
        """``tenant``'s jobs, newest first: in ``states`` (any if empty), created at or after
        ``since_ms``, and older than the job ``after`` (a page's last job; JobNotFound if
        it is not the tenant's)."""
        where, args = ["tenant = ?", "created_ms >= ?"], [tenant, since_ms]
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            args += [state.value for state in states]
        if after:
            self.get_job(after, tenant)
            where.append("(created_ms, rowid) < (SELECT created_ms, rowid FROM jobs "
                         "WHERE job_id = ?)")
            args.append(after)
        ids = self._db.execute(
            f"SELECT job_id FROM jobs WHERE {' AND '.join(where)} "
            "ORDER BY created_ms DESC, rowid DESC LIMIT ?", (*args, limit)).fetchall()
        return [self.get_job(job_id) for (job_id,) in ids]

    def unfinished_jobs(self) -> list[JobRecord]:
        """Queued and running jobs, oldest first: what a restarted frontend resumes."""
        ids = self._db.execute(
            "SELECT job_id FROM jobs WHERE state IN (?, ?) ORDER BY created_ms, rowid",
            (JobState.QUEUED.value, JobState.RUNNING.value)).fetchall()
        return [self.get_job(job_id) for (job_id,) in ids]

    def mark_running(self, job_id: str) -> None:
        self._db.execute("UPDATE jobs SET state = ? WHERE job_id = ? AND state = ?",
                         (JobState.RUNNING.value, job_id, JobState.QUEUED.value))

    def cancel(self, job_id: str, tenant: str | None = None) -> JobRecord:
        job = self.get_job(job_id, tenant)
        if job.state.finished:
            raise JobFinished(f"job_id: job {job_id} is already {job.state.value}; "
                              "only queued or running jobs can be cancelled")
        self._db.execute("UPDATE jobs SET state = ?, finished_ms = ? WHERE job_id = ?",
                         (JobState.CANCELLED.value, self._clock_ms(), job_id))
        return self.get_job(job_id)

    # -------------------------------------------------------------- requests

    def pending_requests(self, job_id: str) -> list[PendingRequest]:
        """Requests of ``job_id`` that have no result yet, in submission order."""
        rows = self._db.execute(
            "SELECT r.idx, r.custom_id, r.prompt, r.sampling FROM requests r "
            "LEFT JOIN results s ON s.job_id = r.job_id AND s.idx = r.idx "
            "WHERE r.job_id = ? AND s.idx IS NULL ORDER BY r.idx", (job_id,)).fetchall()
        return [PendingRequest(job_id, idx, custom_id, tuple(json.loads(prompt)),
                               _sampling(json.loads(sampling)))
                for idx, custom_id, prompt, sampling in rows]

    def pending_by_tenant(self) -> dict[str, int]:
        """Requests accepted but without a result, per tenant, over unfinished jobs."""
        rows = self._db.execute(
            "SELECT j.tenant, j.total - (SELECT COUNT(*) FROM results s WHERE s.job_id = j.job_id)"
            " FROM jobs j WHERE j.state IN (?, ?)",
            (JobState.QUEUED.value, JobState.RUNNING.value)).fetchall()
        counts: dict[str, int] = {}
        for tenant, pending in rows:
            counts[tenant] = counts.get(tenant, 0) + pending
        return counts

    # --------------------------------------------------------------- results

    def record_result(self, job_id: str, result: StoredResult) -> StoredResult | None:
        """Store ``result`` once; ``None`` if that request already has one (a rerun).

        The job turns ``succeeded`` in the same transaction when this was its last result.
        """
        with self._transaction():
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO results (job_id, seq, idx, ok, body) "
                "SELECT ?, COALESCE(MAX(seq), -1) + 1, ?, ?, ? FROM results WHERE job_id = ?",
                (job_id, result.index, int(result.ok), result.to_json(), job_id))
            if cursor.rowcount == 0:
                return None
            seq = self._db.execute("SELECT seq FROM results WHERE job_id = ? AND idx = ?",
                                   (job_id, result.index)).fetchone()[0]
            self._db.execute(
                "UPDATE jobs SET state = ?, finished_ms = ? WHERE job_id = ? AND state IN (?, ?) "
                "AND total = (SELECT COUNT(*) FROM results WHERE job_id = ?)",
                (JobState.SUCCEEDED.value, self._clock_ms(), job_id, JobState.QUEUED.value,
                 JobState.RUNNING.value, job_id))
        return StoredResult.from_json(seq, result.to_json())

    def results(self, job_id: str, offset: int = 0, limit: int = 1000) -> list[StoredResult]:
        """Results of ``job_id`` with ``seq >= offset``, in ``seq`` order."""
        rows = self._db.execute(
            "SELECT seq, body FROM results WHERE job_id = ? AND seq >= ? ORDER BY seq LIMIT ?",
            (job_id, offset, limit)).fetchall()
        return [StoredResult.from_json(seq, body) for seq, body in rows]

    def _transaction(self):
        return _Transaction(self._db)


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on an exception)."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _sampling(data: dict) -> SamplingParams:
    data["stop"] = tuple(data.get("stop", ()))
    return SamplingParams(**data)
