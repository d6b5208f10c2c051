"""Conversions between orchard's dataclasses and the orchard.v1 protobuf messages.

Protobuf exists only at the gRPC edge: the servicers and the client convert here, everything
below them speaks dataclasses.
"""
from __future__ import annotations

from cluster.backend.protocol import CacheStats, WorkerInfo
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
                     hit_ratio=w.hit_ratio, requests_served=w.requests_served)


def stats_to_pb(s: CacheStats) -> pb.CacheStats:
    return pb.CacheStats(workers=s.workers, cache_bytes=s.cache_bytes,
                         cache_capacity_bytes=s.cache_capacity_bytes, cache_blocks=s.cache_blocks,
                         input_tokens=s.input_tokens, cached_tokens=s.cached_tokens,
                         computed_tokens=s.computed_tokens, written_tokens=s.written_tokens,
                         hit_ratio=s.hit_ratio)
