"""Conversions between orchard's dataclasses and the orchard.v1 protobuf messages.

Protobuf exists only at the gRPC edge: the servicers and the client convert here, everything
below them speaks dataclasses. A request becomes the edges' typed ``RequestIn``
(``cluster.api.incoming``) as it was sent, unchecked: ``request_from_pb`` never fails, so every
problem is found, and named, by validation. ``request_to_pb`` goes back, for the job store's
request bodies and the client's batch files. A ``response_format``'s schema travels as a
``google.protobuf.Struct``, whose numbers are doubles: read back, a whole number is an integer
again (``"maxLength": 12``, not ``12.0``), as the JSON that was sent had it.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Callable, Sequence, overload

from google.protobuf import json_format, struct_pb2

from cluster.api.incoming import (ABSENT, Absent, CacheIn, Json, MessageIn, Messages,
                                  RequestIn, SamplingIn, TokenBreakpoint, Tokens)
from cluster.api.validate import FieldError
from cluster.backend.protocol import CacheStats, WorkerInfo
from workers.messages import DiskTierStats, Priority, TokenLogprob
from cluster.jobs.store import JobRecord, JobState, StoredResult
from proto.orchard.v1 import orchard_pb2 as pb

JOB_STATES = {
    JobState.QUEUED: pb.JOB_STATE_QUEUED,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}
STATE_NAMES = {v: k.value for k, v in JOB_STATES.items()}


PRIORITIES = {Priority.INTERACTIVE: pb.PRIORITY_INTERACTIVE, Priority.BATCH: pb.PRIORITY_BATCH}


def job_to_pb(job: JobRecord) -> pb.Job:
    return pb.Job(job_id=job.job_id, tenant=job.tenant, state=JOB_STATES[job.state],
                  total=job.total, completed=job.completed, failed=job.failed,
                  cancelled=job.cancelled, created_unix_ms=job.created_ms,
                  finished_unix_ms=job.finished_ms, model=job.model,
                  priority=PRIORITIES[job.priority])


TokenBytes = Callable[[Sequence[int]], list[bytes]]


def logprobs_to_pb(entries: Sequence[TokenLogprob], token_bytes: TokenBytes
                   ) -> list[pb.TokenLogprob]:
    out = []
    for entry in entries:
        ids = [entry.token, *(t for t, _ in entry.top)]
        pieces = token_bytes(ids)
        out.append(pb.TokenLogprob(token_id=entry.token, logprob=entry.logprob, bytes=pieces[0],
                                   top_logprobs=[
                                       pb.TokenLogprob(token_id=t, logprob=v, bytes=b)
                                       for (t, v), b in zip(entry.top, pieces[1:])]))
    return out


def result_to_pb(r: StoredResult, model: str, token_bytes: TokenBytes | None = None
                 ) -> pb.Result:
    """``token_bytes``: each token's bytes, for the result's log-probabilities (when it has
    them)."""
    logprobs = logprobs_to_pb(r.logprobs, token_bytes) if r.logprobs and token_bytes else ()
    return pb.Result(
        seq=r.seq or 0, index=r.index, custom_id=r.custom_id, request_id=r.request_id, ok=r.ok,
        error_code=r.error_code, error_message=r.error_message, text=r.text,
        output_tokens=r.output_tokens, finish_reason=r.finish_reason,
        usage=pb.Usage(prompt_tokens=r.prompt_tokens, completion_tokens=len(r.output_tokens),
                       cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens,
                       written_tokens=r.written_tokens,
                       written_input_tokens=r.written_input_tokens, write_ttl_s=r.write_ttl_s),
        worker_id=r.worker_id, ttft_s=r.ttft_s, tpot_s=r.tpot_s, attempts=r.attempts,
        model=model, worker_s=r.worker_s, logprobs=logprobs)


def worker_to_pb(w: WorkerInfo) -> pb.Worker:
    return pb.Worker(worker_id=w.worker_id, node=w.node, state=w.state, running=w.running,
                     queued_tokens=w.queued_tokens, cache_bytes=w.cache_bytes,
                     cache_capacity_bytes=w.cache_capacity_bytes, cache_blocks=w.cache_blocks,
                     hit_ratio=w.hit_ratio, requests_served=w.requests_served,
                     disk=disk_to_pb(w.disk))


def stats_to_pb(s: CacheStats) -> pb.CacheStats:
    return pb.CacheStats(workers=s.workers, cache_bytes=s.cache_bytes,
                         cache_capacity_bytes=s.cache_capacity_bytes, cache_blocks=s.cache_blocks,
                         input_tokens=s.input_tokens, cached_tokens=s.cached_tokens,
                         computed_tokens=s.computed_tokens, written_tokens=s.written_tokens,
                         hit_ratio=s.hit_ratio, disk=disk_to_pb(s.disk))


def disk_to_pb(d: DiskTierStats | None) -> pb.DiskTier | None:
    if d is None:
        return None
    return pb.DiskTier(blocks=d.blocks, bytes=d.bytes, capacity_bytes=d.capacity_bytes,
                       free_bytes=d.free_bytes, corrupt=d.corrupt, torn=d.torn,
                       outdated=d.outdated, full=d.full, evictions=d.evictions)


@dataclass(frozen=True, slots=True)
class JobsPage:
    size: int
    states: tuple[JobState, ...]
    since_ms: int
    after: str  # the last job id of the previous page


def page_token(job_id: str) -> str:
    return base64.urlsafe_b64encode(job_id.encode()).decode()


def page_request(request: pb.ListJobsRequest) -> JobsPage:
    """A ListJobs request, checked: ``FieldError`` naming the field."""
    for name in ("limit", "page_size"):
        if not 0 <= getattr(request, name) <= 1000:
            raise FieldError(name, f"must be in [0, 1000] (0: 50), got {getattr(request, name)}")
    size = request.page_size or request.limit or 50
    try:
        after = base64.urlsafe_b64decode(request.page_token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError):
        after = ""
    if request.page_token and not after.startswith("job-"):
        raise FieldError("page_token", "not a token from a previous page; start again with ''")
    by_pb = {v: k for k, v in JOB_STATES.items()}
    unknown = [s for s in request.states if s not in by_pb]
    if unknown:
        raise FieldError("states", f"unknown state {unknown[0]}; use QUEUED, RUNNING, "
                         "SUCCEEDED or CANCELLED")
    if request.created_after_unix_ms < 0:
        raise FieldError("created_after_unix_ms", "must be >= 0")
    return JobsPage(size, tuple(by_pb[s] for s in request.states),
                    request.created_after_unix_ms, after)


# ------------------------------------------------------------------ requests

def json_of(value: struct_pb2.Value) -> Json | Absent:
    """A ``google.protobuf.Value`` as the JSON value it holds (``ABSENT``: none)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [json_of(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: json_of(v) for k, v in value.struct_value.fields.items()}
    if kind == "number_value":
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    return None if kind == "null_value" else ABSENT


def content_value(content: Any) -> struct_pb2.Value:
    """Any JSON value as ``google.protobuf.Value`` (the server checks that it is text)."""
    if isinstance(content, str):  # the common case, ten times faster than ParseDict
        return struct_pb2.Value(string_value=content)
    return json_format.ParseDict(content, struct_pb2.Value())


def messages_from_pb(messages: Sequence[pb.ChatMessage]) -> tuple[MessageIn, ...]:
    return tuple(MessageIn(m.role, json_of(m.content),
                           cache_control=control_from_pb(m.cache_control)
                           if m.HasField("cache_control") else None) for m in messages)


def control_from_pb(control: pb.CacheControl) -> dict[str, Json]:
    """A ``CacheControl`` message as the JSON object the HTTP API takes."""
    out: dict[str, Json] = {"type": control.type}
    if control.HasField("ttl"):
        out["ttl"] = control.ttl
    return out


def control_to_pb(control: Json) -> pb.CacheControl:
    if not isinstance(control, dict) or not all(isinstance(v, str) for v in control.values()):
        raise FieldError("cache_control", 'must be {"type": "ephemeral", "ttl": "5m" or "1h"}')
    out = pb.CacheControl(type=control.get("type", ""))
    if "ttl" in control:
        out.ttl = control["ttl"]
    return out


def cache_from_pb(request: pb.Request) -> CacheIn:
    use = request.cache
    return CacheIn(
        control=control_from_pb(request.cache_control)
        if request.HasField("cache_control") else None,
        salt=request.cache_salt, key=request.prompt_cache_key,
        read=use.read if use.HasField("read") else True,
        write=use.write if use.HasField("write") else True,
        breakpoints=tuple(TokenBreakpoint(b.tokens, b.ttl) for b in request.cache_breakpoints))


def cache_to_pb(cache: CacheIn, out: pb.Request) -> None:
    if cache.control is not None:
        out.cache_control.CopyFrom(control_to_pb(cache.control))
    out.cache_salt, out.prompt_cache_key = cache.salt, cache.key
    if not cache.read:
        out.cache.read = False
    if not cache.write:
        out.cache.write = False
    for mark in cache.breakpoints:
        out.cache_breakpoints.add(tokens=mark.tokens, ttl=mark.ttl)


def request_from_pb(request: pb.Request) -> RequestIn:
    kind = request.WhichOneof("prompt")
    prompt = (Messages(messages_from_pb(request.messages.messages)) if kind == "messages"
              else Tokens(tuple(request.tokens.ids)) if kind == "tokens" else None)
    s = request.sampling
    fmt = (format_from_pb(request.response_format) if request.HasField("response_format")
           else None)
    return RequestIn(request.custom_id, prompt, SamplingIn(
        max_tokens=s.max_tokens, temperature=s.temperature,
        top_p=s.top_p if s.HasField("top_p") else None, seed=s.seed, stop=tuple(s.stop)),
        response_format=fmt, logprobs=request.logprobs, top_logprobs=request.top_logprobs,
        cache=cache_from_pb(request))


def format_from_pb(fmt: pb.ResponseFormat) -> dict[str, Json]:
    """A ``ResponseFormat`` message as the JSON object the HTTP API takes."""
    out: dict[str, Json] = {"type": fmt.type}
    if fmt.HasField("json_schema"):
        spec = fmt.json_schema
        out["json_schema"] = {"name": spec.name, "strict": spec.strict}
        if spec.HasField("schema"):
            out["json_schema"]["schema"] = _whole_numbers(
                json_of(struct_pb2.Value(struct_value=spec.schema)))
    return out


def format_to_pb(fmt: dict[str, Json]) -> pb.ResponseFormat:
    out = pb.ResponseFormat(type=str(fmt.get("type", "")))
    spec = fmt.get("json_schema")
    if isinstance(spec, dict):
        out.json_schema.SetInParent()
        out.json_schema.name = str(spec.get("name") or "")
        out.json_schema.strict = bool(spec.get("strict"))
        if isinstance(spec.get("schema"), dict):
            json_format.ParseDict(spec["schema"], out.json_schema.schema)
    return out


def _whole_numbers(value: Json) -> Json:
    """A JSON value read from protobuf (every number a double), its whole numbers integers."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    return value


class RequestsFromPb(Sequence[RequestIn]):
    """A job's protobuf requests, each converted as it is read: the job's size is checked
    before any is, and intake reads them in its worker thread, off the event loop."""

    def __init__(self, requests: Sequence[pb.Request]):
        self._requests = requests

    def __len__(self) -> int:
        return len(self._requests)

    @overload
    def __getitem__(self, index: int) -> RequestIn: ...
    @overload
    def __getitem__(self, index: slice) -> list[RequestIn]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [request_from_pb(r) for r in self._requests[index]]
        return request_from_pb(self._requests[index])


def request_to_pb(request: RequestIn) -> pb.Request:
    out = pb.Request(custom_id=request.custom_id)
    if isinstance(request.prompt, Messages):
        out.messages.SetInParent()  # an empty list is still the messages kind
        for m in request.prompt.items:
            message = out.messages.messages.add(role=m.role)
            if m.content is not ABSENT:
                message.content.CopyFrom(content_value(m.content))
            if m.cache_control is not None:
                message.cache_control.CopyFrom(control_to_pb(m.cache_control))
    elif isinstance(request.prompt, Tokens):
        out.tokens.SetInParent()
        out.tokens.ids.extend(request.prompt.ids)
    s = request.sampling
    if s != SamplingIn():  # all defaults: as protobuf reads no sampling at all
        out.sampling.CopyFrom(pb.SamplingParams(max_tokens=s.max_tokens,
                                                temperature=s.temperature, seed=s.seed,
                                                stop=s.stop))
        if s.top_p is not None:
            out.sampling.top_p = s.top_p
    if request.tools is not None or any(
            m.tool_calls is not None or m.tool_call_id is not None
            for m in (request.prompt.items if isinstance(request.prompt, Messages) else ())):
        raise RuntimeError("tools and tool messages do not travel in orchard.v1.Request; the "
                           "edge refuses them in a job")
    if isinstance(request.response_format, dict):
        out.response_format.CopyFrom(format_to_pb(request.response_format))
    elif request.response_format is not None:  # validation refuses it before it is stored
        raise RuntimeError("response_format: not an object; check the request first")
    out.logprobs, out.top_logprobs = request.logprobs, request.top_logprobs
    cache_to_pb(request.cache, out)
    return out
