"""The job runner over the in-process backend and a forged tiny model: exact results, the
status of each failure, pending counts through duplicates and restarts.

Every wait is bounded in wall-clock time (``tests.bounded``), so a runner that never records a
result fails here, saying so, instead of hanging.

The job runner's other paths, over the in-process backend and a forged tiny model: the
no-worker backoff, streaming, cancelling a running job, pages of requests, the forecast made
before a job runs, and a backend's bug (requests outside a job: ``test_runner_direct``).

Every wait is bounded in wall-clock time (``tests.bounded``).

The job runner's stored results, built from typed values (no engine): every field of a
finished request, whose worker it names, and an error's fields.

How the job runner unwinds requests in flight: on close, when one of two running jobs is
cancelled, when a job's own task fails mid-run, and when a page of requests goes missing.

The runner and the store are the real ones. The backend holds every call until the test opens
it and, when a call is cancelled, takes a while to unwind (as an abort sent to a worker does),
longer for later requests; so a runner that stops waiting after the first unwind is caught.
Each scenario waits for the job's own task to end, then checks the job: a job left unfinished
fails at once rather than stalling (``tests.bounded``).

Cancel means stop: Generate streams a client cancels are aborted in the engine.

A real frontend over one in-process worker (tiny forged model, 4 requests decoding at once),
real gRPC clients. Before the engine could abort, 16 cancelled streams kept decoding to their
``max_tokens`` and the next request queued behind them.
"""
from __future__ import annotations

from cluster.backend.local import LocalBackend
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.store import JobState, JobStore
from router.kv.key import Namespace
from tests.support.bounded import run_bounded, wait_until
from tests.support.forged_models import tiny_model
from tests.support.runner_bodies import prepare_body, staged_requests
from workers.engine.engine import EngineConfig
import asyncio
import dataclasses
import json
import pytest
from cluster.jobs.store import (PAGE_ROWS, JobNotFound, JobState, JobStore, NewRequest,
                                StagedRequest)
from cluster.telemetry import attrs as A
from cluster.telemetry.job_tracing import JobTracing
from cluster.telemetry.observe import RequestObserver, ServedCache
from router.cost import PriceTable
from router.kv.key import Namespace
from tests.support.bounded import run_bounded, wait_until, within
from tests.support.runner_bodies import job_task_ended, prepare_body, staged_requests
from tests.support.telemetry_factories import in_memory
from workers.messages import GenerateRequest, SamplingParams
import sqlite3
from cluster.jobs.store import PAGE_ROWS, JobState, JobStore, NewRequest, StagedRequest
from tests.support.runner_bodies import job_task_ended
from workers.messages import SamplingParams
import time
import grpc
from cluster.api.client import OrchardError, token_request
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc


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


class TestExact:
    def test_results_failures_and_pending_counts_are_exact(self, tmp_path):
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

    def test_a_request_past_its_deadline_or_without_workers_gets_its_status(self, tmp_path):
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

    def test_a_restart_counts_what_is_pending_and_a_rerun_result_releases_nothing(self, tmp_path):
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
            # relaunched (what the lease takes: cluster.jobs.lease), its 3 requests counted
            assert runner.adopt(store.unfinished_jobs()) == [job.job_id]
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


NS = Namespace("acme", "tiny")

def _runner_paths(store, backend, timeout_s: float = 10.0, tracing=None, concurrent: int = 2):
    return JobRunner(store, backend, prepare_body,
                     RunnerLimits(max_concurrent=concurrent, max_pending_per_tenant=1000,
                                  max_pending_total=1000, request_timeout_s=timeout_s),
                     namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK, tracing=tracing)

async def _backend_paths() -> LocalBackend:
    backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
    await backend.start()
    return backend

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

class RecordingBackend(BrokenBackend):
    """The broken backend, keeping every request it is handed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[GenerateRequest] = []

    async def generate(self, request, block_hashes):
        self.requests.append(request)
        return await super().generate(request, block_hashes)


class TestPaths:
    def test_cancelling_a_running_job_stops_its_requests_and_releases_its_count(self, tmp_path):
        async def scenario() -> None:
            backend = await _backend_paths()
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            runner = _runner_paths(store, backend)
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
            await wait_until(lambda: runner.slots_in_use() == {}, "the cancelled requests' slots")
            queued = store.create_job("bravo", "tiny", staged_requests(([1, 2], 1)))  # never launched
            assert runner.cancel(queued.job_id, "bravo").cancelled == 1
            assert runner.pending() == {}
            busy = await backend.runtime.call("local-0", lambda engine: engine.busy)
            assert busy is False and store.results(job.job_id) == []
            await runner.close()
            await backend.close()
            store.close()

        run_bounded(scenario(), 30, "cancel a running job")

    def test_waiting_for_progress_returns_after_its_timeout_when_nothing_moves(self, tmp_path):
        async def scenario() -> None:
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            runner = _runner_paths(store, None)
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

    def test_a_job_longer_than_a_page_runs_every_request_once(self, tmp_path):
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

    def test_a_backend_bug_and_a_refused_request_are_recorded_with_their_status(self, tmp_path, caplog):
        async def scenario() -> None:
            backend = BrokenBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
            await backend.start()
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            runner = _runner_paths(store, backend)
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

    def test_the_forecast_covers_the_first_requests_of_a_job_before_any_runs(self, tmp_path):
        async def scenario() -> None:
            tel, exporter, _ = in_memory(tmp_path)
            observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BLOCK, 300.0, 10_000))
            tracing = JobTracing(observer)
            backend = await _backend_paths()
            await backend.drain("local-0")   # every request fails at once: UNAVAILABLE
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            runner = _runner_paths(store, backend, timeout_s=0.01, tracing=tracing)
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

    def test_the_forecast_hands_its_tokenization_to_the_job_s_first_request(self, tmp_path):
        async def scenario() -> tuple[dict[int, int], dict[int, int]]:
            tel, _, _ = in_memory(tmp_path)
            tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                                 ServedCache("tiny", BLOCK, 300.0, 10_000)))
            backend = await _backend_paths()
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            prepared: dict[int, int] = {}   # a prompt's first token -> times prepared

            def counted(body: bytes) -> NewRequest:
                first = json.loads(body)["prompt"][0]
                prepared[first] = prepared.get(first, 0) + 1
                return prepare_body(body)

            runner = JobRunner(store, backend, counted,
                               RunnerLimits(max_concurrent=2, max_pending_per_tenant=100,
                                            max_pending_total=100, request_timeout_s=10.0),
                               namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK,
                               tracing=tracing)
            counts = []
            for starts in ((10,), (40, 70, 100)):
                prepared.clear()
                runner.admit("acme", len(starts))
                job = store.create_job("acme", "tiny", staged_requests(
                    *[(list(range(i, i + 20)), 1) for i in starts]))
                runner.launch(job)
                assert (await _finished(store, job.job_id)).completed == len(starts)
                counts.append(dict(prepared))
            # prepared before launch (as an intake does, beside its commit): never again
            prepared.clear()
            staged = staged_requests((list(range(130, 150)), 1), ([-1, 2], 1))
            runner.admit("acme", 2)
            job = store.create_job("acme", "tiny", staged)
            made = [await asyncio.wrap_future(f)
                    for f in runner.prepare_soon([s.body for s in staged])]
            runner.launch(job, dict(enumerate(made)))
            done = await _finished(store, job.job_id)
            counts.append(dict(prepared))
            errors = [(r.custom_id, r.error_code) for r in store.results(job.job_id)
                      if not r.ok]
            await runner.close()
            await backend.close()
            store.close()
            return counts[0], counts[1], counts[2], (done.completed, done.failed, errors)

        single, three, given, ended = run_bounded(scenario(), 60,
                                                  "the forecast's tokenization handed on")
        assert single == {10: 1}   # a job of one request: tokenized once, by the forecast
        # the forecast tokenizes all three, then each is tokenized when dispatched, but the
        # first in dispatch order, which takes the forecast's
        assert sorted(three.values()) == [1, 2, 2] and set(three) == {40, 70, 100}
        # each once, by prepare_soon; the one it could not prepare fails as bad input
        assert given == {130: 1, -1: 1}
        assert ended == (1, 1, [("r1", "INVALID_ARGUMENT")])

    def test_each_request_is_traced_with_its_names_and_sent_as_a_batch_request(self, tmp_path, caplog):
        async def scenario() -> str:
            tel, exporter, _ = in_memory(tmp_path)
            tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                                 ServedCache("tiny", BLOCK, 300.0, 10_000)))
            tracing.chat_opening = (1, 2)   # a prompt that opens so is a chat
            backend = RecordingBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
            await backend.start()
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            runner = _runner_paths(store, backend, tracing=tracing)
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

    def test_a_prepare_bug_fails_its_request_alone_and_a_broken_job_task_fails_the_rest(self, tmp_path,
                                                                                        caplog):
        def broken_prepare(body: bytes) -> NewRequest:
            if json.loads(body)["max_tokens"] == 7:
                raise RuntimeError("tokenizer broke")
            return prepare_body(body)

        class BrokenForecast(JobTracing):
            def job_launched(self, *args, **kwargs) -> None:
                raise RuntimeError("forecast broke")

        async def scenario() -> None:
            backend = await _backend_paths()
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

def _runner_unwind(store: JobStore, backend, max_concurrent: int) -> JobRunner:
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


class TestUnwind:
    def test_closing_returns_once_every_request_in_flight_has_unwound(self, tmp_path):
        async def scenario() -> None:
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
            backend = HeldBackend()
            runner = _runner_unwind(store, backend, max_concurrent=3)
            job = _submit(store, runner, "acme", _requests(3))
            await _in_flight(backend, store, 3)
            await runner.close()
            assert backend.aborted == [("acme", 0), ("acme", 1), ("acme", 2)]
            assert backend.in_flight == set() and runner.slots_in_use() == {}
            assert store.get_job(job.job_id).state is JobState.RUNNING   # resumed on next start
            assert store.results(job.job_id) == []
            store.close()

        run_bounded(scenario(), 30, "close with requests in flight")

    def test_cancelling_one_job_leaves_the_other_s_requests_running(self, tmp_path):
        async def scenario() -> None:
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
            backend = HeldBackend()
            runner = _runner_unwind(store, backend, max_concurrent=4)
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

    def test_a_result_ready_as_its_job_is_cancelled_is_dropped_and_counted_once(self, tmp_path):
        async def scenario():
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
            backend = HeldBackend()
            runner = _runner_unwind(store, backend, max_concurrent=2)
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

    def test_a_job_whose_task_fails_mid_run_unwinds_its_requests_then_fails_them(self, tmp_path):
        async def scenario() -> None:
            store = PageFault(tmp_path / "jobs.sqlite3", lambda: 0,
                              error=sqlite3.OperationalError("disk I/O error"))
            backend = HeldBackend()
            runner = _runner_unwind(store, backend, max_concurrent=4)
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

    def test_requests_a_lost_page_left_behind_fail_so_the_job_ends(self, tmp_path):
        async def scenario() -> None:
            store = PageFault(tmp_path / "jobs.sqlite3", lambda: 0)
            runner = _runner_unwind(store, None, max_concurrent=8)
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

    def test_the_cancel_reaches_queued_requests_through_the_jobs_own_task(self, tmp_path):
        """Two of five requests hold the job's two slots when it is cancelled: the job's own task
        stops, so the three still queued never reach the backend, even once slots free up."""
        async def scenario() -> None:
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 0)
            backend = HeldBackend()
            runner = _runner_unwind(store, backend, max_concurrent=2)
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


LIMITS = """
[limits]
max_pending_per_tenant = 64
max_pending_total = 64
max_concurrent = 16
"""  # Generate calls share max_concurrent: all 16 streams reach the worker

LONG = 1500  # tokens each cancelled stream asks for: seconds of decoding on this model

def _prompt(seed: int, n: int = 256) -> list[int]:
    return [100 + (seed * 131 + i * 7) % 800 for i in range(n)]

def _ttft(client, rid: str, seed: int) -> float:
    """The worker's TTFT of a fresh 256-token prompt (queueing on the worker included)."""
    for event in client.generate(token_request(rid, _prompt(seed), 1)):
        if event.WhichOneof("event") == "result":
            assert event.result.ok, event.result.error_message
            return event.result.ttft_s
    raise AssertionError(f"{rid}: no result")

def _engine(harness, fn):
    async def ask():
        (worker,) = await harness.backend.workers()
        return await harness.backend.runtime.call(worker.worker_id, fn)
    return harness.run(ask())

def _stats(harness):
    async def ask():
        (worker,) = await harness.backend.workers()
        return await harness.backend.runtime.stats(worker.worker_id)
    return harness.run(ask())

def _wait_idle(harness, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _engine(harness, lambda engine: engine.busy) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _engine(harness, lambda engine: engine.busy)


class TestCancel:
    def test_cancelled_streams_stop_decoding_and_the_next_request_does_not_wait(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(ACME_CONFIG + LIMITS)
        with running_frontend(tmp_path, tiny_model(), workers=1) as harness, \
                harness.client("acme") as client, grpc.insecure_channel(harness.address) as channel:
            before = _engine(harness, lambda engine: engine.written_tokens())
            stub = pb_grpc.GenerateStub(channel)
            auth = (("authorization", "Bearer key-acme"),)
            streams = []
            for i in range(16):  # four decode (the batch is full); twelve wait behind them
                streams.append(stub.Generate(pb.GenerateRequest(request=token_request(
                    f"long-{i}", _prompt(100 + i), LONG)), metadata=auth))
                if i < 4:
                    assert next(streams[-1]).WhichOneof("event") == "delta"
            deadline = time.monotonic() + 30.0
            while _stats(harness).running < 16 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _stats(harness).running == 16
            written = _engine(harness, lambda engine: engine.written_tokens())
            # The twelve waiting first, and only once the engine has let them go the four
            # decoding: a seat a cancelled decode frees is then never given to a waiting
            # request whose own cancel is still on its way (it would prefill and write).
            for stream in streams[4:]:
                stream.cancel()
            deadline = time.monotonic() + 30.0
            while _stats(harness).running > 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _stats(harness).running == 4
            for stream in streams[:4]:
                stream.cancel()

            assert _wait_idle(harness, 30.0), "cancelled requests still run"
            # No output block of theirs was ever written: their decode stopped where it was.
            # (The four prompts' blocks were written at their first token; 12 never started.)
            now = _engine(harness, lambda engine: engine.written_tokens())
            assert now - before == written - before == 4 * 256
            # nothing left in the engine's batch or queue for the next request to wait behind
            assert _stats(harness).running == 0
            assert _ttft(client, "after", 50) > 0

    def test_a_cancelled_job_a_call_deadline_and_the_request_timeout_abort_their_requests(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(
            ACME_CONFIG + LIMITS.replace("max_concurrent = 16", "max_concurrent = 8")
            + "request_timeout_s = 1.0\n")
        with running_frontend(tmp_path, tiny_model(), workers=1) as harness, \
                harness.client("acme") as client:
            # CancelJob on requests already running
            job = client.submit([token_request(f"job-{i}", _prompt(i), LONG) for i in range(4)])
            deadline = time.monotonic() + 30.0
            while _stats(harness).running < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _stats(harness).running == 4
            assert client.cancel(job.job_id).state == "cancelled"
            assert _wait_idle(harness), "the cancelled job's requests still run"

            # a Generate call's deadline
            try:
                for _ in client.generate(token_request("deadline", _prompt(7), LONG), timeout_s=0.5):
                    pass
            except OrchardError as exc:
                assert exc.code == "DEADLINE_EXCEEDED"
            else:
                raise AssertionError("a 1,500-token request finished within 0.5 s")
            assert _wait_idle(harness), "the request past its deadline still runs"

            # [limits] request_timeout_s on a job's request
            served = _stats(harness).requests_served
            job = client.submit([token_request("slow", _prompt(8), LONG)])
            job = client.wait(job.job_id, poll_s=0.05, timeout_s=60)
            (result,) = list(client.results(job.job_id))
            assert result.error_code == "DEADLINE_EXCEEDED"
            assert _wait_idle(harness), "the request past request_timeout_s still runs"
            assert _stats(harness).requests_served == served
