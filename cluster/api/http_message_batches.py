"""Anthropic's Message Batches as orchard jobs: the ``anthropic`` SDK's
``client.messages.batches`` against orchard unchanged.

    POST /v1/messages/batches                  {requests: [{custom_id, params}]}: one job
    GET  /v1/messages/batches                  newest first, paged (limit, after_id, before_id)
    GET  /v1/messages/batches/{id}             processing_status, request_counts, results_url
    GET  /v1/messages/batches/{id}/results     JSON lines, one per request with a result
    POST /v1/messages/batches/{id}/cancel

Each ``params`` is a Messages body (``cluster.api.anthropic_shapes``; no ``stream``), the
batch a job with the same validation, limits and durability as any (it survives a
restart): its id is ``msgbatch_<job id>``. A job queued or running is ``in_progress``, a
finished one ``ended``; results are ``succeeded`` (the message, usage included),
``canceled`` or ``errored`` (Anthropic's error object). Requests of a cancelled batch that
never ran have no result line (orchard records none for them); the counts say how many.
The list holds every job of the key's tenant (any job reads as a batch, however it was
submitted), in Anthropic's page shape: ``data``, ``has_more``, ``first_id``, ``last_id``;
``after_id`` pages to older batches, ``before_id`` to newer ones.
"""
from __future__ import annotations

import dataclasses
import datetime
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cluster.api import anthropic_shapes as shapes
from cluster.api.edge import Authenticator
from cluster.api.http_errors import json_body
from cluster.api.http_messages import anthropic_errors, api_key_tenant
from cluster.api.validate import FieldError
from cluster.api.work import Work
from cluster.jobs.runner import JobRunner
from cluster.jobs.store import JobNotFound, JobRecord, JobStore, StoredResult

PREFIX = "msgbatch_"
RESULTS_PAGE = 1000
LIST_LIMIT, LIST_MAX = 20, 1000  # Anthropic's default and largest page
LIST_PARAMS = ("limit", "after_id", "before_id")
EXPIRES_S = 24 * 3600  # Anthropic's: a batch not ended within a day expires (orchard's never do)
HTTP_OF = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
           "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}


def _iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat().replace(
        "+00:00", "Z")


class MessageBatches:
    def __init__(self, auth: Authenticator, work: Work, jobs: JobStore, runner: JobRunner):
        self._auth = auth
        self._work = work
        self._jobs = jobs
        self._runner = runner
        self._model_id = work.model.model_id

    def routes(self) -> list[Route]:
        base = "/v1/messages/batches"
        return [Route(base, anthropic_errors(self.create), methods=["POST"]),
                Route(base, anthropic_errors(self.list), methods=["GET"]),
                Route(base + "/{batch_id}", anthropic_errors(self.get), methods=["GET"]),
                Route(base + "/{batch_id}/results", anthropic_errors(self.results),
                      methods=["GET"]),
                Route(base + "/{batch_id}/cancel", anthropic_errors(self.cancel),
                      methods=["POST"])]

    async def create(self, request: Request) -> Response:
        tenant = api_key_tenant(self._auth, request)
        body = await json_body(request)
        items = body.get("requests")
        if not isinstance(items, list) or not items:
            raise FieldError("requests", "required: a non-empty list of {custom_id, params}")
        requests = []
        for i, item in enumerate(items):
            params = item.get("params") if isinstance(item, dict) else None
            if not isinstance(params, dict) or not isinstance(item.get("custom_id"), str):
                raise FieldError(f"requests[{i}]", "must be {custom_id, params}")
            if params.get("model") != self._model_id:
                raise FieldError(f"requests[{i}].params.model", f"unknown model "
                                 f"{params.get('model')!r}; this cluster serves "
                                 f"{self._model_id!r}")
            if params.get("diagnostics") is not None:
                raise FieldError(f"requests[{i}].params.diagnostics", "a batch's requests "
                                 "have no previous message to compare; leave it out")
            if params.get("stream"):
                raise FieldError(f"requests[{i}].params.stream", "a batch is not streamed; "
                                 "leave it out")
            try:
                parsed = shapes.request_of(params)
            except FieldError as exc:
                raise FieldError(f"requests[{i}].params.{exc.field}",
                                 str(exc).removeprefix(f"{exc.field}: ")) from None
            requests.append(dataclasses.replace(parsed, custom_id=item["custom_id"]))
        job = await self._work.submit_job(tenant, requests, metadata=list(request.headers.items()))
        return JSONResponse(self._object(job, request))

    async def list(self, request: Request) -> Response:
        tenant = api_key_tenant(self._auth, request)
        query = request.query_params
        unknown = sorted(set(query) - set(LIST_PARAMS))
        if unknown:
            raise FieldError(unknown[0], f"not a parameter of this list; use "
                             f"{', '.join(LIST_PARAMS)}")
        text = query.get("limit", str(LIST_LIMIT))
        if not text.isdigit() or not 1 <= int(text) <= LIST_MAX:
            raise FieldError("limit", f"must be an integer in [1, {LIST_MAX}], got {text!r}")
        limit = int(text)
        after, before = (self._cursor(query, name) for name in ("after_id", "before_id"))
        if after and before:
            raise FieldError("before_id", "give after_id or before_id, not both")
        page = self._jobs.list_jobs(tenant, limit + 1, after=after, before=before)
        # one more than asked says whether there are more (before_id: the newest one extra)
        kept = page[-limit:] if before else page[:limit]
        data = [self._object(job, request) for job in kept]
        return JSONResponse({"data": data, "has_more": len(page) > limit,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    def _cursor(self, query, name: str) -> str:
        value = query.get(name, "")
        if value and not value.startswith(PREFIX):
            raise JobNotFound(f"{name}: no batch {value!r}")
        return value.removeprefix(PREFIX)

    async def get(self, request: Request) -> Response:
        return JSONResponse(self._object(self._job(request), request))

    async def cancel(self, request: Request) -> Response:
        job = self._job(request)
        self._runner.cancel(job.job_id, job.tenant)  # FAILED_PRECONDITION once finished
        return JSONResponse(self._object(self._jobs.get_job(job.job_id, job.tenant), request))

    async def results(self, request: Request) -> Response:
        job = self._job(request)
        if not job.state.finished:
            raise FieldError("batch_id", "the batch has not ended; its results come when "
                             "processing_status is ended")
        lines, offset = [], 0
        while page := self._jobs.results(job.job_id, offset, RESULTS_PAGE):
            lines += [(r.index, json.dumps(self._line(r))) for r in page]
            offset = page[-1].seq + 1
        return Response("".join(f"{text}\n" for _, text in sorted(lines)),
                        media_type="application/binary")

    def _job(self, request: Request) -> JobRecord:
        tenant = api_key_tenant(self._auth, request)
        batch_id = request.path_params["batch_id"]
        if not batch_id.startswith(PREFIX):
            raise JobNotFound(f"batch_id: no batch {batch_id!r}")
        return self._jobs.get_job(batch_id.removeprefix(PREFIX), tenant)

    def _line(self, r: StoredResult) -> dict:
        if r.ok:
            result = {"type": "succeeded",
                      "message": shapes.message_body(r, self._model_id, self._work.token_bytes)}
        elif r.error_code == "CANCELLED":
            result = {"type": "canceled"}
        else:
            error = shapes.error_body(HTTP_OF.get(r.error_code, 500), r.error_message)
            result = {"type": "errored", "error": error}
        return {"custom_id": r.custom_id, "result": result}

    def _object(self, job: JobRecord, request: Request) -> dict:
        ended = job.state.finished
        batch_id = PREFIX + job.job_id
        done = job.completed + job.failed + job.cancelled
        return {
            "id": batch_id, "type": "message_batch",
            "processing_status": "ended" if ended else "in_progress",
            "request_counts": {"processing": job.total - done, "succeeded": job.completed,
                               "errored": job.failed, "canceled": job.cancelled,
                               "expired": 0},
            "created_at": _iso(job.created_ms),
            "ended_at": _iso(job.finished_ms) if ended and job.finished_ms else None,
            "expires_at": _iso(job.created_ms + EXPIRES_S * 1000), "archived_at": None,
            "cancel_initiated_at": None,
            "results_url": (f"{str(request.base_url).rstrip('/')}/v1/messages/batches/"
                            f"{batch_id}/results") if ended else None,
        }

