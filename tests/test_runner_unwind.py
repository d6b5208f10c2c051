"""How the job runner unwinds requests in flight: on close, when one of two running jobs is
cancelled, when a job's own task fails mid-run, and when a page of requests goes missing.

The runner and the store are the real ones. The backend holds every call until the test opens
it and, when a call is cancelled, takes a while to unwind (as an abort sent to a worker does),
longer for later requests; so a runner that stops waiting after the first unwind is caught.
Each scenario waits for the job's own task to end, then checks the job: a job left unfinished
fails at once rather than stalling (``tests.bounded``).
"""
from __future__ import annotations

import asyncio
import sqlite3

from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import PAGE_ROWS, JobState, JobStore, NewRequest, StagedRequest
from router.kv.key import Namespace
from tests.bounded import run_bounded, wait_until
from tests.runner_bodies import job_task_ended
from workers.messages import SamplingParams

UNWIND_S = 0.05   # a cancelled call's unwinding takes this long per place in its job


class HeldBackend:
    """Holds each ``generate`` until ``opened``; a cancelled call unwinds, then is counted."""

    def __init__(self):
        self.opened = asyncio.Event()
        self.in_flight: set[tuple[str, int]] = set()   # (tenant, index)
        self.aborted: list[tuple[str, int]] = []       # in the order their unwinding ended
        self.twice: list[tuple[str, int]] = []         # sent while already in flight

    async def generate(self, request, block_hashes):
        call = (request.namespace.tenant, request.prompt[0])
        if call in self.in_flight:
            self.twice.append(call)
        self.in_flight.add(call)
        try:
            await self.opened.wait()
        except asyncio.CancelledError:
            await asyncio.sleep(UNWIND_S * call[1])
            self.aborted.append(call)
            raise
        finally:
            self.in_flight.discard(call)
        raise ValueError(f"request {call[1]} refused")


def _prepare(body: bytes) -> NewRequest:
    """Body ``b"7"`` is the prompt ``(7, 1, 2)``; ``b"-"`` is refused (no backend call)."""
    if body == b"-":
        raise ValueError("refused before it ran")
    return NewRequest(custom_id="", prompt=(int(body), 1, 2),
                      sampling=SamplingParams(max_tokens=1))


def _requests(n: int, body: bytes | None = None) -> list[StagedRequest]:
    return [StagedRequest(i, f"r{i}", b"", body or str(i).encode()) for i in range(n)]


def _runner(store: JobStore, backend, max_concurrent: int) -> JobRunner:
    return JobRunner(store, backend, _prepare,
                     RunnerLimits(max_concurrent, max_pending_per_tenant=1000,
                                  max_pending_total=1000, request_timeout_s=60.0),
                     namespace=lambda t: Namespace(t, "m"), block_size=16)


def _submit(store: JobStore, runner: JobRunner, tenant: str, requests: list[StagedRequest]):
    runner.admit(tenant, len(requests))
    job = store.create_job(tenant, "m", requests)
    runner.launch(job)
    return job


async def _in_flight(backend: HeldBackend, store: JobStore, n: int) -> None:
    """Until ``n`` calls are held by the backend; fails at once if requests got results
    instead (they never reached it) or one was sent twice."""
    def ended() -> list:
        return [(r.index, r.error_code, r.error_message)
                for job in store.list_jobs("acme") + store.list_jobs("bravo")
                for r in store.results(job.job_id)]

    await wait_until(lambda: len(backend.in_flight) == n or ended() or backend.twice,
                     f"{n} calls in flight", 5.0)
    assert not ended(), f"requests ended before the backend held {n}: {ended()}"
    assert not backend.twice, f"requests sent twice: {backend.twice}"


def _outcomes(store: JobStore, job_id: str) -> list[tuple[int, str, str]]:
    return [(r.index, r.error_code, r.error_message)
            for r in sorted(store.results(job_id, limit=PAGE_ROWS + 10), key=lambda r: r.index)]


def test_closing_returns_once_every_request_in_flight_has_unwound(tmp_path):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
        backend = HeldBackend()
        runner = _runner(store, backend, max_concurrent=3)
        job = _submit(store, runner, "acme", _requests(3))
        await _in_flight(backend, store, 3)
        await runner.close()
        assert backend.aborted == [("acme", 0), ("acme", 1), ("acme", 2)]
        assert backend.in_flight == set() and runner.slots_in_use() == {}
        assert store.get_job(job.job_id).state is JobState.RUNNING   # resumed on next start
        assert store.results(job.job_id) == []
        store.close()

    run_bounded(scenario(), 30, "close with requests in flight")


def test_cancelling_one_job_leaves_the_other_s_requests_running(tmp_path):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
        backend = HeldBackend()
        runner = _runner(store, backend, max_concurrent=4)
        first = _submit(store, runner, "acme", _requests(2))
        second = _submit(store, runner, "bravo", _requests(2))
        await _in_flight(backend, store, 2 * 2)
        assert runner.cancel(first.job_id, "acme").cancelled == 2
        assert runner.pending() == {"bravo": 2}
        await job_task_ended(first.job_id, "the cancelled job")   # once its calls unwound
        assert sorted(backend.aborted) == [("acme", 0), ("acme", 1)]
        assert len(backend.in_flight) == 2, "the other job's calls were stopped too"
        backend.opened.set()
        await job_task_ended(second.job_id, "the job left running")
        done = store.get_job(second.job_id)
        assert (done.state, done.completed, done.failed) == (JobState.SUCCEEDED, 0, 2)
        assert _outcomes(store, second.job_id) == [
            (0, "INVALID_ARGUMENT", "request 0 refused"),
            (1, "INVALID_ARGUMENT", "request 1 refused")]
        assert runner.pending() == {} and runner.slots_in_use() == {}
        assert store.results(first.job_id) == []
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "cancel one of two running jobs")


def test_a_result_ready_as_its_job_is_cancelled_is_dropped_and_counted_once(tmp_path):
    async def scenario():
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
        backend = HeldBackend()
        runner = _runner(store, backend, max_concurrent=2)
        job = _submit(store, runner, "acme", _requests(3))   # the third waits for a slot
        await _in_flight(backend, store, 2)
        backend.opened.set()   # both calls end in this very turn of the loop ...
        cancelled = runner.cancel(job.job_id, "acme")   # ... as the job is cancelled
        assert (cancelled.state, cancelled.cancelled) == (JobState.CANCELLED, 3)
        assert runner.pending() == {}
        await job_task_ended(job.job_id, "the cancelled job")
        await asyncio.sleep(0.1)   # whatever the calls' ends could still record
        assert store.results(job.job_id) == []
        again = store.get_job(job.job_id)
        assert (again.state, again.completed, again.failed, again.cancelled) == (
            JobState.CANCELLED, 0, 0, 3)
        assert runner.pending() == {} and runner.slots_in_use() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a result ready as its job is cancelled")


class PageFault(JobStore):
    """The real store, whose first read of a page after the first goes wrong once: it raises
    ``error`` (a disk error) or, without one, answers nothing (a lost page)."""

    def __init__(self, *args, error: Exception | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.error, self.faults_left = error, 1

    def next_requests(self, job_id, after=(b"", -1), limit=PAGE_ROWS):
        if after != (b"", -1) and self.faults_left:
            self.faults_left -= 1
            if self.error is not None:
                raise self.error
            return []
        return super().next_requests(job_id, after, limit)


def test_a_job_whose_task_fails_mid_run_unwinds_its_requests_then_fails_them(tmp_path):
    async def scenario() -> None:
        store = PageFault(tmp_path / "jobs.sqlite3", lambda: 0,
                          error=sqlite3.OperationalError("disk I/O error"))
        backend = HeldBackend()
        runner = _runner(store, backend, max_concurrent=4)
        # 3 requests the backend holds, then the rest of the first page refused one by one
        # through the fourth slot (by then the 3 are in flight), then a second page, whose
        # read fails just after the first page's last request started
        refused = [StagedRequest(i, f"r{i}", b"", b"-") for i in range(3, PAGE_ROWS + 1)]
        job = _submit(store, runner, "acme", _requests(3) + refused)
        await job_task_ended(job.job_id, "the job whose page read failed")
        assert backend.aborted == [("acme", 0), ("acme", 1), ("acme", 2)]
        done = store.get_job(job.job_id)
        assert (done.state, done.completed, done.failed) == (
            JobState.SUCCEEDED, 0, PAGE_ROWS + 1)
        failed = "OperationalError: disk I/O error"
        assert _outcomes(store, job.job_id) == (
            [(i, "INTERNAL", failed) for i in range(3)]
            + [(i, "INVALID_ARGUMENT", "refused before it ran") for i in range(3, PAGE_ROWS - 1)]
            + [(PAGE_ROWS - 1, "INTERNAL", failed),   # started just before the read: cancelled
               (PAGE_ROWS, "INTERNAL", failed)])
        assert runner.pending() == {} and runner.slots_in_use() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a job task that fails with requests in flight")


def test_requests_a_lost_page_left_behind_fail_so_the_job_ends(tmp_path):
    async def scenario() -> None:
        store = PageFault(tmp_path / "jobs.sqlite3", lambda: 0)
        runner = _runner(store, None, max_concurrent=8)
        n = PAGE_ROWS + 3
        job = _submit(store, runner, "acme", _requests(n, b"-"))  # refused: no backend call
        await job_task_ended(job.job_id, "the job with a lost page")
        done = store.get_job(job.job_id)
        assert (done.state, done.completed, done.failed) == (JobState.SUCCEEDED, 0, n)
        lost = "RuntimeError: requests without a result after the job's last page"
        assert _outcomes(store, job.job_id) == (
            [(i, "INVALID_ARGUMENT", "refused before it ran") for i in range(PAGE_ROWS)]
            + [(i, "INTERNAL", lost) for i in range(PAGE_ROWS, n)])
        assert runner.pending() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a lost page")


def test_the_cancel_reaches_queued_requests_through_the_jobs_own_task(tmp_path):
    """Two of five requests hold the job's two slots when it is cancelled: the job's own task
    stops, so the three still queued never reach the backend, even once slots free up."""
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
        backend = HeldBackend()
        runner = _runner(store, backend, max_concurrent=2)
        job = _submit(store, runner, "acme", _requests(5))
        await _in_flight(backend, store, 2)
        assert runner.cancel(job.job_id, "acme").cancelled == 5
        await job_task_ended(job.job_id, "the cancelled job")
        backend.opened.set()
        other = _submit(store, runner, "bravo", _requests(1))   # a job after it still runs
        await job_task_ended(other.job_id, "the job after the cancelled one")
        assert sorted(backend.aborted) == [("acme", 0), ("acme", 1)]
        assert backend.in_flight == set() and not backend.twice
        assert store.results(job.job_id) == [] and runner.pending() == {}
        assert _outcomes(store, other.job_id) == [(0, "INVALID_ARGUMENT", "request 0 refused")]
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "cancel a job with queued requests")
