"""Conversions between orchard's dataclasses and the orchard.v1 protobuf messages.

Protobuf exists only at the gRPC edge: the servicers and the client convert here, everything
below them speaks dataclasses.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from cluster.api.validate import FieldError
from cluster.backend.protocol import CacheStats, WorkerInfo
from workers.messages import DiskTierStats
from cluster.jobs.store import JobRecord, JobState, StoredResult
from proto.orchard.v1 import orchard_pb2 as pb

JOB_STATES = {
    JobState.QUEUED: pb.JOB_STATE_QUEUED,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}
STATE_NAMES = {v: k.value for k, v in JOB_STATES.items()}


def job_to_pb(job: JobRecord) -> pb.Job:
    return pb.Job(job_id=job.job_id, tenant=job.tenant, state=JOB_STATES[job.state],
                  total=job.total, completed=job.completed, failed=job.failed,
                  cancelled=job.cancelled, created_unix_ms=job.created_ms,
                  finished_unix_ms=job.finished_ms, model=job.model)


def result_to_pb(r: StoredResult, model: str) -> pb.Result:
    return pb.Result(
        seq=r.seq or 0, index=r.index, custom_id=r.custom_id, request_id=r.request_id, ok=r.ok,
        error_code=r.error_code, error_message=r.error_message, text=r.text,
        output_tokens=r.output_tokens, finish_reason=r.finish_reason,
        usage=pb.Usage(prompt_tokens=r.prompt_tokens, completion_tokens=len(r.output_tokens),
                       cached_tokens=r.cached_tokens, computed_tokens=r.computed_tokens,
                       written_tokens=r.written_tokens),
        worker_id=r.worker_id, ttft_s=r.ttft_s, tpot_s=r.tpot_s, attempts=r.attempts,
        model=model, worker_s=r.worker_s)


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
                       outdated=d.outdated, full=d.full)


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
