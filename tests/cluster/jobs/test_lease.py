"""Job leases between frontends sharing one job store, on an injected clock: who runs a job,
when a silent frontend's jobs are taken over and by exactly one other, what a frontend that
stalled past its lease loses, and what a clean stop gives back."""
import sqlite3

import pytest

from cluster.jobs.lease import FrontendInfo, FrontendLease, Frontends, frontends
from cluster.jobs.records import JobState
from cluster.jobs.store import JobStore, StagedRequest, StoredResult
from workers.messages import Priority

TTL = 1_000


class Clock:
    def __init__(self, now: int = 10_000):
        self.now = now

    def __call__(self) -> int:
        return self.now


def requests(n):
    return [StagedRequest(i, f"c{i}", b"", f"body-{i}".encode()) for i in range(n)]


def ok(index):
    return StoredResult(index=index, custom_id=f"c{index}", request_id=f"r{index}", ok=True)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def path(tmp_path):
    return tmp_path / "jobs.sqlite3"


def frontend(path, clock, name):
    """A frontend's store (its intakes owned by ``name``) and its lease."""
    return JobStore(path, clock, owner=name), FrontendLease(path, name, clock, TTL,
                                                            address=f"{name}:1")


def owner(path, job_id):
    with sqlite3.connect(path) as db:
        return db.execute("SELECT owner FROM jobs WHERE job_id = ?", (job_id,)).fetchone()[0]


def test_a_job_is_its_accepting_frontends_and_another_does_not_take_it_while_the_lease_runs(
        path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    store_b, lease_b = frontend(path, clock, "fe-b")
    assert lease_a.tick().taken == ()
    job = store_a.create_job("acme", "tiny", requests(3))
    assert owner(path, job.job_id) == "fe-a"
    clock.now += TTL - 1              # A's lease runs until 11_000: still held at 10_999
    tick = lease_b.tick()
    assert (tick.taken, tick.lost) == ((), ())
    assert lease_b.live() == [FrontendInfo("fe-a", 11_000, "fe-a:1", 1),
                              FrontendInfo("fe-b", 11_999, "fe-b:1", 0)]
    assert frontends(path, clock.now) == Frontends(tuple(lease_b.live()), 0)
    assert frontends(path, 11_000) == Frontends((FrontendInfo("fe-b", 11_999, "fe-b:1", 0),), 1)
    assert lease_a.tick([job.job_id]).lost == ()   # A renews: to 11_999 + 1


def test_a_silent_frontends_jobs_are_taken_once_it_expires_oldest_first_by_one_frontend(
        path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    _, lease_b = frontend(path, clock, "fe-b")
    _, lease_c = frontend(path, clock, "fe-c")
    lease_a.tick()
    first = store_a.create_job("acme", "tiny", requests(2))
    clock.now += 1
    second = store_a.create_job("acme", "tiny", requests(1))
    store_a.record_result(first.job_id, ok(0))
    clock.now = 11_001                # past A's expiry (11_000); A never ticked again
    taken = lease_b.tick().taken
    assert [(j.job_id, j.state, j.completed) for j in taken] == [
        (first.job_id, JobState.QUEUED, 1), (second.job_id, JobState.QUEUED, 0)]
    assert lease_c.tick().taken == ()  # B holds them now: C takes nothing
    assert owner(path, first.job_id) == owner(path, second.job_id) == "fe-b"


def test_a_taken_over_job_keeps_its_priority(path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    _, lease_b = frontend(path, clock, "fe-b")
    lease_a.tick()
    interactive = store_a.create_job("acme", "tiny", requests(1), Priority.INTERACTIVE)
    batch = store_a.create_job("acme", "tiny", requests(1))
    clock.now = 11_001                # A is gone: B takes both, each as it was submitted
    assert [(j.job_id, j.priority) for j in lease_b.tick().taken] == [
        (interactive.job_id, Priority.INTERACTIVE), (batch.job_id, Priority.BATCH)]


def test_at_the_instant_of_expiry_the_lease_is_gone(path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    _, lease_b = frontend(path, clock, "fe-b")
    lease_a.tick()
    job = store_a.create_job("acme", "tiny", requests(1))
    clock.now = 11_000                # expires_ms > now is alive: 11_000 is not
    assert [j.job_id for j in lease_b.tick().taken] == [job.job_id]


def test_a_frontend_that_stalled_past_its_lease_loses_its_jobs_and_finished_ones(path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    store_b, lease_b = frontend(path, clock, "fe-b")
    lease_a.tick()
    stolen = store_a.create_job("acme", "tiny", requests(2))
    cancelled = store_a.create_job("acme", "tiny", requests(2))
    kept = store_a.create_job("acme", "tiny", requests(2))
    lease_b.tick()
    clock.now += TTL - 1
    assert lease_a.tick([stolen.job_id, cancelled.job_id, kept.job_id]).lost == ()
    clock.now += TTL              # A stalls a whole lease: B takes all three
    assert len(lease_b.tick().taken) == 3
    store_b.cancel(cancelled.job_id)
    tick = lease_a.tick([stolen.job_id, cancelled.job_id])
    assert tick.lost == tuple(sorted([stolen.job_id, cancelled.job_id]))
    assert tick.taken == ()       # B's lease runs: A takes nothing back


def test_a_cancelled_job_through_another_frontend_is_lost_by_its_owner(path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    store_b, _ = frontend(path, clock, "fe-b")
    lease_a.tick()
    job = store_a.create_job("acme", "tiny", requests(2))
    store_b.cancel(job.job_id)
    assert lease_a.tick([job.job_id]).lost == (job.job_id,)


def test_a_released_lease_gives_its_jobs_to_the_next_tick_at_once(path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    _, lease_b = frontend(path, clock, "fe-b")
    lease_a.tick()
    job = store_a.create_job("acme", "tiny", requests(1))
    done = store_a.create_job("acme", "tiny", requests(1))
    store_a.record_result(done.job_id, ok(0))
    lease_a.release()
    assert (owner(path, job.job_id), owner(path, done.job_id)) == ("", "fe-a")
    assert [j.job_id for j in lease_b.tick().taken] == [job.job_id]  # no wait for the ttl
    assert [f.frontend_id for f in lease_b.live()] == ["fe-b"]


def test_nobodys_jobs_are_taken_and_a_restart_takes_its_old_self_once_expired(path, clock):
    legacy = JobStore(path, clock)            # a store written before leases: owner ''
    old = legacy.create_job("acme", "tiny", requests(1))
    _, first = frontend(path, clock, "fe-1")
    assert [j.job_id for j in first.tick().taken] == [old.job_id]
    clock.now += 5                            # killed; restarted as fe-2 before expiry
    _, second = frontend(path, clock, "fe-2")
    assert second.tick().taken == ()
    clock.now += TTL
    assert [j.job_id for j in second.tick().taken] == [old.job_id]


def test_an_expired_frontend_is_forgotten_once_it_owns_nothing_unfinished(path, clock):
    store_a, lease_a = frontend(path, clock, "fe-a")
    _, lease_b = frontend(path, clock, "fe-b")
    lease_a.tick()
    job = store_a.create_job("acme", "tiny", requests(1))
    store_a.record_result(job.job_id, ok(0))   # finished: A owns nothing unfinished
    clock.now += TTL
    lease_b.tick()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT frontend_id FROM frontends").fetchall() == [("fe-b",)]


def test_a_lease_refuses_an_empty_id_or_ttl(path, clock):
    JobStore(path, clock).close()
    with pytest.raises(ValueError, match="frontend_id: a lease needs a non-empty frontend id"):
        FrontendLease(path, "", clock)
    with pytest.raises(ValueError, match="ttl_ms: must be >= 1, got 0"):
        FrontendLease(path, "fe-a", clock, 0)


def test_a_version_2_store_gains_owners_and_keeps_its_jobs(path, clock):
    store = JobStore(path, clock)
    job = store.create_job("acme", "tiny", requests(1))
    store.close()
    with sqlite3.connect(path) as db:   # back to version 2: no owner column, no frontends
        db.execute("DROP INDEX jobs_by_owner")
        db.execute("ALTER TABLE jobs DROP COLUMN owner")
        db.execute("DROP TABLE frontends")
        db.execute("PRAGMA user_version = 2")
    store, lease = frontend(path, clock, "fe-a")
    assert [j.job_id for j in lease.tick().taken] == [job.job_id]
    assert store.get_job(job.job_id).total == 1


def test_a_version_3_store_gains_priorities_and_its_jobs_stay_batch(path, clock):
    store = JobStore(path, clock)
    job = store.create_job("acme", "tiny", requests(2))
    store.close()
    with sqlite3.connect(path) as db:   # back to version 3: jobs had no priority
        db.execute("ALTER TABLE jobs DROP COLUMN priority")
        db.execute("PRAGMA user_version = 3")
    store = JobStore(path, clock)
    assert store.get_job(job.job_id).priority is Priority.BATCH
    later = store.create_job("acme", "tiny", requests(1), Priority.INTERACTIVE)
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
        assert db.execute("SELECT job_id, priority FROM jobs ORDER BY rowid").fetchall() == [
            (job.job_id, "batch"), (later.job_id, "interactive")]
