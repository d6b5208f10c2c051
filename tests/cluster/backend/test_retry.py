"""The one retry policy (``cluster.backend.retry.retried``): another attempt while nothing was
sent, never after a chunk went out, at most ``MAX_ATTEMPTS``; each attempt closed."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from cluster.backend.protocol import NoWorkerAvailable
from cluster.backend.retry import MAX_ATTEMPTS, retried
from workers.messages import WorkerFailed


class Attempts:
    """Attempt n yields ``plans[n - 1]``'s items, then fails if its plan ends in an
    exception; every attempt's start and close is recorded."""

    def __init__(self, *plans: list) -> None:
        self.plans = plans
        self.started: list[int] = []
        self.closed: list[int] = []

    async def __call__(self, n: int):
        self.started.append(n)
        try:
            for item in self.plans[n - 1]:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed.append(n)


def _final(item: str) -> bool:
    return item.startswith("result")


def _collect(attempts: Attempts, stop_after: int | None = None) -> list[str]:
    async def run() -> list[str]:
        items = []
        async with contextlib.aclosing(retried("r1", attempts, _final)) as stream:
            async for item in stream:
                items.append(item)
                if stop_after is not None and len(items) == stop_after:
                    break
        return items
    return asyncio.run(run())


class TestRetried:
    def test_a_first_attempt_that_succeeds_is_the_only_one(self):
        attempts = Attempts(["chunk a", "chunk b", "result 1"])
        assert _collect(attempts) == ["chunk a", "chunk b", "result 1"]
        assert (attempts.started, attempts.closed) == ([1], [1])

    def test_a_worker_that_fails_before_sending_anything_is_tried_again(self):
        attempts = Attempts([WorkerFailed("w0 died")], ["chunk x", "result 2"])
        assert _collect(attempts) == ["chunk x", "result 2"]
        assert (attempts.started, attempts.closed) == ([1, 2], [1, 2])

    def test_a_failure_after_a_chunk_went_out_is_not_retried(self):
        attempts = Attempts(["chunk a", WorkerFailed("w0 died")], ["result 2"])
        with pytest.raises(NoWorkerAvailable) as failed:
            _collect(attempts)
        assert str(failed.value) == ("request r1: w0 died (attempt 1 of 3); "
                                     "retry the request")
        assert attempts.started == [1]

    def test_the_last_attempt_failing_ends_it(self):
        attempts = Attempts(*([WorkerFailed(f"w{i} died")] for i in range(MAX_ATTEMPTS)))
        with pytest.raises(NoWorkerAvailable) as failed:
            _collect(attempts)
        assert str(failed.value) == ("request r1: w2 died (attempt 3 of 3); "
                                     "retry the request")
        assert attempts.started == [1, 2, 3] == attempts.closed
        assert MAX_ATTEMPTS == 3

    def test_no_worker_at_all_is_not_retried_here(self):
        attempts = Attempts([NoWorkerAvailable("no ready worker")], ["result 2"])
        with pytest.raises(NoWorkerAvailable, match="^no ready worker$"):
            _collect(attempts)
        assert attempts.started == [1]

    def test_a_caller_that_stops_early_closes_the_attempt(self):
        attempts = Attempts(["chunk a", "chunk b", "result 1"])
        assert _collect(attempts, stop_after=1) == ["chunk a"]
        assert (attempts.started, attempts.closed) == ([1], [1])
