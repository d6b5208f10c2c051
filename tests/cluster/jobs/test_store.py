"""The job store: jobs persist, results are recorded exactly once, state follows results.

The job store's listing and result stream with exact ids, states and sequence numbers.

The job store's defaults and limits, exactly: the page sizes, the listing's time filter, the
intake's disk-space check at its boundary, and a store used from a thread other than its own.

The job store's intake commit, prune and transactions, with exact rows, states and instants.
"""
import pytest
from tests.support.small_disk import small_disk
from cluster.jobs.store import (JobFinished, JobNotFound, JobState, JobStore, StagedRequest,
                                StoreFull, StoredResult)
from cluster.jobs.store import JobNotFound, JobState, StoredResult
import os
from concurrent.futures import ThreadPoolExecutor
from cluster.jobs.store import DISK_RESERVE_BYTES, JobStore, StagedRequest, StoreFull
import sqlite3
from cluster.jobs.records import JobRecord
from cluster.jobs.store import JobNotFound, JobState, JobStore
from workers.messages import Priority
from pathlib import Path
from cluster.jobs.store_intake import FOLD_AFTER_BYTES


class Clock:
    def __init__(self):
        self.now = 1_000

    def __call__(self) -> int:
        self.now += 1
        return self.now

def make_requests(n, prefixes=None):
    return [StagedRequest(i, f"c{i}", prefixes[i] if prefixes else b"", f"body-{i}".encode())
            for i in range(n)]

def ok_result(index):
    return StoredResult(index=index, custom_id=f"c{index}", request_id=f"r{index}", ok=True,
                        text="hi", output_tokens=(5, 6), prompt_tokens=3, cached_tokens=1)

@pytest.fixture
def store(tmp_path):
    s = JobStore(tmp_path / "jobs.sqlite3", Clock())
    yield s
    s.close()

V1_SCHEMA = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL,
    model TEXT NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL DEFAULT 0);
CREATE TABLE requests (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
    prompt TEXT NOT NULL, sampling TEXT NOT NULL,
    PRIMARY KEY (job_id, idx), UNIQUE (job_id, custom_id));
CREATE TABLE job_keys (
    tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL, job_id TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key));
CREATE TABLE results (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (job_id, seq), UNIQUE (job_id, idx));
INSERT INTO jobs VALUES ('job-old', 'acme', 'running', 2, 'm', 5, 0);
INSERT INTO requests VALUES ('job-old', 0, 'a', '[1, 2, 3]', '{"max_tokens": 4, "temperature": 0.5, "top_p": 1.0, "seed": 3, "stop": ["x"]}');
INSERT INTO requests VALUES ('job-old', 1, 'b', '[4, 5]', '{"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": []}');
"""


class TestJobstore:
    def test_create_and_reopen(self, tmp_path):
        path = tmp_path / "jobs.sqlite3"
        store = JobStore(path, Clock())
        job = store.create_job("acme", "m", make_requests(3))
        store.close()
        reopened = JobStore(path, Clock())
        assert reopened.get_job(job.job_id) == job
        pending = reopened.next_requests(job.job_id)
        assert [p.index for p in pending] == [0, 1, 2]
        assert (pending[2].custom_id, pending[2].body) == ("c2", b"body-2")
        assert [j.job_id for j in reopened.unfinished_jobs()] == [job.job_id]

    def test_result_recorded_exactly_once_and_job_finishes(self, store):
        job = store.create_job("acme", "m", make_requests(2))
        first = store.record_result(job.job_id, ok_result(1))
        assert first is not None and first.seq == 0
        assert store.record_result(job.job_id, ok_result(1)) is None  # a rerun: ignored
        assert store.get_job(job.job_id).state is JobState.QUEUED
        assert [p.index for p in store.next_requests(job.job_id)] == [0]
        failed = StoredResult(index=0, custom_id="c0", request_id="r0", ok=False,
                              error_code="DEADLINE_EXCEEDED", error_message="too slow")
        assert store.record_result(job.job_id, failed).seq == 1
        done = store.get_job(job.job_id)
        assert (done.state, done.completed, done.failed, done.finished_ms > 0) == (
            JobState.SUCCEEDED, 1, 1, True)
        assert [r.index for r in store.results(job.job_id)] == [1, 0]
        assert [r.index for r in store.results(job.job_id, offset=1)] == [0]
        assert store.results(job.job_id)[0].output_tokens == (5, 6)
        assert store.unfinished_jobs() == []

    def test_cancel_and_tenant_scoping(self, store):
        job = store.create_job("acme", "m", make_requests(3))
        store.record_result(job.job_id, ok_result(0))
        with pytest.raises(JobNotFound):
            store.cancel(job.job_id, tenant="other")
        cancelled = store.cancel(job.job_id, tenant="acme")
        assert (cancelled.state, cancelled.completed, cancelled.cancelled) == (JobState.CANCELLED, 1, 2)
        with pytest.raises(JobFinished, match="already cancelled"):
            store.cancel(job.job_id)
        assert store.pending_by_tenant() == {}

    def test_pending_by_tenant_and_listing(self, store):
        a = store.create_job("acme", "m", make_requests(3))
        store.create_job("beta", "m", make_requests(2))
        store.record_result(a.job_id, ok_result(0))
        assert store.pending_by_tenant() == {"acme": 2, "beta": 2}
        assert [j.job_id for j in store.list_jobs("acme")] == [a.job_id]
        with pytest.raises(JobNotFound, match="job_id"):
            store.get_job("job-missing")
        with pytest.raises(ValueError, match="at least one"):
            store.create_job("acme", "m", [])

    def test_dispatch_order_is_by_prefix_then_place_and_pages_resume(self, store):
        prefixes = [b"\x02", b"\x01", b"\x02", b"\x01\x05", b"\x01"]
        job = store.create_job("acme", "m", make_requests(5, prefixes))
        first = store.next_requests(job.job_id, limit=2)
        assert [p.index for p in first] == [1, 4]
        rest = store.next_requests(job.job_id, first[-1].position)
        assert [p.index for p in rest] == [3, 0, 2]
        store.record_result(job.job_id, ok_result(3))  # a request with a result is not read again
        assert [p.index for p in store.next_requests(job.job_id)] == [1, 4, 0, 2]

    def test_an_intake_is_invisible_until_committed_and_gone_when_aborted(self, tmp_path, store):
        intake = store.intake("acme", "m")
        intake.add(make_requests(3))
        assert store.list_jobs("acme") == [] and store.pending_by_tenant() == {}
        assert store.next_requests(intake.job_id) != []  # stored, but no job names it yet
        intake.abort()
        intake.close()
        assert store.next_requests(intake.job_id) == []
        left = store.intake("acme", "m")  # an intake left behind by a killed frontend ...
        left.add(make_requests(2))
        left.close()
        reopened = JobStore(store.path, Clock())  # ... is swept when the store is opened
        assert reopened.next_requests(left.job_id) == [] and reopened.list_jobs("acme") == []
        reopened.close()

    def test_only_a_big_intake_folds_the_log_back_as_it_commits(self, store):
        wal = Path(f"{store.path}-wal")
        small = store.intake("acme", "m")
        small.add(make_requests(3))
        small.commit()
        small.close()
        assert small.bytes == 3 * (len(b"body-0") + len("c0")) and wal.stat().st_size > 0
        big = store.intake("acme", "m")
        body = b"x" * FOLD_AFTER_BYTES
        big.add([StagedRequest(0, "c0", b"", body)])
        big.commit()
        big.close()
        assert big.bytes == FOLD_AFTER_BYTES + 2 and wal.stat().st_size == 0

    def test_a_full_disk_refuses_the_job_and_keeps_nothing(self, tmp_path):
        with small_disk(tmp_path / "disk", megabytes=12) as disk:
            store = JobStore(disk / "jobs.sqlite3", Clock())
            kept = store.create_job("acme", "m", make_requests(2))
            intake = store.intake("acme", "m")
            with pytest.raises(StoreFull, match="disk is full"):
                for start in range(0, 10_000, 500):  # 30 MB of requests for a 12 MB disk
                    intake.add([StagedRequest(i, f"c{i}", b"", bytes(3000))
                                for i in range(start, start + 500)])
            intake.abort()
            intake.close()
            assert [j.job_id for j in store.list_jobs("acme")] == [kept.job_id]
            assert store.next_requests(intake.job_id) == []
            assert len(store.next_requests(kept.job_id)) == 2
            store.close()

    def test_prune_removes_old_finished_jobs_with_their_rows(self, store):
        done = store.create_job("acme", "m", make_requests(2))
        for i in range(2):
            store.record_result(done.job_id, ok_result(i))
        running = store.create_job("acme", "m", make_requests(2))
        finished_ms = store.get_job(done.job_id).finished_ms
        assert store.prune(finished_ms) == 0  # not older than the cut-off
        assert store.prune(finished_ms + 1) == 1
        with pytest.raises(JobNotFound):
            store.get_job(done.job_id)
        assert store.results(done.job_id) == [] and store.next_requests(done.job_id) == []
        assert [j.job_id for j in store.list_jobs("acme")] == [running.job_id]

    def test_idempotency_key_returns_the_first_job(self, tmp_path):
        path = tmp_path / "jobs.sqlite3"
        store = JobStore(path, Clock())
        first, created = store.submit("acme", "m", make_requests(2), idempotency_key="k1")
        assert created
        again, created = store.submit("acme", "m", make_requests(3), idempotency_key="k1")
        assert (again, created) == (first, False)
        other, created = store.submit("beta", "m", make_requests(1), idempotency_key="k1")
        assert created and other.job_id != first.job_id  # keys are per tenant
        store.close()
        reopened = JobStore(path, Clock())  # survives a restart
        assert reopened.find_job("acme", "k1") == first
        assert reopened.find_job("acme", "k2") is None
        reopened.close()

    def test_a_store_written_by_version_1_is_upgraded_and_resumes(self, tmp_path):
        import sqlite3

        from cluster.api.intake import PROTO_BODY
        from proto.orchard.v1 import orchard_pb2 as pb

        path = tmp_path / "jobs.sqlite3"
        old = sqlite3.connect(path)
        old.executescript(V1_SCHEMA)
        old.execute("INSERT INTO results VALUES ('job-old', 0, 0, 1, ?)", (ok_result(0).to_json(),))
        old.commit()
        old.close()
        store = JobStore(path, Clock())
        job = store.get_job("job-old")
        assert (job.state, job.total, job.completed, job.failed) == (JobState.RUNNING, 2, 1, 0)
        pending = store.next_requests("job-old")
        assert [(p.index, p.custom_id) for p in pending] == [(1, "b")]
        assert pending[0].body[:1] == PROTO_BODY
        request = pb.Request.FromString(pending[0].body[1:])
        assert (list(request.tokens.ids), request.sampling.max_tokens) == ([4, 5], 2)
        assert store.record_result("job-old", ok_result(1)).seq == 1
        assert store.get_job("job-old").state is JobState.SUCCEEDED
        store.close()

    def test_orchard_jobs_prune_at_the_command_line(self, tmp_path, capsys):
        import time

        from cluster.cli import main
        from tests.support.frontend_harness import ACME_CONFIG

        (tmp_path / "orchard.toml").write_text(ACME_CONFIG)
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: time.time_ns() // 1_000_000)
        done = store.create_job("acme", "m", make_requests(1))
        store.record_result(done.job_id, ok_result(0))
        queued = store.create_job("acme", "m", make_requests(1))
        store.close()
        time.sleep(0.01)  # the job finished strictly before "now" of the prune
        assert main(["jobs", "prune", "--older-than", "1", "--run-dir", str(tmp_path)]) == 0
        assert "pruned 0 finished job(s) older than 1 days" in capsys.readouterr().out
        assert main(["jobs", "prune", "--older-than", "0", "--run-dir", str(tmp_path)]) == 0
        assert "pruned 1 finished job(s)" in capsys.readouterr().out
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
        assert [j.job_id for j in store.list_jobs("acme")] == [queued.job_id]
        store.close()
        assert main(["jobs", "prune", "--older-than", "-1", "--run-dir", str(tmp_path)]) == 2
        assert "--older-than must be >= 0" in capsys.readouterr().err


def _failed(index: int) -> StoredResult:
    return StoredResult(index=index, custom_id=f"c{index}", request_id=f"r{index}", ok=False,
                        error_code="INTERNAL", error_message="boom")


class TestJobstoreExact:
    def test_list_jobs_filters_by_state_time_and_page(self, store):
        first = store.create_job("acme", "m", make_requests(1))
        second = store.create_job("acme", "m", make_requests(2))
        third = store.create_job("acme", "m", make_requests(1))
        store.create_job("bravo", "m", make_requests(1))
        store.cancel(second.job_id)
        store.record_result(third.job_id, ok_result(0))            # third succeeds
        ids = lambda jobs: [j.job_id for j in jobs]                # noqa: E731
        assert ids(store.list_jobs("acme")) == [third.job_id, second.job_id, first.job_id]
        assert ids(store.list_jobs("acme", states=[JobState.QUEUED])) == [first.job_id]
        assert ids(store.list_jobs("acme", states=[JobState.CANCELLED, JobState.SUCCEEDED])) == [
            third.job_id, second.job_id]
        assert ids(store.list_jobs("acme", since_ms=1004)) == [third.job_id, second.job_id]
        assert ids(store.list_jobs("acme", after=third.job_id)) == [second.job_id, first.job_id]
        assert ids(store.list_jobs("acme", limit=1, after=second.job_id)) == [first.job_id]
        # before: the newer jobs next to the cursor, still newest first
        assert ids(store.list_jobs("acme", before=first.job_id)) == [third.job_id, second.job_id]
        assert ids(store.list_jobs("acme", limit=1, before=first.job_id)) == [second.job_id]
        assert ids(store.list_jobs("acme", before=third.job_id)) == []
        with pytest.raises(JobNotFound, match=f"no job '{third.job_id}'"):
            store.list_jobs("bravo", after=third.job_id)
        with pytest.raises(JobNotFound, match=f"no job '{third.job_id}'"):
            store.list_jobs("bravo", before=third.job_id)
        with pytest.raises(ValueError, match="give one cursor"):
            store.list_jobs("acme", after=first.job_id, before=third.job_id)

    def test_results_stream_in_order_with_exact_counts(self, store):
        job = store.create_job("acme", "m", make_requests(3))
        store.mark_running(job.job_id)
        assert store.get_job(job.job_id).state is JobState.RUNNING
        assert store.record_result(job.job_id, _failed(2)).seq == 0
        assert store.record_result(job.job_id, ok_result(0)).seq == 1
        assert store.record_result(job.job_id, ok_result(0)) is None  # a rerun: not stored
        assert store.pending_by_tenant() == {"acme": 1}
        assert [r.index for r in store.next_requests(job.job_id)] == [1]
        assert store.record_result(job.job_id, ok_result(1)).seq == 2
        done = store.get_job(job.job_id)
        assert (done.state, done.completed, done.failed, done.finished_ms) == (
            JobState.SUCCEEDED, 2, 1, done.finished_ms)
        assert done.finished_ms > done.created_ms
        assert [(r.seq, r.index, r.ok) for r in store.results(job.job_id)] == [
            (0, 2, False), (1, 0, True), (2, 1, True)]
        assert [r.seq for r in store.results(job.job_id, offset=1, limit=1)] == [1]
        assert store.pending_by_tenant() == {}
        assert store.results(job.job_id)[0].error_message == "boom"

    def test_a_result_for_a_cancelled_job_is_not_stored(self, store):
        job = store.create_job("acme", "m", make_requests(3))
        assert store.record_result(job.job_id, ok_result(0)).seq == 0
        assert store.cancel(job.job_id).cancelled == 2
        assert store.record_result(job.job_id, ok_result(1)) is None   # came back too late
        assert store.record_result(job.job_id, _failed(2)) is None
        again = store.get_job(job.job_id)
        assert (again.state, again.completed, again.failed, again.cancelled) == (
            JobState.CANCELLED, 1, 0, 2)
        assert [r.index for r in store.results(job.job_id)] == [0]
        assert [r.index for r in store.next_requests(job.job_id)] == [1, 2]


def _free(directory) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


class TestJobstoreLimits:
    def test_a_listing_is_fifty_jobs_unless_asked_and_starts_at_the_epoch(self, tmp_path):
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)  # every job created at 0 ms
        ids = [store.create_job("acme", "m", make_requests(1)).job_id for _ in range(51)]
        listed = [j.job_id for j in store.list_jobs("acme")]
        assert listed == ids[::-1][:50]  # newest first (same instant: the later row first)
        assert len(store.list_jobs("acme", limit=51)) == 51
        assert store.list_jobs("acme", since_ms=1) == []
        store.close()

    def test_a_page_of_results_is_a_thousand_unless_asked(self, store):
        job = store.create_job("acme", "m", make_requests(1001))
        for i in range(1001):
            store.record_result(job.job_id, ok_result(i))
        page = store.results(job.job_id)
        assert [r.seq for r in page] == list(range(1000))
        assert [(r.seq, r.index) for r in store.results(job.job_id, offset=1000)] == [(1000, 1000)]

    def test_the_store_and_an_intake_answer_from_another_thread(self, store):
        """The frontend opens both on its event loop and runs an intake's pieces on a worker
        thread (``asyncio.to_thread``): the connections must not be tied to their thread."""
        intake = store.intake("acme", "m")
        with ThreadPoolExecutor(1) as pool:
            pool.submit(intake.add, make_requests(2)).result(timeout=30)
            job, created = pool.submit(intake.commit).result(timeout=30)
            assert created and pool.submit(store.get_job, job.job_id).result(timeout=30) == job
        intake.close()

    def test_an_intake_is_refused_exactly_when_twice_its_bytes_would_eat_the_reserve(self, tmp_path):
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


def _rows(store, table):
    db = sqlite3.connect(store.path)
    try:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        db.close()


class TestJobstorePruneExact:
    def test_commit_creates_a_queued_job_with_exact_fields(self, store):
        job, created = store.submit("acme", "tiny", make_requests(3), idempotency_key="k")
        assert created
        assert job == JobRecord(job.job_id, "acme", JobState.QUEUED, 3, 0, 0, "tiny", 1002, 0)
        assert (_rows(store, "job_requests"), _rows(store, "job_keys"), _rows(store, "intakes")) == (
            3, 1, 0)

    def test_a_jobs_priority_is_stored_and_read_back_after_a_restart(self, tmp_path):
        path = tmp_path / "jobs.sqlite3"
        store = JobStore(path, Clock())
        batch = store.create_job("acme", "tiny", make_requests(1))
        interactive, _ = store.submit("acme", "tiny", make_requests(2), "k",
                                      Priority.INTERACTIVE)
        again, created = store.submit("acme", "tiny", make_requests(2), "k")  # a retry
        store.close()
        reopened = JobStore(path, Clock())
        assert (batch.priority, interactive.priority) == (Priority.BATCH, Priority.INTERACTIVE)
        assert (again, created) == (interactive, False)   # the first submission's priority
        assert [(j.job_id, j.priority) for j in reopened.unfinished_jobs()] == [
            (batch.job_id, Priority.BATCH), (interactive.job_id, Priority.INTERACTIVE)]
        assert reopened.get_job(interactive.job_id) == interactive
        reopened.close()

    def test_a_repeated_key_drops_the_second_intake_and_its_requests(self, store):
        first, _ = store.submit("acme", "tiny", make_requests(2), idempotency_key="k")
        again, created = store.submit("acme", "other", make_requests(5), idempotency_key="k")
        assert (again, created) == (first, False)
        assert (_rows(store, "jobs"), _rows(store, "job_requests"), _rows(store, "job_keys")) == (
            1, 2, 1)
        no_key, created = store.submit("acme", "tiny", make_requests(1))
        assert created and no_key.job_id != first.job_id
        assert _rows(store, "job_keys") == 1                  # no key, no row

    def test_commit_without_requests_is_a_value_error(self, store):
        intake = store.intake("acme", "tiny")
        try:
            with pytest.raises(ValueError) as info:
                intake.commit("k")
            assert str(info.value) == "requests: a job needs at least one request"
        finally:
            intake.close()
        assert _rows(store, "jobs") == 0

    def test_prune_takes_succeeded_and_cancelled_jobs_before_the_cut_off_only(self, store):
        done = store.create_job("acme", "m", make_requests(1))
        store.record_result(done.job_id, ok_result(0))
        cancelled, _ = store.submit("acme", "m", make_requests(2), idempotency_key="c")
        store.cancel(cancelled.job_id)
        queued = store.create_job("acme", "m", make_requests(1))
        running = store.create_job("acme", "m", make_requests(1))
        store.mark_running(running.job_id)
        cut = store.get_job(cancelled.job_id).finished_ms
        assert store.prune(cut) == 1                           # only the job finished before it
        with pytest.raises(JobNotFound):
            store.get_job(done.job_id)
        assert store.get_job(cancelled.job_id).state is JobState.CANCELLED
        assert store.prune(cut + 1) == 1
        assert store.prune(10**12) == 0                        # queued and running stay
        assert [j.job_id for j in store.list_jobs("acme")] == [running.job_id, queued.job_id]
        assert (_rows(store, "job_requests"), _rows(store, "results"), _rows(store, "job_keys")) == (
            2, 0, 0)
        again, created = store.submit("acme", "m", make_requests(1), idempotency_key="c")
        assert created and again.job_id != cancelled.job_id   # the pruned job's key is free

    def test_a_failed_transaction_leaves_nothing_behind(self, store):
        job = store.create_job("acme", "m", make_requests(1))
        with pytest.raises(RuntimeError):
            with store._transaction():
                store._db.execute("DELETE FROM jobs WHERE job_id = ?", (job.job_id,))
                raise RuntimeError("stop")
        assert store.get_job(job.job_id) == job
        assert not store._db.in_transaction

    def test_an_intake_in_pieces_counts_every_piece_and_names_its_job_exactly(self, store):
        intake = store.intake("acme", "m")
        try:
            assert len(intake.job_id) == 20 and intake.job_id.startswith("job-")
            int(intake.job_id[4:], 16)                        # 16 hex digits
            intake.add(make_requests(2))
            intake.add(make_requests(5)[2:])
            job, created = intake.commit()
        finally:
            intake.close()
        assert created and job.total == 5
        assert _rows(store, "job_keys") == 0                  # committed without a key
        assert [(r.job_id, r.index) for r in store.next_requests(job.job_id)] == [
            (job.job_id, i) for i in range(5)]

    def test_cancelling_a_finished_job_says_so_exactly(self, store):
        from cluster.jobs.store import JobFinished
        job = store.create_job("acme", "m", make_requests(1))
        store.record_result(job.job_id, ok_result(0))
        with pytest.raises(JobFinished) as info:
            store.cancel(job.job_id)
        assert str(info.value) == (f"job_id: job {job.job_id} is already succeeded; "
                                   "only queued or running jobs can be cancelled")


@pytest.fixture
def listed(tmp_path):
    now = [1_000]
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: now[0])
    ids = []
    for i in range(5):
        now[0] = 1_000 + i * 100  # jobs 100 ms apart; job 4 is the newest
        ids.append(store.create_job("acme", "m", [StagedRequest(0, f"r{i}", b"", b"")]).job_id)
    store.create_job("beta", "m", [StagedRequest(0, "r9", b"", b"")])
    store.cancel(ids[1])
    yield store, ids
    store.close()


class TestListingJobs:
    """Pages, state and creation-time filters (over gRPC: tests/cluster/api/test_servicer.py;
    in ``orchard jobs``: tests/cluster/commands/test_jobs.py)."""

    def test_pages_walk_newest_first_without_gaps_or_repeats(self, listed):
        store, ids = listed
        first = store.list_jobs("acme", 2)
        second = store.list_jobs("acme", 2, after=first[-1].job_id)
        third = store.list_jobs("acme", 2, after=second[-1].job_id)
        assert [j.job_id for j in first + second + third] == ids[::-1]
        assert store.list_jobs("acme", 2, after=ids[0]) == []

    def test_filters_by_state_and_creation_time(self, listed):
        store, ids = listed
        assert [j.job_id for j in store.list_jobs("acme", states=(JobState.CANCELLED,))] == [ids[1]]
        assert [j.job_id for j in store.list_jobs("acme", since_ms=1_300)] == [ids[4], ids[3]]
        queued = store.list_jobs("acme", states=(JobState.QUEUED,), since_ms=1_100)
        assert [j.job_id for j in queued] == [ids[4], ids[3], ids[2]]

    def test_another_tenants_job_is_no_page_token(self, listed):
        store, _ = listed
        beta = store.list_jobs("beta")[0].job_id
        with pytest.raises(JobNotFound):
            store.list_jobs("acme", after=beta)
