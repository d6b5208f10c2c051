"""A job being accepted into the job store: its requests stored in pieces, then the job at once.

``JobIntake`` (made by ``cluster.jobs.store.JobStore.intake``) writes on a connection of its
own, off the event loop, under an ``intakes`` row; the job itself (its ``jobs`` row, with its
priority, and the idempotency key) appears only in the last, fsynced (``synchronous=FULL``)
transaction. A job is therefore whole or absent: a refused, failed or killed intake leaves
only rows no query reads, deleted at once (``abort``) or when the store is next opened
(``sweep_intakes``).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from typing import Callable, Sequence

from cluster.jobs.records import JobRecord, JobState, StagedRequest, StoreFull
from cluster.jobs.store_db import (CHECKPOINT, SYNC_FULL, SYNC_NORMAL, Transaction, connect,
                                   find_job, get_job)
from workers.messages import Priority

DISK_RESERVE_BYTES = 4 << 20      # an intake stops while this much is free (room to undo it)
# An intake of at least this much folds the log back into the database as it commits (a 44 MB
# file's pages would otherwise sit in the log until the next automatic checkpoint); a smaller
# one leaves that to the automatic checkpoint, which folds the log every 4 MB: a one-request
# job's commit took 4.5 ms with the fold and 2.2 ms without, on the path of every job.
FOLD_AFTER_BYTES = 1 << 20

# pragma: no mutate start
INSERT_INTAKE = "INSERT INTO intakes VALUES (?, ?)"
INSERT_REQUESTS = "INSERT INTO job_requests VALUES (?, ?, ?, ?, ?)"
INSERT_JOB = ("INSERT INTO jobs (job_id, tenant, state, total, model, created_ms, owner, "
              "priority) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
INSERT_KEY = "INSERT INTO job_keys VALUES (?, ?, ?)"
END_INTAKE = "DELETE FROM intakes WHERE job_id = ?"
DROP_INTAKE = ("DELETE FROM job_requests WHERE job_id = ?", END_INTAKE)
INTAKES = "SELECT job_id FROM intakes"
# pragma: no mutate end


class JobIntake:
    """One job being accepted, on a connection of its own (used from one thread at a time).

    ``add`` stores a piece of the job's requests in one transaction; ``commit`` makes the job
    exist (queued, with its ``priority``) in one fsynced transaction; ``abort`` (or a failed
    ``add``) deletes what was stored. Until ``commit`` nothing else in the store sees the job.
    """

    def __init__(self, path: str, clock_ms: Callable[[], int], tenant: str, model: str,
                 owner: str = "", priority: Priority = Priority.BATCH):
        self._clock_ms = clock_ms
        self._owner = owner
        self._tenant = tenant
        self._model = model
        self._priority = priority
        self._path = path
        self._db = connect(path)
        self.job_id = f"job-{secrets.token_hex(8)}"
        self.count = 0
        self.bytes = 0   # of the requests stored so far (their bodies, prefixes and ids)
        self.committed = False
        with disk_full_refuses():
            self._db.execute(INSERT_INTAKE, (self.job_id, clock_ms()))

    def add(self, requests: Sequence[StagedRequest]) -> None:
        rows = [(self.job_id, r.index, r.prefix, r.custom_id, r.body) for r in requests]
        # Refuse while there is still room to delete what was stored: in WAL mode even a
        # DELETE needs log space, so an intake that ran the disk to the last byte could not
        # clean up after itself (the next start would).
        needed = 2 * sum(len(r.body) + len(r.prefix) + len(r.custom_id) for r in requests)
        if _free_bytes(self._path) < needed + DISK_RESERVE_BYTES:
            raise StoreFull(_FULL)
        with disk_full_refuses(), Transaction(self._db):
            self._db.executemany(INSERT_REQUESTS, rows)
        self.count += len(rows)
        self.bytes += needed // 2

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
            with disk_full_refuses(), Transaction(self._db):
                self._db.execute(INSERT_JOB, (self.job_id, self._tenant, JobState.QUEUED.value,
                                              self.count, self._model, self._clock_ms(),
                                              self._owner, self._priority.value))
                if idempotency_key:
                    self._db.execute(INSERT_KEY, (self._tenant, idempotency_key, self.job_id))
                self._db.execute(END_INTAKE, (self.job_id,))
            self.committed = True
        finally:
            self._db.execute(SYNC_NORMAL)
        if self.bytes >= FOLD_AFTER_BYTES:  # a big intake's pages went through the log:
            try:                              # fold them back now, off the loop
                self._db.execute(CHECKPOINT)
            except sqlite3.OperationalError:
                pass  # busy: the next automatic checkpoint does it
        return get_job(self._db, self.job_id), True

    def abort(self) -> None:
        """Delete what this intake stored (if the disk is too full even for that, the store
        deletes it when next opened: nothing reads an intake's rows meanwhile). After a commit
        the rows are the job's: nothing is deleted."""
        if self.committed:
            return
        try:
            with Transaction(self._db):
                for statement in DROP_INTAKE:
                    self._db.execute(statement, (self.job_id,))
        except sqlite3.OperationalError:
            pass

    def close(self) -> None:
        self._db.close()


def sweep_intakes(db: sqlite3.Connection) -> None:
    """Delete the requests of intakes that never committed (a killed or refused acceptance)."""
    for (job_id,) in db.execute(INTAKES).fetchall():
        with Transaction(db):
            for statement in DROP_INTAKE:
                db.execute(statement, (job_id,))


@contextlib.contextmanager
def disk_full_refuses():
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
