"""The job runner over the in-process backend and a forged tiny model: exact results, the
status of each failure, pending counts through duplicates and restarts.

Every wait is bounded in wall-clock time (``tests.bounded``), so a runner that never records a
result fails here, saying so, instead of hanging.
"""
from __future__ import annotations

from cluster.backend.local import LocalBackend
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import JobState, JobStore
from router.kv.key import Namespace
from tests.bounded import run_bounded, wait_until
from tests.forged_models import tiny_model
from tests.runner_bodies import prepare_body, staged_requests
from workers.engine.engine import EngineConfig

BLOCK = 16




def _runner(store: JobStore, backend, timeout_s: float = 10.0) -> JobRunner:
    return JobRunner(store, backend, prepare_body,
                     RunnerLimits(max_concurrent=2, max_pending_per_tenant=100,
                                  max_pending_total=100, request_timeout_s=timeout_s),
                     namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)


async def _finished(store: JobStore, job_id: str, timeout_s: float = 20.0):
    return await wait_until(
        lambda: (job := store.get_job(job_id)).state is JobState.SUCCEEDED and job,
        f"job {job_id} to finish", timeout_s)


async def _backend() -> LocalBackend:
    # no kept caches: which request takes a finished one's cache depends on timing, and these
    # tests count the store's reuse exactly
    backend = LocalBackend(tiny_model(), workers=1,
                           engine=EngineConfig(block_size=BLOCK, kept_bytes=0))
    await backend.start()
    return backend


def test_results_failures_and_pending_counts_are_exact(tmp_path):
    async def scenario() -> None:
        backend = await _backend()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend)
        prompt = list(range(40, 40 + 2 * BLOCK + 3))  # 35 tokens: 2 full blocks
        staged = staged_requests((prompt, 3), (prompt, 2), ([5, -1, 7], 2),
                                 (prompt + [9] * 20, 1))
        runner.admit("acme", 4)
        job = store.create_job("acme", "tiny", staged)
        runner.launch(job)
        job = await _finished(store, job.job_id)
        assert (job.total, job.completed, job.failed) == (4, 3, 1)
        assert runner.pending() == {}
        by_index = {r.index: r for r in store.results(job.job_id)}
        bad = by_index[2]
        assert (bad.ok, bad.error_code, bad.error_message) == (
            False, "INVALID_ARGUMENT", "prompt: token ids must be >= 0")
        first, second, longer = by_index[0], by_index[1], by_index[3]
        assert (first.ok, first.custom_id, first.request_id) == (True, "r0", f"{job.job_id}-0")
        assert (len(first.output_tokens), first.finish_reason) == (3, "length")
        assert (first.prompt_tokens, len(second.output_tokens), longer.prompt_tokens) == (35, 2, 55)
        # the three share 2 full blocks: what the first wrote, the others read
        assert sorted(r.cached_tokens for r in (first, second, longer)) == [0, 32, 32]
        assert all(r.computed_tokens == r.prompt_tokens - r.cached_tokens
                   for r in (first, second, longer))
        assert {r.worker_id for r in (first, second, longer)} == {"local-0"}
        assert all(r.attempts == 1 and r.worker_s > 0 for r in (first, second, longer))
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a job over the in-process backend")


def test_a_request_past_its_deadline_or_without_workers_gets_its_status(tmp_path):
    async def scenario() -> None:
        backend = await _backend()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend, timeout_s=0.4)
        runner.admit("acme", 1)
        job = store.create_job("acme", "tiny", staged_requests((list(range(10, 30)), 1500)))
        runner.launch(job)
        job = await _finished(store, job.job_id)
        [late] = store.results(job.job_id)
        assert (late.ok, late.error_code, late.error_message) == (
            False, "DEADLINE_EXCEEDED", "the request ran longer than 0.4 s")
        await backend.drain("local-0")  # no worker left
        runner.admit("acme", 1)
        job = store.create_job("acme", "tiny", staged_requests(([1, 2, 3], 1)))
        runner.launch(job)
        job = await _finished(store, job.job_id)
        [none] = store.results(job.job_id)
        assert (none.ok, none.error_code, none.error_message) == (
            False, "UNAVAILABLE", "no worker could take the request: cannot route: no workers "
                                  "are registered; add a worker or retry later")
        assert runner.pending() == {}
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "deadline and no-worker statuses")


def test_a_restart_counts_what_is_pending_and_a_rerun_result_releases_nothing(tmp_path):
    async def scenario() -> None:
        path = tmp_path / "jobs.sqlite3"
        store = JobStore(path, lambda: 1_000)
        job = store.create_job("acme", "tiny", staged_requests(([1, 2, 3], 1), ([4, 5, 6], 1),
                                                       ([7, 8, 9], 1)))
        other = store.create_job("bravo", "tiny", staged_requests(([1, 2], 1)))
        store.cancel(other.job_id)
        store.close()
        store = JobStore(path, lambda: 2_000)   # the frontend restarts
        backend = await _backend()
        runner = _runner(store, backend)
        assert runner.pending() == {}
        assert runner.resume() == [job.job_id]  # relaunched, its 3 requests counted
        runner.admit("acme", 1)                 # one more, of a job not launched yet
        assert runner.pending() == {"acme": 4}
        runner.launch(job)  # a second run of the same requests: every result twice
        await _finished(store, job.job_id)
        await wait_until(lambda: runner.slots_in_use() == {}, "the reruns to end")
        # each request stored once, and released once: the other job's request still counts
        assert [r.index for r in store.results(job.job_id)] == [0, 1, 2]
        assert runner.pending() == {"acme": 1}
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "resume after a restart")
