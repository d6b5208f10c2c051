"""Leases: which frontend runs which job, when several frontends share one job store.

Several frontends (each its own gRPC and HTTP ports, each its own router) serve one run
directory and one job store (SQLite in WAL mode: any number of processes on one machine read
at once and take turns to write, each write one short transaction). Any of them accepts jobs;
each job runs in exactly one of them, and a frontend that dies has its jobs run by another::

    frontend A  register ─ tick ─ tick ─ tick ─ ✗ kill -9
                (expires = now + ttl at each tick, every ttl / 3)
    frontend B  register ─ tick ─ tick ─ ... ─ tick: A's lease expired ─► takes A's unfinished
                                                    jobs, runs their requests without a result

The rules, each one SQL statement on the store's file (SQLite serializes writers, so two
frontends never both take a job):

- **A lease** is a ``frontends`` row, ``expires_ms`` pushed to now + ``ttl_ms`` at every tick.
  The frontend ticks every ``ttl_ms / 3``: two ticks can be late before anyone takes over.
- **A job's owner** (``jobs.owner``) is the frontend that runs it: the one that accepted it
  (its intake writes the owner), or the one that took it over. ``''`` is nobody's (a store
  written before leases, or a frontend that stopped cleanly and gave its jobs back).
- **Taking** a job: it is unfinished, and its owner is ``''`` or holds no lease that is still
  running (expired, or released). Oldest job first.
- **Losing** a job: a job this frontend runs that is now another's (it stalled past its lease
  and was taken over) or finished (cancelled through another frontend). The runner stops it.
  A request run twice that way (on the stalled frontend and on its new owner) is stored once
  (``UNIQUE(job_id, idx)``, ``cluster.jobs.store``).
- A stopping frontend **releases**: its row goes and its unfinished jobs become nobody's, so
  another frontend (or its own next start) takes them at its next tick instead of after the
  ttl. Rows of expired frontends that own nothing unfinished are deleted.

Every frontend reads the same clock (one machine: SQLite's WAL needs the store's file on a
local disk, never a network file system), injected here in milliseconds; nothing here sleeps.
The keeper's loop that ticks is ``cluster.jobs.takeover``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

from cluster.jobs.records import JobState
from cluster.jobs.store import JobRecord, connect, get_job

DEFAULT_TTL_MS = 10_000    # a killed frontend's jobs resume elsewhere 10 to 13 s later

UNFINISHED = (JobState.QUEUED.value, JobState.RUNNING.value)
# pragma: no mutate start
RENEW = ("INSERT INTO frontends VALUES (?, ?, ?) ON CONFLICT (frontend_id) "
         "DO UPDATE SET expires_ms = excluded.expires_ms, address = excluded.address")
# an owner that holds no live lease: '' (nobody), released, or expired
ORPHANED = ("owner != ? AND state IN (?, ?) AND NOT EXISTS (SELECT 1 FROM frontends f "
            "WHERE f.frontend_id = jobs.owner AND f.expires_ms > ?)")
ORPHANS = f"SELECT job_id FROM jobs WHERE {ORPHANED} ORDER BY created_ms, rowid"
TAKE = f"UPDATE jobs SET owner = ? WHERE job_id = ? AND {ORPHANED}"
OWNED = "SELECT job_id FROM jobs WHERE owner = ? AND state IN (?, ?)"
LIVE = ("SELECT f.frontend_id, f.expires_ms, f.address, (SELECT COUNT(*) FROM jobs WHERE "
        "jobs.owner = f.frontend_id AND jobs.state IN (?, ?)) FROM frontends f "
        "WHERE f.expires_ms > ? ORDER BY f.frontend_id")
NOBODYS = ("SELECT COUNT(*) FROM jobs WHERE state IN (?, ?) AND NOT EXISTS (SELECT 1 FROM "
           "frontends f WHERE f.frontend_id = jobs.owner AND f.expires_ms > ?)")
FORGET_EXPIRED = ("DELETE FROM frontends WHERE expires_ms <= ? AND NOT EXISTS (SELECT 1 FROM "
                  "jobs WHERE jobs.owner = frontends.frontend_id AND jobs.state IN (?, ?))")
RELEASE_JOBS = "UPDATE jobs SET owner = '' WHERE owner = ? AND state IN (?, ?)"
RELEASE = "DELETE FROM frontends WHERE frontend_id = ?"
# pragma: no mutate end


@dataclass(frozen=True, slots=True)
class LeaseTick:
    """What one tick changed for this frontend."""
    taken: tuple[JobRecord, ...]   # unfinished jobs it runs from now on, oldest first
    lost: tuple[str, ...]          # jobs it was running that it must stop


@dataclass(frozen=True, slots=True)
class FrontendInfo:
    frontend_id: str
    expires_ms: int
    address: str
    jobs: int          # unfinished jobs it runs


@dataclass(frozen=True, slots=True)
class Frontends:
    """What the job store says of its frontends, now."""
    live: tuple[FrontendInfo, ...]   # leases that run, by id
    orphaned_jobs: int               # unfinished jobs no live lease holds (taken next tick)


def frontends(path: Path | str, now_ms: int) -> Frontends:
    """The live frontends of the store at ``path`` and the unfinished jobs none of them holds
    (``orchard frontends``: read straight from the store, no frontend asked)."""
    db = connect(str(path))
    try:
        live = tuple(FrontendInfo(*row) for row in db.execute(LIVE, (*UNFINISHED, now_ms)))
        orphaned = db.execute(NOBODYS, (*UNFINISHED, now_ms)).fetchone()[0]
    finally:
        db.close()
    return Frontends(live, orphaned)


class FrontendLease:
    """One frontend's lease on a job store (its own connection; used from one thread)."""

    def __init__(self, path: Path | str, frontend_id: str, clock_ms: Callable[[], int],
                 ttl_ms: int = DEFAULT_TTL_MS, address: str = ""):
        if not frontend_id:
            raise ValueError("frontend_id: a lease needs a non-empty frontend id")
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms: must be >= 1, got {ttl_ms}")
        self.frontend_id = frontend_id
        self.ttl_ms = ttl_ms
        self.address = address
        self._clock_ms = clock_ms
        self._db = connect(str(path))  # the store opened the file first: the schema is there

    def tick(self, running: Collection[str] = ()) -> LeaseTick:
        """Renew this lease, say which of the ``running`` jobs are no longer this frontend's,
        and take every job whose owner holds no live lease."""
        now = self._clock_ms()
        self._db.execute(RENEW, (self.frontend_id, now + self.ttl_ms, self.address))
        mine = {row[0] for row in self._db.execute(OWNED, (self.frontend_id, *UNFINISHED))}
        lost = tuple(sorted(job_id for job_id in running if job_id not in mine))
        taken = []
        for (job_id,) in self._db.execute(ORPHANS, (self.frontend_id, *UNFINISHED, now)
                                          ).fetchall():
            if self._db.execute(TAKE, (self.frontend_id, job_id, self.frontend_id,
                                       *UNFINISHED, now)).rowcount == 1:
                taken.append(get_job(self._db, job_id))
        self._db.execute(FORGET_EXPIRED, (now, *UNFINISHED))
        return LeaseTick(tuple(taken), lost)

    def live(self) -> list[FrontendInfo]:
        """The frontends whose lease runs now, by id."""
        return [FrontendInfo(*row) for row in self._db.execute(
            LIVE, (*UNFINISHED, self._clock_ms()))]

    def release(self) -> None:
        """Give this frontend's unfinished jobs back (nobody's) and end its lease."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(RELEASE_JOBS, (self.frontend_id, *UNFINISHED))
            self._db.execute(RELEASE, (self.frontend_id,))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()
