"""What every API edge does with work: submit a job, or run one request and stream it.

The gRPC servicers and the HTTP API both come here, so that a job or a request takes one
path whatever protocol carried it: the same admission (backpressure), validation and
tokenization (off the event loop), concurrency slots, tracing and dispatch.

    submit_job(tenant, requests, key)    JobIntakeService: admit ─► shape checks ─► store
    submit_file(tenant, chunks, name)      ─► runner.launch (templating at dispatch)
    stream_one(tenant, request, ...)     admit ─► validate + tokenize (tokenizer's pool)
                                         ─► pump(slot ─► trace ─► dispatch_stream)
                                         yields TokenChunk ... then one StoredResult
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from typing import AsyncIterable, AsyncIterator, Callable, Sequence

from cluster.api import validate
from cluster.api.chat import ChatTokenizer
from cluster.api.intake import JobIntakeService
from cluster.backend.protocol import Backend, GenerateOutcome, ModelInfo, TokenChunk
from cluster.jobs.runner import JobRunner, dispatch_stream, result_of
from cluster.jobs.store import JobRecord, NewRequest, StoredResult
from cluster.telemetry.setup import attached, extract_metadata
from proto.orchard.v1 import orchard_pb2 as pb
from workers.messages import GenerateRequest

Metadata = Sequence[tuple[str, str]]
Pump = Callable[[AsyncIterator], AsyncIterator]


def _direct(items: AsyncIterator) -> AsyncIterator:
    return items


class Work:
    def __init__(self, runner: JobRunner, backend: Backend, model: ModelInfo,
                 tokenizer: ChatTokenizer, intake: JobIntakeService,
                 max_prompt_bytes: int = validate.MAX_PROMPT_BYTES):
        self._runner = runner
        self._backend = backend
        self._model = model
        self._tokenizer = tokenizer
        self._intake = intake
        self._max_prompt_bytes = max_prompt_bytes

    @property
    def model(self) -> ModelInfo:
        return self._model

    async def submit_job(self, tenant: str, requests: Sequence[pb.Request],
                         idempotency_key: str = "", metadata: Metadata = ()) -> JobRecord:
        """Accept a job (or return the one ``idempotency_key`` already names) and launch it;
        its span joins the caller's trace, if any."""
        with attached(extract_metadata(metadata)):
            return await self._intake.submit_requests(tenant, requests, idempotency_key)

    async def submit_file(self, tenant: str, chunks: AsyncIterable[bytes], name: str,
                          idempotency_key: str = "", metadata: Metadata = ()) -> JobRecord:
        """Accept a batch file streamed in chunks (see ``cluster.api.intake``) and launch it."""
        with attached(extract_metadata(metadata)):
            return await self._intake.submit_file(tenant, chunks, name, idempotency_key)

    async def stream_one(self, tenant: str, request: pb.Request, field: str,
                         metadata: Metadata = (), remaining_s: float | None = None,
                         pump: Pump = _direct) -> AsyncIterator[TokenChunk | StoredResult]:
        """Run one request outside any job: its token chunks as they come, then its result.

        ``remaining_s`` is the caller's own deadline, if it has one; the configured request
        timeout applies either way. ``pump`` runs the request (the gRPC edge pumps it from a
        task the RPC's end cancels, so its span is current in that task only, never across a
        yield); closing this stream early aborts the request on its worker.
        """
        self._runner.admit(tenant, 1)  # before tokenizing: an overloaded cluster does no work
        try:
            new = await self._tokenizer.off_loop(
                validate.new_request, request, field, self._model, self._tokenizer.render,
                self._max_prompt_bytes)
            async with contextlib.aclosing(pump(self._run(tenant, new, metadata, remaining_s))
                                           ) as items:
                async for item in items:
                    yield item
        finally:
            self._runner.release(tenant, 1)

    async def _run(self, tenant: str, new: NewRequest, metadata: Metadata,
                   remaining_s: float | None) -> AsyncIterator[TokenChunk | StoredResult]:
        """One request on the backend, in one of the ``max_concurrent`` slots (shared with
        jobs), traced."""
        async with self._runner.slot(tenant):
            request_id = f"gen-{secrets.token_hex(8)}"
            with self._runner.tracing.request(tenant, request_id, "", new.custom_id, new.sampling,
                                              metadata, prompt=new.prompt) as trace:
                generate = GenerateRequest(request_id=request_id,
                                           namespace=self._runner.namespace(tenant),
                                           prompt=new.prompt, sampling=new.sampling,
                                           trace_context=trace.context)
                timeout_s = min(self._runner.timeout_s,
                                math.inf if remaining_s is None else max(remaining_s, 0.001))
                hashes = self._runner.block_hashes(tenant, new.prompt)
                async for item in dispatch_stream(self._backend, generate, hashes, timeout_s):
                    if isinstance(item, GenerateOutcome):
                        try:  # the caller gets its result first; the trace finishes after
                            yield result_of(0, new.custom_id, item)
                            await asyncio.sleep(0)
                        finally:
                            trace.done(generate, hashes, item)
                    else:
                        yield item
