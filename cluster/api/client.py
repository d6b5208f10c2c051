"""A Python client for orchard's gRPC API (blocking; one channel per ``Client``).

    from cluster.api.client import Client, chat_request
    with Client.from_run_dir("run") as client:   # address, a tenant key, TLS files: the run dir
        job = client.submit([chat_request("q1", [{"role": "user", "content": "Hi"}], 32)])
        job = client.wait(job.job_id, on_progress=print)
        for result in client.results(job.job_id):
            print(result.custom_id, result.text, result.usage.cached_tokens)

Jobs come back as ``JobStatus``; results and workers as the orchard.v1 messages. A failed call
raises ``OrchardError`` carrying the gRPC status name and the server's message (which names
the offending field); a connection that TLS refused (``UNAVAILABLE``, "Socket closed") says
instead which side refused and what to pass (``cluster.api.tls_probe``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import grpc
import grpc.experimental  # ChannelOptions
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import default_run_dir, load_config
from cluster.api.convert import STATE_NAMES, content_value
from cluster.api.tls_probe import explain
from cluster.tls import ClientTls, client_tls
from cluster.telemetry.setup import inject_metadata
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc


CHUNK_BYTES = 1 << 20     # a batch file goes to the server in pieces of this size
FILE_TIMEOUT_S = 600.0    # the deadline of a file submission (a 200 MB file takes ~20 s)


class OrchardError(Exception):
    """A call's status; ``retry_after_s`` is the server's ``retry-after`` trailer (a request
    shed under load or over its tenant's quota), None without one."""

    def __init__(self, code: str, message: str, retry_after_s: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class JobStatus:
    job_id: str
    tenant: str
    state: str          # "queued" | "running" | "succeeded" | "cancelled"
    total: int
    completed: int
    failed: int
    cancelled: int
    model: str
    created_unix_ms: int
    finished_unix_ms: int
    priority: str = "batch"   # "batch" | "interactive": the lane its requests take

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "cancelled")

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @classmethod
    def from_pb(cls, job: pb.Job) -> JobStatus:
        return cls(job.job_id, job.tenant, STATE_NAMES.get(job.state, "unknown"), job.total,
                   job.completed, job.failed, job.cancelled, job.model, job.created_unix_ms,
                   job.finished_unix_ms,
                   "interactive" if job.priority == pb.PRIORITY_INTERACTIVE else "batch")


def sampling(max_tokens: int, temperature: float = 0.0, top_p: float | None = None,
             seed: int = 0, stop: Sequence[str] = ()) -> pb.SamplingParams:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                               stop=list(stop))
    if top_p is not None:
        params.top_p = top_p
    return params


def chat_request(custom_id: str, messages: Sequence[dict[str, Any]], max_tokens: int,
                 **params: Any) -> pb.Request:
    chat = [pb.ChatMessage(role=str(m.get("role", "")), content=content_value(m.get("content")))
            for m in messages]
    return pb.Request(custom_id=custom_id, messages=pb.Messages(messages=chat),
                      sampling=sampling(max_tokens, **params))


def token_request(custom_id: str, token_ids: Sequence[int], max_tokens: int,
                  **params: Any) -> pb.Request:
    return pb.Request(custom_id=custom_id, tokens=pb.TokenIds(ids=list(token_ids)),
                      sampling=sampling(max_tokens, **params))


class Client:
    def __init__(self, address: str, api_key: str, timeout_s: float = 60.0,
                 tls: ClientTls | None = None):
        options = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20),  # big jobs: one SubmitJob
                   # server streams (results, generate) read on the calling thread: faster
                   (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
        self._channel = (grpc.insecure_channel(address, options=options) if tls is None else
                         grpc.secure_channel(address, tls.channel_credentials(), options=options))
        self._address, self._tls = address, tls
        self._auth = (("authorization", f"Bearer {api_key}"),)
        self._timeout_s = timeout_s
        self._jobs = pb_grpc.JobsStub(self._channel)
        self._generate = pb_grpc.GenerateStub(self._channel)
        self._admin = pb_grpc.AdminStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """The API key, and the caller's trace context (W3C ``traceparent``) when it has one."""
        return self._auth + tuple(inject_metadata())

    @classmethod
    def from_run_dir(cls, run_dir: Path | str | None = None, tenant: str | None = None,
                     admin: bool = False, api_key: str | None = None,
                     address: str | None = None, ca: Path | None = None,
                     cert: Path | None = None, key: Path | None = None) -> Client:
        """Find the frontend (``frontend.json``), a key (``orchard.toml``) and the TLS files
        (``--ca``/``--cert``/``--key``, else ``RUN/tls/``: ``cluster.tls.client_tls``)."""
        run_dir = Path(run_dir) if run_dir else default_run_dir()
        tls = client_tls(run_dir, ca, cert, key)
        address = address or os.environ.get("ORCHARD_ADDRESS") or frontend_address(run_dir)
        api_key = api_key or os.environ.get("ORCHARD_API_KEY")
        if not api_key:
            config = load_config(run_dir)
            if admin:
                api_key = sorted(config.admin_keys)[0] if config.admin_keys else None
            else:
                names = config.tenants()
                api_key = config.key_for(tenant or (names[0] if names else "default"))
            if not api_key:
                raise ValueError(f"no {'admin' if admin else 'tenant'} key in {run_dir}: "
                                 "pass --api-key or set ORCHARD_API_KEY")
        return cls(address, api_key, tls=tls)

    def close(self) -> None:
        self._channel.close()

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def _error(self, exc: grpc.RpcError) -> OrchardError:
        """The call's status; for UNAVAILABLE, what a TLS probe of the address found wrong
        (``cluster.api.tls_probe``: which side refused and why), when it found something."""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            why = explain(self._address, self._tls)
            if why is not None:
                return OrchardError(exc.code().name, why)
        retry = dict(exc.trailing_metadata() or ()).get("retry-after")
        return OrchardError(exc.code().name, exc.details() or "",
                            int(retry) if retry is not None and retry.isdigit() else None)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- jobs

    def submit(self, requests: Sequence[pb.Request], idempotency_key: str = "",
               priority: int = pb.PRIORITY_UNSPECIFIED) -> JobStatus:
        """Submit a job. With ``idempotency_key``, calling again after a lost answer returns
        the same job rather than a second one. ``priority``: ``pb.PRIORITY_INTERACTIVE`` for
        a job whose requests are served before batch work, else batch (the default)."""
        request = pb.SubmitJobRequest(requests=list(requests), idempotency_key=idempotency_key,
                                      priority=priority)
        job = self._call(self._jobs.SubmitJob, request,
                    metadata=self._metadata, timeout=self._timeout_s)
        return JobStatus.from_pb(job)

    def submit_file(self, path: Path | str, idempotency_key: str = "",
                    chunk_bytes: int = CHUNK_BYTES, on_sent: Callable[[int], None] | None = None,
                    priority: int = pb.PRIORITY_UNSPECIFIED) -> JobStatus:
        """Submit an OpenAI Batch input file (JSONL, up to 200 MB), streamed in chunks: the
        server checks each line's shape, stores the job and answers; a bad line is named
        (``FILE:LINE: ...``) and nothing is stored. ``on_sent(bytes)`` after each chunk;
        ``priority`` as in ``submit``."""
        path = Path(path)

        def chunks() -> Iterator[pb.BatchFileChunk]:
            sent = 0
            with path.open("rb") as f:
                first = pb.BatchFileChunk(file_name=path.name, idempotency_key=idempotency_key,
                                          priority=priority)
                while data := f.read(chunk_bytes):
                    first.data = data
                    yield first
                    first = pb.BatchFileChunk()
                    sent += len(data)
                    if on_sent is not None:
                        on_sent(sent)
                if sent == 0:
                    yield first  # an empty file: the server says so

        job = self._call(self._jobs.SubmitBatchFile, chunks(), metadata=self._metadata,
                    timeout=max(self._timeout_s, FILE_TIMEOUT_S))
        return JobStatus.from_pb(job)

    def job(self, job_id: str) -> JobStatus:
        return JobStatus.from_pb(self._call(self._jobs.GetJob, pb.GetJobRequest(job_id=job_id),
                                            metadata=self._metadata, timeout=self._timeout_s))

    def jobs(self, limit: int = 50, states: Sequence[str] = (), since_ms: int = 0
             ) -> list[JobStatus]:
        """Up to ``limit`` of this tenant's jobs, newest first (filtered as ``jobs_page``)."""
        jobs: list[JobStatus] = []
        token = ""
        while len(jobs) < limit:
            page, token = self.jobs_page(min(limit - len(jobs), 1000), token, states, since_ms)
            jobs += page
            if not token:
                break
        return jobs

    def jobs_page(self, page_size: int = 50, page_token: str = "", states: Sequence[str] = (),
                  since_ms: int = 0) -> tuple[list[JobStatus], str]:
        """One page of jobs in ``states`` (names: "queued", ...) created at or after
        ``since_ms``, and the token of the next page ("" after the last)."""
        by_name = {name: value for value, name in STATE_NAMES.items()}
        unknown = [s for s in states if s not in by_name]
        if unknown:
            raise ValueError(f"--state: unknown state {unknown[0]!r}; use "
                             f"{', '.join(by_name)}")
        request = pb.ListJobsRequest(page_size=page_size, page_token=page_token,
                                     states=[by_name[s] for s in states],
                                     created_after_unix_ms=since_ms)
        reply = self._call(self._jobs.ListJobs, request, metadata=self._metadata,
                      timeout=self._timeout_s)
        return [JobStatus.from_pb(j) for j in reply.jobs], reply.next_page_token

    def cancel(self, job_id: str) -> JobStatus:
        return JobStatus.from_pb(self._call(self._jobs.CancelJob,
                                            pb.CancelJobRequest(job_id=job_id),
                                            metadata=self._metadata, timeout=self._timeout_s))

    def results(self, job_id: str, offset: int = 0, follow: bool = False,
                timeout_s: float | None = None) -> Iterator[pb.Result]:
        """The job's results from ``offset`` on; with ``follow``, until the job finishes."""
        stream = self._jobs.StreamResults(
            pb.StreamResultsRequest(job_id=job_id, offset=offset, follow=follow),
            metadata=self._metadata, timeout=timeout_s)
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def wait(self, job_id: str, on_progress: Callable[[JobStatus], None] | None = None,
             poll_s: float = 0.5, timeout_s: float | None = None) -> JobStatus:
        """Poll until the job finishes, calling ``on_progress`` whenever its counts change."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last = None
        while True:
            job = self.job(job_id)
            if on_progress and (last is None or (job.state, job.done) != (last.state, last.done)):
                on_progress(job)
            if job.finished:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout_s} s")
            last = job
            time.sleep(poll_s)

    # ------------------------------------------------------------- generate

    def generate(self, request: pb.Request, timeout_s: float | None = None,
                 priority: int = pb.PRIORITY_UNSPECIFIED) -> Iterator[pb.GenerateResponse]:
        """Stream one request: ``delta`` events, then one ``result`` event. ``priority``:
        ``pb.PRIORITY_BATCH`` for work that may wait (never shed), else interactive."""
        stream = self._generate.Generate(pb.GenerateRequest(request=request, priority=priority),
                                         metadata=self._metadata, timeout=timeout_s)
        try:
            yield from stream
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    # ---------------------------------------------------------------- admin

    def workers(self) -> list[pb.Worker]:
        return list(self._call(self._admin.ListWorkers, pb.ListWorkersRequest(),
                          metadata=self._metadata, timeout=self._timeout_s).workers)

    def scale(self, workers: int, timeout_s: float = 600.0) -> list[pb.Worker]:
        return list(self._call(self._admin.Scale, pb.ScaleRequest(workers=workers),
                          metadata=self._metadata, timeout=timeout_s).workers)

    def drain(self, worker_id: str) -> pb.Worker:
        return self._call(self._admin.Drain, pb.DrainRequest(worker_id=worker_id),
                     metadata=self._metadata, timeout=self._timeout_s)

    def invalidate(self, tenant: str, messages: Sequence[dict[str, Any]] | None = None,
                   token_ids: Sequence[int] | None = None) -> int:
        request = pb.InvalidateRequest(tenant=tenant)
        if messages is not None:
            request.messages.CopyFrom(chat_request("", messages, 1).messages)
        elif token_ids is not None:
            request.tokens.CopyFrom(pb.TokenIds(ids=list(token_ids)))
        return self._call(self._admin.Invalidate, request, metadata=self._metadata,
                     timeout=self._timeout_s).blocks_removed

    def cache_stats(self) -> pb.CacheStats:
        return self._call(self._admin.GetCacheStats, pb.CacheStatsRequest(),
                     metadata=self._metadata, timeout=self._timeout_s)

    def health(self, service: str = "") -> str:
        reply = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                      timeout=self._timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def frontend_address(run_dir: Path) -> str:
    path = run_dir / "frontend.json"
    try:
        return json.loads(path.read_text())["address"]
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: is the cluster up? Start it with "
                                f"`orchard up --run-dir {run_dir}` or pass --address") from None
    except (ValueError, KeyError):
        raise ValueError(f"{path} is not a frontend address file; pass --address") from None
