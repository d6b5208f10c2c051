"""One request on the backend, and the result it leaves: what the runner and ``direct`` share.

    dispatch(backend, request, hashes, timeout)         ─► GenerateOutcome (retried while
                                                            no worker can take it)
    dispatch_stream(backend, request, hashes, timeout)  ─► TokenChunk ... GenerateOutcome
    result_of(index, custom_id, outcome, request, bs)   ─► StoredResult (ok)
    error_of(request, code, message)                    ─► StoredResult (failed)
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Protocol, Sequence

from cluster.backend.protocol import Backend, GenerateOutcome, NoWorkerAvailable, TokenChunk
from cluster.backend.retry import NO_WORKER_BACKOFF_S
from cluster.jobs.store import PendingRequest, StoredRequest, StoredResult
from router.cost import measured_usage
from router.kv.key import BlockHash
from workers.messages import GenerateRequest


class Clock(Protocol):
    """The time the backoff reads and waits on (the event loop's; tests inject their own)."""

    def now(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def dispatch(backend: Backend, request: GenerateRequest, block_hashes: Sequence[BlockHash],
                   timeout_s: float, clock: Clock | None = None) -> GenerateOutcome:
    """Run one request on the backend within ``timeout_s``: the one call per request.

    ``NoWorkerAvailable`` is retried with backoff while time remains (workers may be scaling
    or restarting); ``TimeoutError`` when the deadline passes.
    """
    clock = clock or LoopClock()
    deadline = clock.now() + timeout_s
    attempt = 0
    while True:
        try:
            # a timeout over the call itself: no task of its own, so no loop turn more at
            # either end (``asyncio.wait_for`` runs it in a new task on Python 3.11)
            async with asyncio.timeout(max(deadline - clock.now(), 0.001)):
                return await backend.generate(request, block_hashes)
        except NoWorkerAvailable:
            pause = NO_WORKER_BACKOFF_S[min(attempt, len(NO_WORKER_BACKOFF_S) - 1)]
            if clock.now() + pause >= deadline:
                raise
            attempt += 1
            await clock.sleep(pause)


async def dispatch_stream(backend: Backend, request: GenerateRequest,
                          block_hashes: Sequence[BlockHash], timeout_s: float
                          ) -> AsyncIterator[TokenChunk | GenerateOutcome]:
    """Stream one request from the backend within ``timeout_s`` (``TimeoutError`` after it)."""
    async with asyncio.timeout(timeout_s), \
            contextlib.aclosing(backend.stream(request, block_hashes)) as items:
        async for item in items:  # closed early (cancel, deadline): aborted on the worker
            yield item


def result_of(index: int, custom_id: str, outcome: GenerateOutcome, request: GenerateRequest,
              block_size: int) -> StoredResult:
    """The result of ``request``: what it wrote of its prompt, and the TTL that was for (its
    own, or the store's when it asked none: ``LookupReport.ttl_s``)."""
    r = outcome.result
    written_input = measured_usage(r.input_tokens, r.cached_tokens, r.written_tokens,
                                   block_size).written_tokens if r.input_tokens else 0
    ttl_s = request.cache.ttl_s
    return StoredResult(
        index=index, custom_id=custom_id, request_id=r.request_id, ok=True,
        text=r.text, output_tokens=tuple(r.output_tokens), finish_reason=r.finish_reason,
        prompt_tokens=r.input_tokens, cached_tokens=r.cached_tokens,
        computed_tokens=r.computed_tokens, written_tokens=r.written_tokens,
        worker_id=outcome.worker_id or r.worker_id, ttft_s=r.ttft_s, tpot_s=r.tpot_s,
        attempts=outcome.attempts,
        worker_s=outcome.worker_time_s(), logprobs=tuple(r.logprobs),
        written_input_tokens=written_input, stop_sequence=r.extra.get("stop", ""),
        write_ttl_s=r.lookup.ttl_s if ttl_s is None else ttl_s)


def error_of(pending: PendingRequest | StoredRequest, code: str, message: str) -> StoredResult:
    return StoredResult(index=pending.index, custom_id=pending.custom_id,
                        request_id=pending.request_id, ok=False, error_code=code,
                        error_message=message)
