"""The tenant-facing servicers: ``orchard.v1.Jobs`` and ``orchard.v1.Generate``.

Each method authenticates (the API key names the tenant), then hands over: jobs are accepted
into the job store by ``cluster.api.intake`` (shape checks only; templating and tokenization
wait for dispatch) and launched on the ``JobRunner``; single requests are validated and
tokenized (``cluster.api.validate``) and go straight to the backend through
``dispatch_stream``. Errors are domain exceptions, mapped to statuses by
``cluster.api.edge.grpc_errors``.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from typing import AsyncIterator, TypeVar

from cluster.api import intake, validate
from cluster.api.chat import ChatTokenizer
from cluster.backend.protocol import Backend, GenerateOutcome, ModelInfo
from cluster.api.convert import job_to_pb, result_to_pb
from cluster.api.edge import Authenticator, Undecodable, grpc_errors
from cluster.jobs.store import JobNotFound, JobStore
from cluster.jobs.runner import JobRunner, dispatch_stream, result_of
from cluster.telemetry.setup import attached, extract_metadata
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from workers.messages import GenerateRequest

T = TypeVar("T")

RESULT_PAGE = 500
FOLLOW_POLL_S = 1.0


class JobsServicer(pb_grpc.JobsServicer):
    def __init__(self, auth: Authenticator, store: JobStore, runner: JobRunner,
                 model: ModelInfo, max_requests_per_job: int):
        self._auth = auth
        self._store = store
        self._runner = runner
        self._model = model
        self._intake = intake.JobIntakeService(store, runner, model, max_requests_per_job)

    def authenticate(self, context) -> str:
        return self._auth.tenant(context)

    @grpc_errors
    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.Job:
        tenant = self._auth.tenant(context)
        with attached(extract_metadata(context.invocation_metadata())):
            # the job's span joins the caller's trace, if any
            job = await self._intake.submit_requests(tenant, request.requests,
                                                     request.idempotency_key)
        return job_to_pb(job)

    @grpc_errors
    async def SubmitBatchFile(self, request_iterator: AsyncIterator[pb.BatchFileChunk],
                              context) -> pb.Job:
        tenant = self._auth.tenant(context)
        request_iterator = aiter(request_iterator)
        first = await anext(request_iterator, None)
        if first is None:
            raise validate.FieldError("data", "no chunks: send the file's bytes")
        if isinstance(first, Undecodable):
            raise first.problem()

        async def chunks() -> AsyncIterator[bytes]:
            chunk = first
            while chunk is not None:
                if isinstance(chunk, Undecodable):  # bytes that are not a BatchFileChunk
                    raise chunk.problem()
                yield chunk.data
                chunk = await anext(request_iterator, None)

        with attached(extract_metadata(context.invocation_metadata())):
            job = await self._intake.submit_file(tenant, chunks(), _file_name(first.file_name),
                                                 first.idempotency_key)
        return job_to_pb(job)

    @grpc_errors
    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        tenant = self._auth.tenant(context)
        return job_to_pb(self._store.get_job(_job_id(request.job_id), tenant))

    @grpc_errors
    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        tenant = self._auth.tenant(context)
        if request.limit < 0:
            raise validate.FieldError("limit", f"must be >= 0, got {request.limit}")
        jobs = self._store.list_jobs(tenant, min(request.limit or 50, 1000))
        return pb.ListJobsResponse(jobs=[job_to_pb(j) for j in jobs])

    @grpc_errors
    async def CancelJob(self, request: pb.CancelJobRequest, context) -> pb.Job:
        tenant = self._auth.tenant(context)
        return job_to_pb(self._runner.cancel(_job_id(request.job_id), tenant))

    @grpc_errors
    async def StreamResults(self, request: pb.StreamResultsRequest, context):
        tenant = self._auth.tenant(context)
        job_id = _job_id(request.job_id)
        self._store.get_job(job_id, tenant)  # NOT_FOUND before streaming anything
        if request.offset < 0:
            raise validate.FieldError("offset", f"must be >= 0, got {request.offset}")
        offset = request.offset
        while True:
            batch = self._store.results(job_id, offset, RESULT_PAGE)
            for result in batch:
                yield result_to_pb(result, self._model.model_id)
                offset = result.seq + 1
            if batch:
                continue
            if self._store.get_job(job_id).state.finished:
                # The last result commits with the state change: one more read catches it.
                if not self._store.results(job_id, offset, 1):
                    return
                continue
            if not request.follow:
                return
            await self._runner.wait_changed(FOLLOW_POLL_S)


class GenerateServicer(pb_grpc.GenerateServicer):
    def __init__(self, auth: Authenticator, backend: Backend, runner: JobRunner,
                 model: ModelInfo, tokenizer: ChatTokenizer,
                 max_prompt_bytes: int = validate.MAX_PROMPT_BYTES):
        self._auth = auth
        self._backend = backend
        self._runner = runner
        self._model = model
        self._tokenizer = tokenizer
        self._max_prompt_bytes = max_prompt_bytes

    def authenticate(self, context) -> str:
        return self._auth.tenant(context)

    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        tenant = self._auth.tenant(context)
        self._runner.admit(tenant, 1)  # before tokenizing: an overloaded cluster does no work
        try:
            new = await self._tokenizer.off_loop(
                validate.new_request, request.request, "request", self._model,
                self._tokenizer.render, self._max_prompt_bytes)
            # Closed with the RPC (a client that cancels or goes away): the request is aborted
            # on its worker at once, not whenever the stream is collected. Its span is current
            # in the pump's task only, never across this generator's yields.
            async with contextlib.aclosing(until_rpc_done(
                    context, self._responses(tenant, new, context))) as responses:
                async for response in responses:
                    yield response
        finally:
            self._runner.release(tenant, 1)

    async def _responses(self, tenant: str, new: NewRequest, context
                         ) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate request on the backend, in one of the ``max_concurrent`` slots (shared
        with jobs), traced; run by ``until_rpc_done``'s pump."""
        async with self._runner.slot(tenant):
            request_id = f"gen-{secrets.token_hex(8)}"
            with self._runner.tracing.request(tenant, request_id, "", new.custom_id,
                                              new.sampling, context.invocation_metadata(),
                                              prompt=new.prompt) as trace:
                generate = GenerateRequest(request_id=request_id,
                                           namespace=self._runner.namespace(tenant),
                                           prompt=new.prompt, sampling=new.sampling,
                                           trace_context=trace.context)
                remaining = context.time_remaining()
                timeout_s = min(self._runner.timeout_s,
                                math.inf if remaining is None else max(remaining, 0.001))
                hashes = self._runner.block_hashes(tenant, new.prompt)
                async for item in dispatch_stream(self._backend, generate, hashes, timeout_s):
                    if isinstance(item, GenerateOutcome):
                        stored = result_of(0, new.custom_id, item)
                        try:  # the caller gets its result first; the trace is finished after
                            yield pb.GenerateResponse(
                                result=result_to_pb(stored, self._model.model_id))
                            await asyncio.sleep(0)
                        finally:
                            trace.done(generate, hashes, item)
                    else:
                        yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=item.token_ids,
                                                                      text=item.text))


_END = object()


async def until_rpc_done(context, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items``, pumped by a task of their own that the RPC's end cancels.

    A client that cancels (or goes away) while the handler waits at a ``yield`` leaves the
    handler suspended there, unclosed until it is garbage collected, and one that cancels before
    the handler started is never seen by it at all. The pump's cancellation reaches the
    backend's stream wherever it waits, so the request is aborted on its worker at once.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async with contextlib.aclosing(items) as stream:
                async for item in stream:
                    queue.put_nowait(item)
            queue.put_nowait(_END)
        except Exception as exc:  # handed to the handler, which raises it
            queue.put_nowait(exc)

    task = asyncio.get_running_loop().create_task(pump())
    context.add_done_callback(lambda _: task.cancel())
    if context.done():
        task.cancel()
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()


def _file_name(name: str) -> str:
    """The name errors call the file by (``batch.jsonl:3: ...``)."""
    if len(name) > validate.QUOTE_CHARS:
        raise validate.FieldError("file_name", f"{len(name)} characters; use at most "
                                  f"{validate.QUOTE_CHARS}")
    return name or "input"


def _job_id(job_id: str) -> str:
    if not job_id:
        raise validate.FieldError("job_id", "required")
    if len(job_id) > validate.QUOTE_CHARS:  # longer than any job id
        raise JobNotFound(f"job_id: no job {validate.quoted(job_id)}")
    return job_id
