"""The Batch API over HTTP: files in, a durable orchard job, files out.

    POST /v1/files                  multipart upload, purpose "batch"
    GET  /v1/files/{id}             the file object
    GET  /v1/files/{id}/content     the bytes (input, output or error file)
    POST /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET  /v1/batches/{id}           status and request counts; output_file_id once done
    GET  /v1/batches                newest first, paged (limit, after)
    POST /v1/batches/{id}/cancel

An upload (at most ``MAX_FILE_BYTES``; ``body_caps`` raises the body's cap for it) is copied
to the store a piece at a time, never held whole. Creating a batch parses the file
(``openai_shapes.batch_requests``: every line names the batch's endpoint and the served model)
and submits it through ``Work.submit_job``, so a batch is an orchard job
with the same validation, limits and durability (it survives a restart). When the job has
finished, its results become the output file (ok lines) and the error file (failed lines)
in the run directory (``cluster.api.batch_store``).

Job states read as OpenAI's batch states: queued or running ``in_progress``, succeeded
``completed``, cancelled ``cancelled``.
"""
from __future__ import annotations

import asyncio
import json
from typing import BinaryIO, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.api import openai_shapes as shapes
from cluster.api.batch_store import BatchRecord, BatchStore, FileRecord
from cluster.api.edge import Authenticator
from cluster.api.http_errors import BodyTooLarge, json_body, openai_errors, tenant_of
from cluster.api.http_guard import BodyCap
from cluster.api.intake import MAX_FILE_BYTES
from cluster.api.priority import batch_priority
from cluster.api.validate import FieldError
from cluster.api.work import Work
from cluster.jobs.runner import JobRunner
from cluster.jobs.store import JobRecord, JobState, JobStore

FORM_BYTES = 64 << 10  # an upload's body beyond its file: multipart framing, "purpose"
COPY_BYTES = 1 << 20   # an upload goes to its file in pieces of this size
RESULTS_PAGE = 1000
INLINE_LINES = 16  # files up to this many lines are parsed on the event loop
STATUS = {JobState.QUEUED: "in_progress", JobState.RUNNING: "in_progress",
          JobState.SUCCEEDED: "completed", JobState.CANCELLED: "cancelled"}


class Batches:
    def __init__(self, auth: Authenticator, work: Work, jobs: JobStore, runner: JobRunner,
                 store: BatchStore, encode: shapes.Encode):
        self._auth = auth
        self._work = work
        self._jobs = jobs
        self._runner = runner
        self._store = store
        self._encode = encode
        self._model_id = work.model.model_id

    def routes(self) -> list[Route]:
        return [Route("/v1/files", openai_errors(self.upload), methods=["POST"]),
                Route("/v1/files/{file_id}", openai_errors(self.file), methods=["GET"]),
                Route("/v1/files/{file_id}/content", openai_errors(self.content),
                      methods=["GET"]),
                Route("/v1/batches", openai_errors(self.create), methods=["POST"]),
                Route("/v1/batches", openai_errors(self.list), methods=["GET"]),
                Route("/v1/batches/{batch_id}", openai_errors(self.get), methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", openai_errors(self.cancel),
                      methods=["POST"])]

    def body_caps(self) -> dict[str, BodyCap]:
        """Paths whose bodies have a cap of their own (``http_guard.RequestGuard``)."""
        return {"/v1/files": BodyCap(MAX_FILE_BYTES + FORM_BYTES,
                                     f"a {MAX_FILE_BYTES >> 20} MiB file and its form",
                                     "split the file")}

    def _tenant(self, request: Request) -> str:
        return tenant_of(self._auth, request)

    # ---------------------------------------------------------------- files

    async def upload(self, request: Request) -> Response:
        tenant = self._tenant(request)
        # the file part is spooled to a temporary file past 1 MiB, then copied to the store
        # a piece at a time: never whole in memory
        async with request.form(max_files=1, max_fields=4, max_part_size=FORM_BYTES) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise FieldError("purpose", f"must be 'batch', got {purpose!r}")
            if upload is None or isinstance(upload, str):
                raise FieldError("file", "missing: send the JSONL file as the 'file' part")
            staged = await asyncio.to_thread(self._store.write, file_pieces(upload.file))
            record = self._store.record(staged, tenant, upload.filename or "input.jsonl",
                                        purpose)
        return JSONResponse(_file_object(record))

    async def file(self, request: Request) -> Response:
        record = self._store.file(request.path_params["file_id"], self._tenant(request))
        return JSONResponse(_file_object(record))

    async def content(self, request: Request) -> Response:
        data = self._store.content(request.path_params["file_id"], self._tenant(request))
        return Response(data, media_type="application/jsonl")

    # -------------------------------------------------------------- batches

    async def create(self, request: Request) -> Response:
        tenant = self._tenant(request)
        priority = batch_priority(request.headers)
        body = await json_body(request)
        endpoint = body.get("endpoint")
        if endpoint not in shapes.ENDPOINTS:
            raise FieldError("endpoint", f"must be one of {', '.join(shapes.ENDPOINTS)}, got "
                             f"{endpoint!r}")
        window = body.get("completion_window", "24h")
        metadata = body.get("metadata") or {}
        if not isinstance(window, str) or not window:
            raise FieldError("completion_window", "must be a string such as '24h'")
        if not isinstance(metadata, dict):
            raise FieldError("metadata", "must be an object of strings")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise FieldError("input_file_id", "required: the id of a file uploaded with "
                             "purpose 'batch'")
        lines = self._store.content(file_id, tenant).decode("utf-8", "replace").splitlines()
        args = (lines, endpoint, self._encode, self._model_id)
        parsed = (shapes.batch_requests(*args) if len(lines) <= INLINE_LINES
                  else await asyncio.to_thread(shapes.batch_requests, *args))
        try:
            job = await self._work.submit_job(tenant, parsed.requests,
                                              metadata=list(request.headers.items()),
                                              priority=priority)
        except FieldError as exc:  # validation names requests[i]: the file's line instead
            raise parsed.on_line(exc) from None
        batch = self._store.add_batch(tenant, job.job_id, endpoint, file_id, window, metadata)
        return JSONResponse(self._object(batch, job))

    async def get(self, request: Request) -> Response:
        batch = self._store.batch(request.path_params["batch_id"], self._tenant(request))
        return JSONResponse(self._current(batch))

    async def list(self, request: Request) -> Response:
        tenant = self._tenant(request)
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise FieldError("limit", f"must be an integer in [1, 100], got {limit_text!r}")
        after = request.query_params.get("after", "")
        page = self._store.batches(tenant, int(limit_text) + 1, after)
        data = [self._current(b) for b in page[:int(limit_text)]]
        return JSONResponse({"object": "list", "data": data,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None,
                             "has_more": len(page) > int(limit_text)})

    async def cancel(self, request: Request) -> Response:
        tenant = self._tenant(request)
        batch = self._store.batch(request.path_params["batch_id"], tenant)
        self._runner.cancel(batch.job_id, tenant)  # FAILED_PRECONDITION once finished
        return JSONResponse(self._current(batch))

    # ------------------------------------------------------------ internals

    def _current(self, batch: BatchRecord) -> dict:
        job = self._jobs.get_job(batch.job_id, batch.tenant)
        if job.state.finished and not (batch.output_file_id or batch.error_file_id):
            batch = self._store.set_outputs(batch, *self._outputs(batch, job))
        return self._object(batch, job)

    def _outputs(self, batch: BatchRecord, job: JobRecord) -> tuple[bytes, bytes]:
        ok, failed, offset = [], [], 0
        outputs = shapes.Outputs(self._work.token_bytes)  # a batch line offers no tools
        while page := self._jobs.results(batch.job_id, offset, RESULTS_PAGE):
            for r in page:
                line = shapes.batch_output_line(batch.endpoint, r, self._model_id,
                                                job.created_ms // 1000, outputs)
                (ok if r.ok else failed).append((r.index, json.dumps(line)))
            offset = page[-1].seq + 1
        return (b"".join(f"{text}\n".encode() for _, text in sorted(ok)),
                b"".join(f"{text}\n".encode() for _, text in sorted(failed)))

    def _object(self, batch: BatchRecord, job: JobRecord) -> dict:
        finished_s = job.finished_ms // 1000 if job.finished_ms else None
        status = STATUS[job.state]
        return {
            "id": batch.batch_id, "object": "batch", "endpoint": batch.endpoint,
            "errors": None, "input_file_id": batch.input_file_id,
            "completion_window": batch.completion_window, "status": status,
            "output_file_id": batch.output_file_id or None,
            "error_file_id": batch.error_file_id or None,
            "created_at": batch.created_s, "in_progress_at": batch.created_s,
            "expires_at": None, "finalizing_at": finished_s if status == "completed" else None,
            "completed_at": finished_s if status == "completed" else None,
            "failed_at": None, "expired_at": None,
            "cancelling_at": finished_s if status == "cancelled" else None,
            "cancelled_at": finished_s if status == "cancelled" else None,
            "request_counts": {"total": job.total, "completed": job.completed,
                               "failed": job.failed},
            "metadata": batch.metadata, "model": self._model_id,
        }


def file_pieces(file: BinaryIO, max_bytes: int = MAX_FILE_BYTES) -> Iterator[bytes]:
    """An uploaded file's bytes, a piece at a time, refused once past ``max_bytes``."""
    size = 0
    while piece := file.read(COPY_BYTES):
        size += len(piece)
        if size > max_bytes:
            raise BodyTooLarge("file", f"larger than {max_bytes} bytes; split it")
        yield piece


def _file_object(record: FileRecord) -> dict:
    return {"id": record.file_id, "object": "file", "bytes": record.bytes,
            "created_at": record.created_s, "filename": record.filename,
            "purpose": record.purpose, "status": "processed", "status_details": None}
