"""The job runner's other paths, over the in-process backend and a forged tiny model: the
no-worker backoff, streaming, cancelling a running job, pages of requests, the forecast made
before a job runs, and a backend's bug (requests outside a job: ``test_runner_direct``).

Every wait is bounded in wall-clock time (``tests.bounded``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from cluster.backend.local import LocalBackend
from cluster.backend.protocol import GenerateOutcome, NoWorkerAvailable, TokenChunk
from cluster.jobs.dispatch import dispatch, dispatch_stream, result_of
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import (PAGE_ROWS, JobNotFound, JobState, JobStore, NewRequest,
                                StagedRequest)
from cluster.telemetry import attrs as A
from cluster.telemetry.job_tracing import JobTracing
from cluster.telemetry.observe import RequestObserver, ServedCache
from router.cost import PriceTable
from router.kv.key import Namespace, hash_blocks
from tests.bounded import run_bounded, wait_until, within
from tests.forged_models import tiny_model
from tests.runner_bodies import job_task_ended, prepare_body, staged_requests
from tests.telemetry_factories import in_memory
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams

BLOCK = 16
NS = Namespace("acme", "tiny")




def _runner(store, backend, timeout_s: float = 10.0, tracing=None, concurrent: int = 2):
    return JobRunner(store, backend, prepare_body,
                     RunnerLimits(max_concurrent=concurrent, max_pending_per_tenant=1000,
                                  max_pending_total=1000, request_timeout_s=timeout_s),
                     namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK, tracing=tracing)


def _request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, NS, prompt, SamplingParams(max_tokens=max_tokens))


async def _backend() -> LocalBackend:
    backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
    await backend.start()
    return backend


class CountingBackend(LocalBackend):
    """The in-process backend, counting ``generate`` calls (the runner's retries)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    async def generate(self, request, block_hashes):
        self.calls += 1
        return await super().generate(request, block_hashes)


def test_no_worker_is_retried_on_the_backoff_schedule_until_the_deadline():
    async def scenario() -> None:
        backend = CountingBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        await backend.drain("local-0")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(NoWorkerAvailable):
            await dispatch(backend, _request("a", (1, 2, 3), 1), (), 2.0)
        took = loop.time() - start
        # tries at 0, 0.05, 0.15, 0.35, 0.85 and 1.85 s; the next pause (1 s) passes the
        # deadline, so it gives up at once rather than sleep past it
        assert backend.calls == 6 and 1.85 <= took < 2.0
        await backend.scale(1)     # a worker joins during the backoff: the request runs there
        await backend.drain("local-1")
        backend.calls = 0
        waiting = asyncio.ensure_future(dispatch(backend, _request("b", (1, 2, 3), 2), (), 10.0))
        await asyncio.sleep(0.2)   # tried at 0, 0.05 and 0.15 s
        assert backend.calls == 3
        await backend.scale(1)
        outcome = await waiting
        assert (outcome.worker_id, len(outcome.result.output_tokens)) == ("local-2", 2)
        await backend.close()

    run_bounded(scenario(), 30, "the no-worker backoff")


class SilentBackend:
    """A backend whose call never ends (a worker that stopped answering)."""

    async def generate(self, request, block_hashes):
        await asyncio.Event().wait()


def test_a_request_gets_its_deadline_and_not_a_moment_more():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        call = asyncio.ensure_future(
            dispatch(SilentBackend(), _request("x", (1, 2, 3), 1), (), 0.05))
        await within(call.done, 0.5, "a request with a 0.05 s deadline ended")
        with pytest.raises(TimeoutError):
            await call
        assert 0.05 <= loop.time() - start < 0.5

    run_bounded(scenario(), 30, "a request's deadline")


def test_a_stream_yields_chunks_then_its_outcome_and_stops_at_its_deadline():
    async def scenario() -> None:
        backend = await _backend()
        items = [i async for i in dispatch_stream(backend, _request("s", (5, 6, 7), 3), (), 10.0)]
        chunks, outcome = items[:-1], items[-1]
        assert {type(c) for c in chunks} == {TokenChunk} and type(outcome) is GenerateOutcome
        assert outcome.result.output_tokens == tuple(t for c in chunks for t in c.token_ids)
        assert len(outcome.result.output_tokens) == 3
        with pytest.raises(TimeoutError):
            async for _ in dispatch_stream(backend, _request("t", (5, 6, 7), 1500), (), 0.3):
                pass
        engine_busy = await backend.runtime.call("local-0", lambda engine: engine.busy)
        assert engine_busy is False   # closed at the deadline: aborted on the worker
        await backend.close()

    run_bounded(scenario(), 30, "a stream and its deadline")


def test_a_result_carries_every_field_of_the_outcome():
    async def scenario() -> None:
        backend = await _backend()
        prompt = tuple(range(40, 40 + 2 * BLOCK + 3))
        outcome = await dispatch(backend, _request("x", prompt, 3),
                                 hash_blocks(prompt, BLOCK, NS), 10.0)
        r = outcome.result
        stored = result_of(7, "conv-7", outcome)
        assert stored == type(stored)(
            index=7, custom_id="conv-7", request_id="x", ok=True, text=r.text,
            output_tokens=r.output_tokens, finish_reason="length", prompt_tokens=35,
            cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens,
            written_tokens=r.written_tokens, worker_id="local-0", ttft_s=r.ttft_s,
            tpot_s=r.tpot_s, attempts=1, worker_s=outcome.worker_time_s())
        assert (r.cached_tokens, r.computed_tokens, r.written_tokens) == (0, 35, 32)
        assert r.ttft_s > 0 and r.tpot_s > 0 and r.text != "" and outcome.worker_s > 0
        await backend.close()

    run_bounded(scenario(), 30, "a result's fields")


def test_cancelling_a_running_job_stops_its_requests_and_releases_its_count(tmp_path):
    async def scenario() -> None:
        backend = await _backend()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend)
        runner.admit("acme", 4)
        runner.admit("bravo", 1)
        job = store.create_job("acme", "tiny", staged_requests(
            *[(list(range(10 + i, 30 + i)), 1500) for i in range(4)]))
        runner.launch(job)
        await wait_until(lambda: runner.slots_in_use() == {"acme": 2}, "2 requests running")
        assert store.get_job(job.job_id).state is JobState.RUNNING
        assert job.job_id in {t.get_name() for t in asyncio.all_tasks()}  # the job's own task
        with pytest.raises(JobNotFound, match=f"^job_id: no job '{job.job_id}'$"):
            runner.cancel(job.job_id, "bravo")    # another tenant's job: not theirs to cancel
        assert runner.slots_in_use() == {"acme": 2}
        changed = asyncio.ensure_future(runner.wait_changed(10.0))
        await asyncio.sleep(0)
        cancelled = runner.cancel(job.job_id, "acme")
        assert (cancelled.state, cancelled.cancelled) == (JobState.CANCELLED, 4)
        assert runner.pending() == {"bravo": 1}
        await asyncio.wait_for(changed, 1.0)   # the cancel woke whoever waits for progress
        await asyncio.sleep(0.5)
        assert runner.slots_in_use() == {}, "the cancelled requests still run 0.5 s later"
        queued = store.create_job("bravo", "tiny", staged_requests(([1, 2], 1)))  # never launched
        assert runner.cancel(queued.job_id, "bravo").cancelled == 1
        assert runner.pending() == {}
        busy = await backend.runtime.call("local-0", lambda engine: engine.busy)
        assert busy is False and store.results(job.job_id) == []
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "cancel a running job")


def test_waiting_for_progress_returns_after_its_timeout_when_nothing_moves(tmp_path):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, None)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await asyncio.wait_for(runner.wait_changed(0.2), 2.0)
        except TimeoutError:
            raise AssertionError("wait_changed(0.2) still waits after 2 s") from None
        assert 0.2 <= loop.time() - start < 1.0
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "wait_changed's timeout")


def test_a_job_longer_than_a_page_runs_every_request_once(tmp_path):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        prepared: list[bytes] = []

        def prepare(body: bytes) -> NewRequest:   # refuses every prompt: no backend call
            prepared.append(body)
            return prepare_body(body)

        runner = JobRunner(store, None, prepare,
                           RunnerLimits(max_concurrent=8, max_pending_per_tenant=1000,
                                        max_pending_total=1000, request_timeout_s=10.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
        n = PAGE_ROWS + 44
        runner.admit("acme", n)
        job = store.create_job("acme", "tiny", staged_requests(*[([i, -1], 1) for i in range(n)]))
        runner.launch(job)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await runner.wait_changed(3.0)   # a result recorded wakes whoever waits for progress
        assert loop.time() - start < 3.0, "no wake-up when a result was recorded"
        await wait_until(lambda: store.get_job(job.job_id).state is JobState.SUCCEEDED
                         or len(prepared) > len(set(prepared)), "the job to finish")
        assert len(prepared) == len(set(prepared)) == n, "a request was run twice"
        results = store.results(job.job_id, limit=n + 10)
        assert [r.index for r in results] == list(range(n))
        assert {(r.ok, r.error_code) for r in results} == {(False, "INVALID_ARGUMENT")}
        assert runner.pending() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a job of two pages")


class BrokenBackend(LocalBackend):
    """The in-process backend with a bug for one request id, and an outcome without a result
    for another."""

    async def generate(self, request, block_hashes):
        if request.request_id.endswith("-1"):
            raise KeyError("boom")
        outcome = await super().generate(request, block_hashes)
        if request.request_id.endswith("-3"):
            return dataclasses.replace(outcome, result=None)
        return outcome


def test_a_backend_bug_and_a_refused_request_are_recorded_with_their_status(tmp_path, caplog):
    async def scenario() -> None:
        backend = BrokenBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend)
        runner.admit("acme", 4)
        job = store.create_job("acme", "tiny", staged_requests(
            ([1, 2], 1), ([3, 4], 1), ([10**9], 1), ([5, 6], 1)))
        runner.launch(job)
        await wait_until(lambda: store.get_job(job.job_id).state is JobState.SUCCEEDED,
                         "the job to finish")
        ok, bug, refused, empty = sorted(store.results(job.job_id), key=lambda r: r.index)
        assert (ok.ok, bug.ok, refused.ok, empty.ok) == (True, False, False, False)
        assert (bug.error_code, bug.error_message) == ("INTERNAL", "KeyError: 'boom'")
        assert empty.error_code == "INTERNAL"   # the result could not be built: still recorded
        assert empty.error_message.startswith("AttributeError: 'NoneType' object has no attribute")
        assert refused.error_code == "INVALID_ARGUMENT"
        assert refused.error_message == (
            f"request {job.job_id}-2: token id 1000000000 is outside the vocabulary [0, 32000); "
            "tokenize with this model's tokenizer")
        logged = sorted((r.getMessage(), type(r.exc_info[1]).__name__)
                        for r in caplog.records if r.name == "cluster.jobs.runner")
        assert logged == [(f"request {job.job_id}-1 failed", "KeyError"),
                          (f"request {job.job_id}-3: no result could be built", "AttributeError")]
        assert runner.pending() == {}
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a backend bug")


def test_the_forecast_covers_the_first_requests_of_a_job_before_any_runs(tmp_path):
    async def scenario() -> None:
        tel, exporter, _ = in_memory(tmp_path)
        observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BLOCK, 300.0, 10_000))
        tracing = JobTracing(observer)
        backend = await _backend()
        await backend.drain("local-0")   # every request fails at once: UNAVAILABLE
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend, timeout_s=0.01, tracing=tracing)
        specs = [([5, -1], 1)] + [(list(range(i, i + 20)), 1) for i in range(129)]
        runner.admit("acme", len(specs))
        job = store.create_job("acme", "tiny", staged_requests(*specs))
        runner.launch(job)
        # 130 requests that fail at once (no worker, a 0.01 s deadline), two at a time
        await within(lambda: store.get_job(job.job_id).state is JobState.SUCCEEDED, 10.0,
                     "a job of 130 requests without a worker ended")
        spans = exporter.get_finished_spans()
        [job_span] = [s for s in spans if s.name == "orchard.job"]
        # the first 128 in dispatch order, less the one prepare refused
        assert job_span.attributes[A.JOB_REQUESTS] == 127
        assert job_span.attributes[A.JOB_ID] == job.job_id
        assert job_span.attributes[A.TENANT] == "acme"
        assert all(s.start_time >= job_span.end_time for s in spans if s is not job_span)
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "the job forecast")


class RecordingBackend(BrokenBackend):
    """The broken backend, keeping every request it is handed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[GenerateRequest] = []

    async def generate(self, request, block_hashes):
        self.requests.append(request)
        return await super().generate(request, block_hashes)


def test_each_request_is_traced_with_its_names_and_sent_as_a_batch_request(tmp_path, caplog):
    async def scenario() -> str:
        tel, exporter, _ = in_memory(tmp_path)
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", BLOCK, 300.0, 10_000)))
        tracing.chat_opening = (1, 2)   # a prompt that opens so is a chat
        backend = RecordingBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend, tracing=tracing)
        runner.admit("acme", 2)
        bodies = [json.dumps({"prompt": p, "max_tokens": n}).encode()
                  for p, n in (([1, 2, 3], 2), ([4, 5], 3))]
        job = store.create_job("acme", "tiny", [StagedRequest(0, "chat-7-t4", b"", bodies[0]),
                                                StagedRequest(1, "c1-turn-2", b"", bodies[1])])
        runner.launch(job)
        await wait_until(lambda: store.get_job(job.job_id).state is JobState.SUCCEEDED,
                         "the job to finish")
        assert [(r.request_id, r.batch) for r in backend.requests] == [
            (f"{job.job_id}-0", True), (f"{job.job_id}-1", True)]
        assert all(dict(r.trace_context).get("traceparent") for r in backend.requests)
        spans = {s.attributes.get(A.REQUEST_ID): s for s in exporter.get_finished_spans()}
        ok, failed = spans[f"{job.job_id}-0"], spans[f"{job.job_id}-1"]
        assert [(s.attributes[A.JOB_ID], s.attributes[A.GEN_AI_CONVERSATION], s.attributes[A.TURN],
                 s.attributes[A.GEN_AI_REQUEST_MAX_TOKENS], s.attributes[A.GEN_AI_OPERATION])
                for s in (ok, failed)] == [(job.job_id, "chat-7", 4, 2, "chat"),
                                           (job.job_id, "c1", 2, 3, "text_completion")]
        assert {s.attributes[A.TENANT] for s in (ok, failed)} == {"acme"}
        assert A.ERROR_TYPE not in ok.attributes and ok.status.status_code.name == "UNSET"
        stored = min(store.results(job.job_id), key=lambda r: r.index)  # cost and miss, stored
        assert (stored.ok, stored.miss_cause) == (True, "shorter_than_block")  # 3 tokens
        assert stored.measured_multiplier is not None
        assert (failed.attributes[A.ERROR_TYPE], failed.status.description) == (
            "INTERNAL", "INTERNAL: KeyError: 'boom'")
        await runner.close()
        await backend.close()
        store.close()
        return job.job_id

    job_id = run_bounded(scenario(), 30, "a job's traces")
    assert [r.getMessage() for r in caplog.records if r.name == "cluster.jobs.runner"] == [
        f"request {job_id}-1 failed"]


def test_a_prepare_bug_fails_its_request_alone_and_a_broken_job_task_fails_the_rest(tmp_path,
                                                                                    caplog):
    def broken_prepare(body: bytes) -> NewRequest:
        if json.loads(body)["max_tokens"] == 7:
            raise RuntimeError("tokenizer broke")
        return prepare_body(body)

    class BrokenForecast(JobTracing):
        def job_launched(self, *args, **kwargs) -> None:
            raise RuntimeError("forecast broke")

    async def scenario() -> None:
        backend = await _backend()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        limits = RunnerLimits(max_concurrent=2, max_pending_per_tenant=1000,
                              max_pending_total=1000, request_timeout_s=10.0)
        runner = JobRunner(store, backend, broken_prepare, limits,
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
        runner.admit("acme", 3)
        job = store.create_job("acme", "tiny",
                               staged_requests(([1, 2], 1), ([3, 4], 7), ([5, 6], 1)))
        runner.launch(job)
        await wait_until(lambda: store.get_job(job.job_id).state is JobState.SUCCEEDED,
                         "the job with a prepare bug to finish")
        results = sorted(store.results(job.job_id), key=lambda r: r.index)
        assert [r.ok for r in results] == [True, False, True]
        assert (results[1].error_code, results[1].error_message) == (
            "INTERNAL", "RuntimeError: tokenizer broke")
        assert [r.getMessage() for r in caplog.records if r.name == "cluster.jobs.runner"] == [
            f"request {job.job_id}-1: prepare failed: RuntimeError('tokenizer broke')"]
        assert runner.pending() == {}
        await runner.close()

        # the job's own task fails before any request runs: every request still gets a result
        broken = JobRunner(store, backend, prepare_body, limits,
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK,
                           tracing=BrokenForecast(RequestObserver(
                               in_memory(tmp_path)[0], PriceTable(),
                               ServedCache("tiny", BLOCK, 300.0, 10_000))))
        n = PAGE_ROWS + 2   # failed a page at a time
        broken.admit("beta", n)
        job = store.create_job("beta", "tiny", staged_requests(*[([1, 2], 1)] * n))
        broken.launch(job)
        await job_task_ended(job.job_id, "the job whose forecast failed")
        done = store.get_job(job.job_id)
        assert (done.state, done.total, done.completed, done.failed) == (
            JobState.SUCCEEDED, n, 0, n)
        assert {(r.error_code, r.error_message) for r in store.results(job.job_id)} == {
            ("INTERNAL", "RuntimeError: forecast broke")}
        assert broken.pending() == {}
        failed = [r for r in caplog.records if r.name == "cluster.jobs.runner"
                  and r.levelname == "ERROR" and r.exc_info]
        assert [r.getMessage() for r in failed] == [f"job {job.job_id}: its task failed"]
        assert str(failed[0].exc_info[1]) == "forecast broke"
        await broken.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a prepare bug and a broken job task")
