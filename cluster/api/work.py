"""What every API edge does with work: submit a job, or run one request and stream it.

The gRPC servicers and the HTTP API both come here, so that a job or a request takes one
path whatever protocol carried it: the same admission (backpressure), validation and
tokenization, tracing and dispatch.

    submit_job(tenant, requests, key)   admit ─► validate ─► store.submit ─► runner.launch
    stream_one(tenant, request, ...)    admit ─► validate ─► trace ─► dispatch_stream
                                        yields TokenChunk ... then one StoredResult
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from typing import AsyncIterator, Callable, Sequence

from cluster.api import validate
from cluster.backend.protocol import Backend, GenerateOutcome, ModelInfo, TokenChunk
from cluster.jobs.runner import JobRunner, dispatch_stream, result_of
from cluster.jobs.store import JobRecord, JobStore, StoredResult
from cluster.telemetry.setup import attached, extract_metadata
from proto.orchard.v1 import orchard_pb2 as pb
from workers.messages import GenerateRequest

INLINE_VALIDATION = 16  # jobs up to this many requests are tokenized on the event loop

Metadata = Sequence[tuple[str, str]]
Pump = Callable[[AsyncIterator], AsyncIterator]


def _direct(items: AsyncIterator) -> AsyncIterator:
    return items


class Work:
    def __init__(self, store: JobStore, runner: JobRunner, backend: Backend, model: ModelInfo,
                 render: validate.Render, max_requests_per_job: int):
        self._store = store
        self._runner = runner
        self._backend = backend
        self._model = model
        self._render = render
        self._max_requests = max_requests_per_job

    @property
    def model(self) -> ModelInfo:
        return self._model

    async def submit_job(self, tenant: str, requests: Sequence[pb.Request],
                         idempotency_key: str = "", metadata: Metadata = ()) -> JobRecord:
        """Accept a job (or return the one ``idempotency_key`` already names) and launch it."""
        key = validate.idempotency_key(idempotency_key)
        if key and (existing := self._store.find_job(tenant, key)) is not None:
            return existing  # a retried submission: the first one's job
        n = len(requests)
        validate.check_job_size(n, self._max_requests)
        self._runner.admit(tenant, n)  # before tokenizing: an overloaded cluster does no work
        try:
            args = (requests, self._max_requests, self._model, self._render)
            if n <= INLINE_VALIDATION:
                new = validate.job_requests(*args)
            else:  # tokenizing a big job must not stall the other calls on the event loop
                new = await asyncio.to_thread(validate.job_requests, *args)
            job, created = self._store.submit(tenant, self._model.model_id, new, key)
        except BaseException:
            self._runner.release(tenant, n)
            raise
        if not created:  # the same key arrived twice while this one was tokenizing
            self._runner.release(tenant, n)
            return job
        with attached(extract_metadata(metadata)):
            self._runner.launch(job)  # the job's span joins the caller's trace, if any
        return job

    async def stream_one(self, tenant: str, request: pb.Request, field: str,
                         metadata: Metadata = (), remaining_s: float | None = None,
                         pump: Pump = _direct) -> AsyncIterator[TokenChunk | StoredResult]:
        """Run one request outside any job: its token chunks as they come, then its result.

        ``remaining_s`` is the caller's own deadline, if it has one; the configured request
        timeout applies either way. ``pump`` wraps the backend's stream (the gRPC edge pumps
        it from a task the RPC's end cancels); closing this stream early aborts the request
        on its worker.
        """
        self._runner.admit(tenant, 1)  # before tokenizing: an overloaded cluster does no work
        try:
            new = validate.new_request(request, field, self._model, self._render)
            request_id = f"gen-{secrets.token_hex(8)}"
            with self._runner.tracing.request(tenant, request_id, "", new.custom_id, new.sampling,
                                              metadata) as trace:
                generate = GenerateRequest(request_id=request_id,
                                           namespace=self._runner.namespace(tenant),
                                           prompt=new.prompt, sampling=new.sampling,
                                           trace_context=trace.context)
                timeout_s = min(self._runner.timeout_s,
                                math.inf if remaining_s is None else max(remaining_s, 0.001))
                hashes = self._runner.block_hashes(tenant, new.prompt)
                async with contextlib.aclosing(pump(dispatch_stream(
                        self._backend, generate, hashes, timeout_s))) as items:
                    async for item in items:
                        if isinstance(item, GenerateOutcome):
                            try:  # the caller gets its result first; the trace finishes after
                                yield result_of(0, new.custom_id, item)
                            finally:
                                trace.done(generate, hashes, item)
                        else:
                            yield item
        finally:
            self._runner.release(tenant, 1)
