"""The tenant-facing servicers: ``orchard.v1.Jobs`` and ``orchard.v1.Generate``.

Each method authenticates (the API key names the tenant), converts the protobuf requests into
the edges' typed ones (``cluster.api.convert``: ``RequestIn``) and hands the work to
``cluster.api.work`` (validation, admission, the job store and the ``JobRunner``, or one
request streamed from the backend), the path the HTTP API shares. Errors are domain exceptions,
mapped to statuses by ``cluster.api.edge.grpc_errors``.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, TypeVar

from cluster.api import validate
from cluster.api.convert import (RequestsFromPb, job_to_pb, logprobs_to_pb, page_request,
                                 page_token, request_from_pb, result_to_pb)
from cluster.api.edge import Authenticator, Undecodable, grpc_errors
from cluster.api.priority import job_priority_from_pb, priority_from_pb
from cluster.api.work import Work
from cluster.jobs.runner import JobRunner
from cluster.jobs.store import JobNotFound, JobStore, StoredResult
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

T = TypeVar("T")

RESULT_PAGE = 500
FOLLOW_POLL_S = 1.0


class JobsServicer(pb_grpc.JobsServicer):
    def __init__(self, auth: Authenticator, store: JobStore, runner: JobRunner, work: Work):
        self._auth = auth
        self._store = store
        self._runner = runner
        self._work = work

    def authenticate(self, context) -> str:
        return self._auth.tenant(context)

    @grpc_errors
    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.Job:
        tenant = self._auth.tenant(context)
        priority = job_priority_from_pb(request.priority)
        job = await self._work.submit_job(tenant, RequestsFromPb(request.requests),
                                          request.idempotency_key,
                                          context.invocation_metadata() or (), priority)
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
        priority = job_priority_from_pb(first.priority)

        async def chunks() -> AsyncIterator[bytes]:
            chunk, index = first, 0
            while chunk is not None:
                if isinstance(chunk, Undecodable):  # bytes that are not a BatchFileChunk
                    raise chunk.problem()
                if index and chunk.priority:
                    raise validate.FieldError("priority", f"set on chunk {index}: only the "
                                              "first chunk carries the job's priority")
                yield chunk.data
                chunk, index = await anext(request_iterator, None), index + 1

        job = await self._work.submit_file(tenant, chunks(), _file_name(first.file_name),
                                           first.idempotency_key,
                                           context.invocation_metadata() or (), priority)
        return job_to_pb(job)

    @grpc_errors
    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        tenant = self._auth.tenant(context)
        return job_to_pb(self._store.get_job(_job_id(request.job_id), tenant))

    @grpc_errors
    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        tenant = self._auth.tenant(context)
        page = page_request(request)
        jobs = self._store.list_jobs(tenant, page.size + 1, page.states, page.since_ms,
                                     page.after)
        more = len(jobs) > page.size
        jobs = jobs[:page.size]
        return pb.ListJobsResponse(jobs=[job_to_pb(j) for j in jobs],
                                   next_page_token=page_token(jobs[-1].job_id) if more else "")

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
                yield result_to_pb(result, self._work.model.model_id, self._work.token_bytes)
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
    def __init__(self, auth: Authenticator, work: Work):
        self._auth = auth
        self._work = work

    def authenticate(self, context) -> str:
        return self._auth.tenant(context)

    @grpc_errors
    async def Generate(self, request: pb.GenerateRequest, context):
        tenant = self._auth.tenant(context)
        model = self._work.model.model_id
        # Pumped by a task the RPC's end cancels (a client that cancels or goes away): the
        # request is aborted on its worker at once, not whenever the stream is collected.
        async for item in self._work.stream_one(tenant, request_from_pb(request.request),
                                                "request",
                                                context.invocation_metadata() or (),
                                                context.time_remaining(),
                                                lambda items: until_rpc_done(context, items),
                                                priority_from_pb(request.priority)):
            if isinstance(item, StoredResult):
                yield pb.GenerateResponse(result=result_to_pb(item, model,
                                                              self._work.token_bytes))
            else:
                logprobs = logprobs_to_pb(item.logprobs, self._work.token_bytes)
                yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=item.token_ids,
                                                              text=item.text,
                                                              logprobs=logprobs))


_END = object()


async def until_rpc_done(context, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items``, pumped by a task of their own that the RPC's end cancels.

    A client that cancels (or goes away) while the handler waits at a ``yield`` leaves the
    handler suspended there, unclosed until it is garbage collected, and one that cancels before
    the handler started is never seen by it at all. The pump's cancellation reaches the
    backend's stream wherever it waits, so the request is aborted on its worker at once.

    The pump asks ``items`` for the next item only once the handler wants it (gRPC has sent
    the one before), as a handler reading ``items`` itself would: what ``items`` does after
    yielding its last item (``cluster.jobs.direct`` finishes the request's trace, about 1 ms)
    runs after that item has gone out, never while it waits behind the previous message.
    """
    queue: asyncio.Queue = asyncio.Queue()
    wanted = asyncio.Event()   # the handler has taken every item pumped and waits for one

    async def pump() -> None:
        try:
            async with contextlib.aclosing(items) as stream:
                while True:
                    await wanted.wait()
                    wanted.clear()
                    item = await anext(stream, _END)
                    queue.put_nowait(item)
                    if item is _END:
                        return
        except Exception as exc:  # handed to the handler, which raises it
            queue.put_nowait(exc)

    task = asyncio.get_running_loop().create_task(pump())
    context.add_done_callback(lambda _: task.cancel())
    if context.done():
        task.cancel()
    try:
        while True:
            wanted.set()
            item = await queue.get()
            if item is _END:
                return
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
