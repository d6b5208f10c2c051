"""``cluster.jobs.dispatch``: one request on the backend within its deadline, the no-worker
backoff, a stream and its deadline, and the stored result of an outcome.

Most tests run on backends of a few lines and a clock that moves only when the backoff pauses
(no engine, no wall-clock time): each runs in about a millisecond, so under mutmut (fastest
first) a change that breaks ``dispatch`` outright fails here at once, before a runner's test
waits on a job that never ends. The bound each call runs under is read where ``dispatch``
enters it (``bounds``: each ``asyncio.timeout``'s delay, then the real timeout), so the
deadline's arithmetic is checked exactly without waiting for it. The rest run over the
in-process backend and a forged tiny model, and one waits for a real 0.05 s deadline.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from cluster.backend.local import LocalBackend
from cluster.backend.protocol import GenerateOutcome, NoWorkerAvailable, TokenChunk
from cluster.jobs.dispatch import LoopClock, dispatch, dispatch_stream, error_of, result_of
from cluster.jobs.store import PendingRequest, StoredResult
from router.kv.key import Namespace, hash_blocks
from tests.support.bounded import record_timeouts, run_bounded, within
from tests.support.forged_models import tiny_model
from tests.support.requests import generate_request
from tests.support.telemetry_factories import T0, result
from workers.engine.engine import EngineConfig
from workers.messages import CacheControls, GenerateRequest, LookupOutcome, SamplingParams

BLOCK = 16
NS = Namespace("acme", "tiny")
ASKED_NOTHING = GenerateRequest("r", Namespace("acme", "tiny"), (), SamplingParams(4))
OUTCOME = GenerateOutcome(result("r", 40, 16, 16, "w", LookupOutcome.PARTIAL), None, 1, "w")
HASHES = (11, 12)


async def _backend_paths() -> LocalBackend:
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


class SilentBackend:
    """A backend whose call never ends (a worker that stopped answering)."""

    async def generate(self, request, block_hashes):
        await asyncio.Event().wait()


class PausedClock:
    """Time that moves only when the backoff pauses; the ``hold_at``-th pause waits for
    ``release`` (and says so on ``holding``)."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.t = 0.0
        self.pauses: list[float] = []
        self.hold_at = hold_at
        self.holding, self.release = asyncio.Event(), asyncio.Event()

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        if len(self.pauses) == self.hold_at:
            self.holding.set()
            await self.release.wait()
        self.t += seconds
        await asyncio.sleep(0)


async def no_worker_backend() -> CountingBackend:
    """A started backend whose one worker is drained: every call finds no worker."""
    backend = CountingBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=BLOCK))
    await backend.start()
    await backend.drain("local-0")
    return backend


class Refusing:
    """Finds no worker for the first ``refusals`` calls, then answers ``OUTCOME``; keeps each
    call's request, block hashes and the clock's time."""

    def __init__(self, clock: PausedClock | LoopClock, refusals: int) -> None:
        self.clock, self.refusals = clock, refusals
        self.calls: list[tuple[GenerateRequest, object, float]] = []

    async def generate(self, request, block_hashes):
        self.calls.append((request, block_hashes, self.clock.now()))
        if len(self.calls) <= self.refusals:
            raise NoWorkerAvailable(f"no worker for call {len(self.calls)}")
        return OUTCOME


class Streaming:
    """Streams ``items``, keeping the call's arguments, how many it yielded, and whether the
    stream was closed (a closed stream is aborted on the worker)."""

    def __init__(self, items: list) -> None:
        self.items, self.calls, self.yielded, self.closed = items, [], 0, False

    async def stream(self, request, block_hashes):
        self.calls.append((request, block_hashes))
        try:
            for item in self.items:
                self.yielded += 1
                yield item
        finally:
            self.closed = True


@pytest.fixture
def bounds(monkeypatch) -> list:
    """The delay of each ``asyncio.timeout`` entered (by ``dispatch``: one per try), in order;
    the real timeout runs under it."""
    return record_timeouts(monkeypatch)


def _run(scenario):
    return run_bounded(scenario, 10, "a dispatch on a fake backend")


class TestTheCall:
    def test_the_request_and_its_hashes_reach_the_backend_and_its_outcome_is_returned(self, bounds):
        clock = PausedClock()
        backend = Refusing(clock, refusals=0)
        request = generate_request("a", (1, 2, 3), 1, ns=NS)
        outcome = _run(dispatch(backend, request, HASHES, 2.0, clock))
        assert outcome is OUTCOME
        assert backend.calls == [(request, HASHES, 0.0)] and clock.pauses == []
        assert bounds == [2.0]

    def test_each_try_runs_under_the_time_left_to_the_deadline(self, bounds):
        clock = PausedClock()
        backend = Refusing(clock, refusals=2)
        _run(dispatch(backend, generate_request("a", (1, 2, 3), 1, ns=NS), HASHES, 2.0, clock))
        assert [at for _, _, at in backend.calls] == [0.0, 0.05, 0.05 + 0.1]
        assert bounds == [2.0, 2.0 - 0.05, 2.0 - (0.05 + 0.1)]

    def test_a_try_with_less_than_a_millisecond_left_still_gets_a_millisecond(self, bounds):
        clock = PausedClock()   # 0.5 ms left after the first pause
        outcome = _run(dispatch(Refusing(clock, refusals=1), ASKED_NOTHING, (), 0.0505, clock))
        assert outcome is OUTCOME and bounds == [0.0505, 0.001]

    def test_without_a_clock_the_deadline_is_on_the_loop_s_time(self, bounds):
        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            backend = Refusing(LoopClock(), refusals=0)
            before = loop.time()
            assert await dispatch(backend, ASKED_NOTHING, HASHES, 0.5) is OUTCOME
            [(_, _, at)] = backend.calls
            assert before <= at <= loop.time()
            assert 0.5 - (loop.time() - before) <= bounds[0] <= 0.5 and len(bounds) == 1

        _run(scenario())

    def test_the_loop_clock_sleeps_on_the_loop(self):
        async def scenario() -> None:
            await LoopClock().sleep(0)   # one turn of the loop

        _run(scenario())


class TestBackoff:
    def test_no_worker_is_retried_past_the_end_of_the_schedule_until_the_deadline(self, bounds):
        clock = PausedClock()
        backend = Refusing(clock, refusals=100)
        with pytest.raises(NoWorkerAvailable, match="^no worker for call 9$"):
            _run(dispatch(backend, ASKED_NOTHING, HASHES, 5.0, clock))
        # tries at 0, 0.05, 0.15, 0.35, 0.85, 1.85, 2.85, 3.85 and 4.85 s: the schedule's last
        # pause (1 s) repeats; the next try would be at 5.85 s, past the deadline
        assert clock.pauses == [0.05, 0.1, 0.2, 0.5, 1.0, 1.0, 1.0, 1.0]
        assert len(backend.calls) == 9 and len(bounds) == 9
        assert clock.t == pytest.approx(4.85, abs=1e-9)

    def test_a_worker_found_during_the_backoff_takes_the_request(self):
        clock = PausedClock()
        backend = Refusing(clock, refusals=3)
        request = generate_request("b", (1, 2, 3), 2, ns=NS)
        assert _run(dispatch(backend, request, HASHES, 10.0, clock)) is OUTCOME
        assert clock.pauses == [0.05, 0.1, 0.2]
        assert [(r, h) for r, h, _ in backend.calls] == [(request, HASHES)] * 4

    def test_a_pause_that_would_end_exactly_at_the_deadline_is_not_taken(self):
        clock = PausedClock()
        backend = Refusing(clock, refusals=100)
        with pytest.raises(NoWorkerAvailable, match="^no worker for call 2$"):
            _run(dispatch(backend, ASKED_NOTHING, HASHES, 0.05 + 0.1, clock))
        assert (len(backend.calls), clock.pauses) == (2, [0.05])


class TestStream:
    def test_a_stream_yields_the_backend_s_items_in_order_under_its_deadline(self, bounds):
        async def scenario() -> list:
            return [item async for item in dispatch_stream(backend, ASKED_NOTHING, HASHES, 3.0)]

        items = [TokenChunk("r", (1,), "a"), TokenChunk("r", (2, 3), "bc"), OUTCOME]
        backend = Streaming(items)
        assert _run(scenario()) == items
        assert backend.calls == [(ASKED_NOTHING, HASHES)] and bounds == [3.0]
        assert backend.closed

    def test_a_stream_left_early_is_closed_on_the_backend_at_once(self):
        async def scenario() -> None:
            async with contextlib.aclosing(
                    dispatch_stream(backend, ASKED_NOTHING, HASHES, 3.0)) as items:
                async for _ in items:
                    break
            assert (backend.yielded, backend.closed) == (1, True)

        backend = Streaming([TokenChunk("r", (1,), "a"), TokenChunk("r", (2,), "b"), OUTCOME])
        _run(scenario())


class TestOverTheInProcessBackend:
    def test_no_worker_is_retried_on_the_backoff_schedule_until_the_deadline(self):
        async def scenario() -> None:
            backend = await no_worker_backend()
            clock = PausedClock()
            with pytest.raises(NoWorkerAvailable):
                await dispatch(backend, generate_request("a", (1, 2, 3), 1, ns=NS), (), 2.0, clock)
            # tries at 0, 0.05, 0.15, 0.35, 0.85 and 1.85 s; the next pause (1 s) passes the
            # deadline, so it gives up at once rather than sleep past it
            assert backend.calls == 6 and clock.pauses == [0.05, 0.1, 0.2, 0.5, 1.0]
            assert clock.t == pytest.approx(1.85)
            await backend.scale(1)     # a worker joins during the backoff: the request runs there
            await backend.drain("local-1")
            backend.calls = 0
            clock = PausedClock(hold_at=3)
            waiting = asyncio.ensure_future(
                dispatch(backend, generate_request("b", (1, 2, 3), 2, ns=NS), (), 10.0, clock))
            await clock.holding.wait()  # tried at 0, 0.05 and 0.15 s, in its third pause
            assert backend.calls == 3
            await backend.scale(1)
            clock.release.set()
            outcome = await waiting
            assert (outcome.worker_id, len(outcome.result.output_tokens)) == ("local-2", 2)
            assert backend.calls == 4
            await backend.close()

        run_bounded(scenario(), 30, "the no-worker backoff")

    def test_a_pause_that_would_end_at_the_deadline_is_not_taken(self):
        async def scenario() -> None:
            backend = await no_worker_backend()
            clock = PausedClock()
            # tried at 0 and 0.05 s; the next pause (0.1 s) would end exactly at the deadline,
            # when no time is left for a third try: it gives up instead of sleeping
            with pytest.raises(NoWorkerAvailable):
                await dispatch(backend, generate_request("a", (1, 2, 3), 1, ns=NS), (),
                               0.05 + 0.1, clock)
            assert (backend.calls, clock.pauses) == (2, [0.05])
            await backend.close()

        run_bounded(scenario(), 30, "the no-worker backoff at its deadline")

    def test_a_request_gets_its_deadline_and_not_a_moment_more(self):
        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            call = asyncio.ensure_future(
                dispatch(SilentBackend(), generate_request("x", (1, 2, 3), 1, ns=NS), (), 0.05))
            await within(call.done, 0.5, "a request with a 0.05 s deadline ended")
            with pytest.raises(TimeoutError):
                await call
            assert 0.05 <= loop.time() - start < 0.5

        run_bounded(scenario(), 30, "a request's deadline")

    def test_a_stream_yields_chunks_then_its_outcome_and_stops_at_its_deadline(self):
        async def scenario() -> None:
            backend = await _backend_paths()
            items = [i async for i in dispatch_stream(backend, generate_request("s", (5, 6, 7), 3, ns=NS), (), 10.0)]
            chunks, outcome = items[:-1], items[-1]
            assert {type(c) for c in chunks} == {TokenChunk} and type(outcome) is GenerateOutcome
            assert outcome.result.output_tokens == tuple(t for c in chunks for t in c.token_ids)
            assert len(outcome.result.output_tokens) == 3
            with pytest.raises(TimeoutError):
                async for _ in dispatch_stream(backend, generate_request("t", (5, 6, 7), 1500, ns=NS), (), 0.3):
                    pass
            engine_busy = await backend.runtime.call("local-0", lambda engine: engine.busy)
            assert engine_busy is False   # closed at the deadline: aborted on the worker
            await backend.close()

        run_bounded(scenario(), 30, "a stream and its deadline")

    def test_a_result_carries_every_field_of_the_outcome(self):
        async def scenario() -> None:
            backend = await _backend_paths()
            prompt = tuple(range(40, 40 + 2 * BLOCK + 3))
            request = generate_request("x", prompt, 3, ns=NS)
            outcome = await dispatch(backend, request, hash_blocks(prompt, BLOCK, NS), 10.0)
            r = outcome.result
            stored = result_of(7, "conv-7", outcome, request, BLOCK)
            assert stored == type(stored)(
                index=7, custom_id="conv-7", request_id="x", ok=True, text=r.text,
                output_tokens=r.output_tokens, finish_reason="length", prompt_tokens=35,
                cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens,
                written_tokens=r.written_tokens, worker_id="local-0", ttft_s=r.ttft_s,
                tpot_s=r.tpot_s, attempts=1, worker_s=outcome.worker_time_s(),
                written_input_tokens=32, write_ttl_s=r.lookup.ttl_s)
            assert (r.cached_tokens, r.computed_tokens, r.written_tokens) == (0, 35, 32)
            assert r.ttft_s > 0 and r.tpot_s > 0 and r.text != "" and outcome.worker_s > 0
            await backend.close()

        run_bounded(scenario(), 30, "a result's fields")


class TestResults:
    def test_a_finished_request_is_stored_with_every_field_of_its_result(self):
        r = result("job-1-4", 40, 16, 16, "", LookupOutcome.PARTIAL, outputs=3)
        outcome = GenerateOutcome(r, None, attempts=2, worker_id="w3", worker_s=0.25)
        assert result_of(4, "conv-4", outcome, ASKED_NOTHING, 16) == StoredResult(
            index=4, custom_id="conv-4", request_id="job-1-4", ok=True, text="abcd",
            output_tokens=(0, 1, 2), finish_reason="length", prompt_tokens=40, cached_tokens=16,
            computed_tokens=24, written_tokens=16, worker_id="w3", ttft_s=0.02, tpot_s=0.005,
            attempts=2, worker_s=0.25, written_input_tokens=16, write_ttl_s=300.0)

    def test_a_result_keeps_its_logprobs_and_the_stop_string_that_ended_it(self):
        from workers.messages import TokenLogprob
        r = result("r", 40, 16, 16, "w", LookupOutcome.PARTIAL, outputs=2)
        probs = (TokenLogprob(0, -0.5, ((0, -0.5), (9, -1.5))), TokenLogprob(1, -0.25))
        r = dataclasses.replace(r, logprobs=probs, extra={"stop": "END"})
        stored = result_of(0, "", GenerateOutcome(r, None, 1, ""), ASKED_NOTHING, 16)
        assert (stored.logprobs, stored.stop_sequence) == (probs, "END")

    def test_a_request_of_no_prompt_wrote_no_prompt_tokens(self):
        r = result("r", 0, 0, 16, "w", LookupOutcome.MISS)  # what it wrote was its output
        stored = result_of(0, "", GenerateOutcome(r, None, 1, ""), ASKED_NOTHING, 16)
        assert (stored.written_tokens, stored.written_input_tokens) == (16, 0)

    def test_a_result_keeps_the_ttl_its_request_asked_for(self):
        r = result("r", 40, 0, 32, "w", LookupOutcome.MISS)  # the store's TTL: 300 s
        hour = dataclasses.replace(ASKED_NOTHING, cache=CacheControls(ttl_s=3600.0))
        stored = result_of(0, "", GenerateOutcome(r, None, 1, ""), hour, 16)
        assert (stored.written_input_tokens, stored.write_ttl_s) == (32, 3600.0)

    def test_the_worker_is_the_backend_s_or_else_the_engine_s_and_its_time_the_engine_s_span(self):
        r = result("r", 20, 0, 16, "engine-w", LookupOutcome.MISS)
        def of(outcome):
            return result_of(0, "", outcome, ASKED_NOTHING, 16)
        assert of(GenerateOutcome(r, None, 1, "")).worker_id == "engine-w"
        assert of(GenerateOutcome(r, None, 1, "backend-w")).worker_id == "backend-w"
        # no worker time from the backend: the engine's received -> finished, 40 ms here
        assert of(GenerateOutcome(r, None, 1, "")).worker_s == 0.04
        assert r.timings.received_ns == T0

    def test_an_error_is_stored_with_its_request_s_names_and_nothing_else(self):
        pending = PendingRequest("job-2", 7, "conv-7", (1, 2, 3), SamplingParams(4))
        assert error_of(pending, "UNAVAILABLE", "no worker") == StoredResult(
            index=7, custom_id="conv-7", request_id="job-2-7", ok=False, error_code="UNAVAILABLE",
            error_message="no worker")

