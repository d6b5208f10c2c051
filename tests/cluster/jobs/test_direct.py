"""Requests outside any job (``runner.direct``: what ``Generate`` and the HTTP completions
run): streamed in one of the runner's slots with the tenant's namespace and block hashes,
stopped at the earlier of the two deadlines, counted by the runner's admission.

Over the in-process backend and a forged tiny model; every wait is bounded in wall-clock time
(``tests.bounded``).
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.backend.local import LocalBackend
from cluster.backend.protocol import GenerateOutcome, TokenChunk
from cluster.jobs.admission import Overloaded
from cluster.jobs.quotas import QuotaExceeded, Quotas, TenantQuota
from cluster.jobs.runner import JobRunner, RunnerLimits
from cluster.jobs.shedding import Late, QueueState, Shed
from cluster.jobs.store import JobStore, NewRequest, StoredResult
from cluster.telemetry.job_tracing import JobTracing
from cluster.telemetry.observe import RequestObserver, ServedCache
from cluster.telemetry.prometheus import ScrapeState, ServingMetrics
from router.cost import PriceTable
from router.kv.key import Namespace, hash_blocks
from tests.conftest import Clock
from tests.support.bounded import run_bounded
from tests.support.forged_models import tiny_model
from tests.support.runner_bodies import prepare_body, staged_requests
from tests.support.telemetry_factories import in_memory, result
from workers.engine.engine import EngineConfig
from workers.messages import LookupOutcome, Priority, SamplingParams

BLOCK = 16
NS = Namespace("acme", "tiny")


def _runner(store: JobStore, backend, timeout_s: float = 10.0, pending: int = 1000,
            concurrent: int = 2) -> JobRunner:
    return JobRunner(store, backend, prepare_body,
                     RunnerLimits(max_concurrent=concurrent, max_pending_per_tenant=pending,
                                  max_pending_total=pending, request_timeout_s=timeout_s),
                     namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)


def _request(prompt: tuple[int, ...], max_tokens: int, custom_id: str = "") -> NewRequest:
    return NewRequest(custom_id=custom_id, prompt=prompt,
                      sampling=SamplingParams(max_tokens=max_tokens))


class StreamRecorder(LocalBackend):
    """The in-process backend, keeping each streamed request and its block hashes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.streams: list[tuple] = []

    def stream(self, request, block_hashes):
        self.streams.append((request, list(block_hashes)))
        return super().stream(request, block_hashes)


class SilentStream:
    """A backend whose stream never yields (a worker that stopped answering)."""

    async def stream(self, request, block_hashes):
        await asyncio.Event().wait()
        yield  # an async generator


def test_a_direct_request_streams_in_a_slot_with_its_tenants_namespace_and_hashes(tmp_path):
    async def scenario() -> None:
        backend = StreamRecorder(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, backend)
        prompt = tuple(range(50))
        items, slots = [], []
        async for item in runner.direct.stream("acme", _request(prompt, 3, "conv-1")):
            items.append(item)
            slots.append(runner.slots_in_use())
        assert runner.slots_in_use() == {}
        assert slots == [{"acme": 1}] * len(items)  # the slot is held throughout
        [(sent, hashes)] = backend.streams
        assert (sent.namespace, sent.prompt, sent.batch) == (NS, prompt, False)
        assert hashes == hash_blocks(prompt, BLOCK, NS) and len(hashes) == 3
        chunks, result = items[:-1], items[-1]
        assert {type(c) for c in chunks} == {TokenChunk} and type(result) is StoredResult
        assert sent.request_id.startswith("gen-") and result.request_id == sent.request_id
        assert (result.index, result.custom_id, result.ok) == (0, "conv-1", True)
        assert result.output_tokens == tuple(t for c in chunks for t in c.token_ids)
        assert len(result.output_tokens) == 3
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a direct request")


@pytest.mark.parametrize("timeout_s, remaining_s", [(0.05, None), (60.0, 0.05), (60.0, -1.0)])
def test_a_direct_request_stops_at_the_earlier_of_its_two_deadlines(tmp_path, timeout_s,
                                                                    remaining_s):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, SilentStream(), timeout_s=timeout_s)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async for _ in runner.direct.stream("acme", _request((1, 2, 3), 1), (),
                                                remaining_s):
                pass
        assert loop.time() - start < 30.0  # never the 60 s request timeout
        assert runner.slots_in_use() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 45, "a direct request's deadline")


def test_a_direct_request_is_admitted_for_as_long_as_its_block_runs(tmp_path):
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = _runner(store, SilentStream(), pending=2)
        with runner.direct.admitted("acme"):
            assert runner.pending() == {"acme": 1}
            with runner.direct.admitted("acme"):
                assert runner.pending() == {"acme": 2}
                with pytest.raises(Overloaded, match="tenant 'acme' has 2 requests pending"):
                    with runner.direct.admitted("acme"):
                        pass
                assert runner.pending() == {"acme": 2}  # the refused one counted nothing
        assert runner.pending() == {}
        with pytest.raises(KeyError):
            with runner.direct.admitted("acme"):
                raise KeyError("a failure inside the block")
        assert runner.pending() == {}
        runner.admit("acme", 2)  # a job's requests count against the same limit
        with pytest.raises(Overloaded):
            with runner.direct.admitted("acme"):
                pass
        runner.release("acme", 2)
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a direct request's admission")


def test_a_caller_that_leaves_mid_stream_is_traced_with_its_prompt(tmp_path):
    """The caller stops reading after the first chunk: the request span still says how many
    prompt tokens were admitted, that the client disconnected, and is marked CANCELLED."""
    from cluster.telemetry import attrs as A
    from cluster.telemetry.job_tracing import JobTracing
    from cluster.telemetry.observe import RequestObserver, ServedCache
    from router.cost import PriceTable
    from tests.support.telemetry_factories import in_memory

    async def scenario() -> None:
        tel, exporter, _ = in_memory(tmp_path)
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", BLOCK, 300.0, 10_000)))
        backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
        await backend.start()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = JobRunner(store, backend, prepare_body,
                           RunnerLimits(max_concurrent=2, max_pending_per_tenant=10,
                                        max_pending_total=10, request_timeout_s=10.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK,
                           tracing=tracing)
        stream = runner.direct.stream("acme", _request(tuple(range(40)), 1500))
        assert type(await anext(stream)) is TokenChunk
        await stream.aclose()
        [span] = [s for s in exporter.get_finished_spans()
                  if s.attributes.get(A.SPAN_KIND) == "request"]
        assert span.attributes[A.GEN_AI_INPUT_TOKENS] == 40
        assert span.attributes[A.CLIENT_DISCONNECTED] is True
        assert span.attributes[A.ERROR_TYPE] == "CANCELLED"
        await runner.close()
        await backend.close()
        store.close()

    run_bounded(scenario(), 30, "a caller that leaves")


# ---------------------------------------------------------------- overload


class HeldStreams:
    """A backend whose streams each wait until the test ends them with a TTFT of its choosing:
    the queue a test builds is the queue the runner sees."""

    def __init__(self) -> None:
        self.open: list[asyncio.Future] = []

    async def stream(self, request, block_hashes):
        ended = asyncio.get_running_loop().create_future()
        self.open.append(ended)
        ttft_s = await ended
        made = result(request.request_id, len(request.prompt), 0, 0, "w0", LookupOutcome.MISS)
        yield GenerateOutcome(dataclasses.replace(made, ttft_s=ttft_s), None, 1, "w0")

    async def generate(self, request, block_hashes):
        await asyncio.Event().wait()  # a job's request holds its slot until cancelled


async def _settle(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached: {what}")


async def _run_direct(runner: JobRunner, remaining_s: float | None = None,
                      priority: Priority = Priority.INTERACTIVE) -> list:
    with runner.direct.admitted("acme", priority, remaining_s) as ticket:
        return [item async for item in runner.direct.stream(
            "acme", _request((1, 2, 3), 2), remaining_s=remaining_s, priority=priority,
            ticket=ticket)]


def _refused(reader) -> dict[tuple[str, str], int]:
    counts = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "orchard.requests.refused":
                    for point in metric.data.data_points:
                        key = (point.attributes["tenant"], point.attributes["reason"])
                        counts[key] = point.value
    return counts


def _scraped_refusals(metrics: ServingMetrics) -> dict[tuple[str, str], float]:
    """``orchard_requests_refused_total`` on /metrics, by (tenant, reason)."""
    body = metrics.render(ScrapeState({}, {}, {}))[0].decode()
    return {(s.labels["tenant"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(body) for s in family.samples
            if s.name == "orchard_requests_refused_total"}


def test_an_interactive_request_behind_a_queue_is_shed_with_the_exact_retry_after(tmp_path):
    """Measured: a request held its slot 2 s and had its first token 0.5 s after its worker
    got it. Queue: both slots held, 3 interactive requests waiting. A new request with a 2 s
    deadline would wait (3 + 1) x 2 / 2 = 4 s for a slot, first token at 4.5 s: shed, retry
    after ceil(4.5 - 2) = 3 s. A batch request in the same state is admitted and queued, and
    so is a batch job: batch work is never shed."""
    async def scenario() -> None:
        clock = Clock()
        tel, _, reader = in_memory(tmp_path)
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", BLOCK, 300.0, 10_000)),
                             ServingMetrics(lambda usage: 1.0))
        backend = HeldStreams()
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = JobRunner(store, backend, prepare_body,
                           RunnerLimits(2, 1000, 1000, 60.0), tracing=tracing, clock=clock,
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
        first = asyncio.create_task(_run_direct(runner))
        await _settle(lambda: len(backend.open) == 1, "the first request on the backend")
        clock.now = 2.0
        backend.open.pop().set_result(0.5)
        assert type((await first)[-1]) is StoredResult
        queued = [asyncio.create_task(_run_direct(runner)) for _ in range(5)]
        await _settle(lambda: runner.direct.queue() == QueueState(2, 2, 3), "3 waiting")
        with pytest.raises(Shed) as caught:
            with runner.direct.admitted("acme", Priority.INTERACTIVE, remaining_s=2.0):
                pass
        assert caught.value.retry_after_s == 3
        assert runner.pending() == {"acme": 5}  # the refused one counted nothing
        batch = asyncio.create_task(_run_direct(runner, 2.0, Priority.BATCH))
        runner.admit("acme", 2)
        job = store.create_job("acme", "tiny", staged_requests(([1, 2], 1), ([3, 4], 1)))
        runner.launch(job)
        await _settle(lambda: runner.pending() == {"acme": 8}, "the batch work accepted")
        assert _refused(reader) == {("acme", "shed"): 1}
        assert _scraped_refusals(tracing.metrics) == {("acme", "shed"): 1}
        for task in (*queued, batch):
            task.cancel()
        await asyncio.gather(*queued, batch, return_exceptions=True)
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "shed with the exact retry-after")


class Alarm:
    """The first-token bound's sleep: it records what it was asked to wait, and rings when
    the test says."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.ring = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self.ring.wait()


def _late_runner(tmp_path, backend, clock, alarm, reader=None):
    tracing = None
    if reader is not None:
        tel, reader_ = reader
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", BLOCK, 300.0, 10_000)),
                             ServingMetrics(lambda usage: 1.0))
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
    runner = JobRunner(store, backend, prepare_body,
                       RunnerLimits(2, 1000, 1000, 60.0, max_ttft_s=2.0), tracing=tracing,
                       clock=clock, sleep=alarm, namespace=lambda t: Namespace(t, "tiny"),
                       block_size=BLOCK)
    return store, runner


def test_an_admitted_request_without_its_first_token_by_its_bound_is_aborted_and_refused(
        tmp_path):
    """``max_ttft_s`` 2: a request admitted at 0 must have its first token by 2. Its worker
    has not answered when the alarm (asked for 2 s) rings: the request is aborted on its
    worker and refused, ``Late`` (RESOURCE_EXHAUSTED) with a Retry-After of 1 (nothing
    measured yet), counted as reason ``late``; its slot is free again. A batch request is
    never bound: no alarm is asked for it."""
    async def scenario() -> None:
        clock, alarm = Clock(), Alarm()
        tel, _, reader = in_memory(tmp_path)
        backend = HeldStreams()
        store, runner = _late_runner(tmp_path, backend, clock, alarm, (tel, reader))
        late = asyncio.create_task(_run_direct(runner))
        await _settle(lambda: len(backend.open) == 1 and alarm.asked, "on its worker")
        assert alarm.asked == [2.0]
        alarm.ring.set()
        with pytest.raises(Late) as caught:
            await late
        assert caught.value.retry_after_s == 1
        assert "its first token had not come within its 2.00 s bound" in str(caught.value)
        assert backend.open[0].cancelled()  # aborted on its worker
        assert runner.direct.queue() == QueueState(2, 0, 0)
        assert runner.pending() == {}
        assert _refused(reader) == {("acme", "late"): 1}
        batch = asyncio.create_task(_run_direct(runner, None, Priority.BATCH))
        await _settle(lambda: len(backend.open) == 2, "the batch request on its worker")
        backend.open[1].set_result(0.5)
        assert type((await batch)[-1]) is StoredResult
        assert alarm.asked == [2.0]
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a first token past its bound")


def test_a_request_whose_slot_comes_too_late_for_its_first_token_is_refused_unsent(tmp_path):
    """Measured: a request held its slot 2 s and had its first token 0.5 s after its worker
    got it (served before its alarm rang: no refusal). Both slots then held, a request admitted
    at 2.0 (predicted first token at 2.0 + 1 + 0.5, within its bound of 4.0) gets its slot at
    3.6: 3.6 + 0.5 > 4.0, so it is refused before it is sent to any worker."""
    async def scenario() -> None:
        clock, alarm = Clock(), Alarm()
        backend = HeldStreams()
        store, runner = _late_runner(tmp_path, backend, clock, alarm)
        first = asyncio.create_task(_run_direct(runner))
        await _settle(lambda: len(backend.open) == 1, "the first request on its worker")
        clock.now = 2.0
        backend.open[0].set_result(0.5)
        assert type((await first)[-1]) is StoredResult  # in time: the alarm never rang
        holders = [asyncio.create_task(_run_direct(runner)) for _ in range(2)]
        await _settle(lambda: len(backend.open) == 3, "both slots held")
        third = asyncio.create_task(_run_direct(runner))
        await _settle(lambda: runner.direct.queue() == QueueState(2, 2, 1), "one waiting")
        clock.now = 3.6
        backend.open[1].set_result(0.5)
        with pytest.raises(Late) as caught:
            await third
        assert "it got its slot too late" in str(caught.value)
        assert caught.value.retry_after_s == 1
        assert len(backend.open) == 3  # never sent
        assert type((await holders[0])[-1]) is StoredResult
        holders[1].cancel()
        await asyncio.gather(holders[1], return_exceptions=True)
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "a slot too late for its first token")


def test_an_interactive_jobs_requests_in_their_slots_hide_no_direct_request_from_the_shedder(
        tmp_path):
    """Both slots held by an interactive job's requests; 3 interactive Generate calls wait
    behind them: a new one finds those 3 ahead of it, as it would behind any holder."""
    async def scenario() -> None:
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = JobRunner(store, HeldStreams(), prepare_body,
                           RunnerLimits(2, 1000, 1000, 60.0),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
        runner.admit("acme", 3)
        runner.launch(store.create_job("acme", "tiny", staged_requests(
            ([1, 2], 1), ([3, 4], 1), ([5, 6], 1)), Priority.INTERACTIVE))
        await _settle(lambda: runner.direct.queue() == QueueState(2, 2, 0), "the job's 2")
        waiting = [asyncio.create_task(_run_direct(runner)) for _ in range(3)]
        await _settle(lambda: runner.direct.queue() == QueueState(2, 2, 3), "3 waiting")
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert runner.direct.queue() == QueueState(2, 2, 0)
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "an interactive job's slots and the shedder's queue")


def test_quota_refusals_are_counted_by_reason(tmp_path):
    async def scenario() -> None:
        tel, _, reader = in_memory(tmp_path)
        tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                             ServedCache("tiny", BLOCK, 300.0, 10_000)),
                             ServingMetrics(lambda usage: 1.0))
        quota = {"acme": TenantQuota(requests_in_flight=1, tokens_per_minute=10)}
        store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
        runner = JobRunner(store, HeldStreams(), prepare_body,
                           RunnerLimits(2, 1000, 1000, 60.0), tracing=tracing,
                           quotas=Quotas(lambda: quota, Clock()),
                           namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
        with runner.direct.admitted("acme"):
            for _ in range(2):
                with pytest.raises(QuotaExceeded):
                    with runner.direct.admitted("acme"):
                        pass
            with pytest.raises(QuotaExceeded) as caught:  # 3 + 8 tokens > 10 a minute
                async for _ in runner.direct.stream("acme", _request((1, 2, 3), 8)):
                    pass
            assert caught.value.retry_after_s == 60
        assert _refused(reader) == {("acme", "requests_in_flight"): 2,
                                    ("acme", "tokens_per_minute"): 1}
        assert _scraped_refusals(tracing.metrics) == {("acme", "requests_in_flight"): 2,
                                                      ("acme", "tokens_per_minute"): 1}
        assert runner.pending() == {}
        await runner.close()
        store.close()

    run_bounded(scenario(), 30, "quota refusals counted")


# ---------------------------------------------------- what a direct request carries


class RecordingStreams(HeldStreams):
    """``HeldStreams`` that keeps each request it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []

    async def stream(self, request, block_hashes):
        self.sent.append(request)
        async for item in super().stream(request, block_hashes):
            yield item


def _traced_runner(tmp_path, backend):
    """A runner over ``backend`` whose requests are traced into memory: (store, runner, the
    span exporter)."""
    tel, exporter, _ = in_memory(tmp_path)
    tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                         ServedCache("tiny", BLOCK, 300.0, 10_000)))
    store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
    runner = JobRunner(store, backend, prepare_body, RunnerLimits(2, 10, 10, 10.0),
                       tracing=tracing, namespace=lambda t: Namespace(t, "tiny"),
                       block_size=BLOCK)
    return store, runner, exporter


class TestWhatADirectRequestCarries:
    def test_its_salt_its_trace_and_the_callers_trace_reach_the_worker(self, tmp_path):
        """A request with a cache salt, sent with a caller's ``traceparent``: its namespace
        is the tenant's salted, its request span joins the caller's trace, and the worker is
        sent that span's context."""
        from cluster.telemetry import attrs as A

        caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        metadata = (("traceparent", f"00-{caller_trace}-00f067aa0ba902b7-01"),)

        async def scenario():
            backend = RecordingStreams()
            store, runner, exporter = _traced_runner(tmp_path, backend)
            request = dataclasses.replace(_request((1, 2, 3), 2, "c1"), cache_salt="s1")
            run = asyncio.create_task(_items(runner.direct.stream("acme", request, metadata)))
            await _settle(lambda: backend.open, "on its worker")
            backend.open[0].set_result(0.5)
            items = await run
            spans = [s for s in exporter.get_finished_spans()
                     if s.attributes.get(A.SPAN_KIND) == "request"]
            await runner.close()
            store.close()
            return backend.sent, items, spans

        (sent,), items, (span,) = run_bounded(scenario(), 30, "a salted, traced request")
        assert sent.namespace == dataclasses.replace(NS, salt="s1")
        assert format(span.context.trace_id, "032x") == caller_trace
        context = dict(sent.trace_context)
        assert context["traceparent"].split("-")[1:3] == [
            caller_trace, format(span.context.span_id, "016x")]
        assert (items[-1].index, items[-1].custom_id) == (0, "c1")

    def test_a_diagnosed_request_is_result_0_with_its_miss_cause(self, tmp_path):
        """``diagnose``: the result is the request's (index 0) and its diagnosis names the
        observer's miss cause (a prompt seen for the first time: ``first_sight``)."""
        async def scenario():
            backend = HeldStreams()
            store, runner, _ = _traced_runner(tmp_path, backend)
            request = dataclasses.replace(_request(tuple(range(40)), 2, "d1"), diagnose=True)
            run = asyncio.create_task(_items(runner.direct.stream("acme", request)))
            await _settle(lambda: backend.open, "on its worker")
            backend.open[0].set_result(0.5)
            items = await run
            await runner.close()
            store.close()
            return items[-1]

        last = run_bounded(scenario(), 30, "a diagnosed request")
        assert (last.index, last.custom_id) == (0, "d1")
        assert (last.diagnosis.prompt_tokens, last.diagnosis.reason) == (40, "first_sight")

    def test_its_slot_is_its_priority_s_and_its_time_there_is_measured(self, tmp_path):
        """An interactive request holds an interactive slot, a batch one a batch slot; the
        first slot's time on the runner's clock (2.5 s) is what the shedder measured, read
        back as the Retry-After (its ceiling, 3 s) of a refusal for requests in flight."""
        async def scenario():
            clock = Clock(100.0)
            backend = HeldStreams()
            quota = {"acme": TenantQuota(requests_in_flight=1)}
            store = JobStore(tmp_path / "jobs.sqlite3", lambda: 1_000)
            runner = JobRunner(store, backend, prepare_body, RunnerLimits(2, 10, 10, 10.0),
                               clock=clock, quotas=Quotas(lambda: quota, clock),
                               namespace=lambda t: Namespace(t, "tiny"), block_size=BLOCK)
            held, retry = [], []
            for priority, took in ((Priority.INTERACTIVE, 2.5), (Priority.BATCH, 0.25)):
                run = asyncio.create_task(_run_direct(runner, None, priority))
                await _settle(lambda: len(backend.open) == len(held) + 1, "on its worker")
                held.append({p: g.in_use for p, g in runner.slot_gauges().items()})
                clock.now += took
                backend.open[-1].set_result(0.5)
                await run
                with runner.direct.admitted("acme", Priority.BATCH):
                    with pytest.raises(QuotaExceeded) as caught:
                        with runner.direct.admitted("acme", Priority.BATCH):
                            pass
                retry.append(caught.value.retry_after_s)
            await runner.close()
            store.close()
            return held, retry

        held, retry = run_bounded(scenario(), 30, "slots by priority")
        assert held == [{"interactive": 1, "batch": 0}, {"interactive": 0, "batch": 1}]
        assert retry[0] == 3   # 2.5 s measured
        assert retry[1] == 2   # 0.7 x 2.5 + 0.3 x 0.25 = 1.825 s (workers.rates.EMA_WEIGHT)

    def test_a_bound_already_passed_when_the_slot_comes_waits_no_time(self, tmp_path):
        """Admitted at 0 with a 2 s bound, its slot at 3 s (no TTFT predicted yet): the alarm
        is asked for 0 s, not for a negative time nor any time at all."""
        async def scenario():
            clock, alarm = Clock(), Alarm()
            backend = HeldStreams()
            store, runner = _late_runner(tmp_path, backend, clock, alarm)
            with runner.direct.admitted("acme") as ticket:
                clock.now = 3.0
                run = asyncio.create_task(_items(runner.direct.stream(
                    "acme", _request((1, 2, 3), 2), ticket=ticket)))
                await _settle(lambda: alarm.asked, "the alarm asked")
                asked = list(alarm.asked)
                alarm.ring.set()
                with pytest.raises(Late):
                    await run
            await runner.close()
            store.close()
            return asked

        assert run_bounded(scenario(), 30, "a bound already passed") == [0.0]


async def _items(stream) -> list:
    return [item async for item in stream]
