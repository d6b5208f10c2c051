"""The job store's records: what goes in (``StagedRequest``), what comes out for dispatch
(``StoredRequest``, then ``PendingRequest`` once templated and tokenized), jobs and results,
and the store's domain errors. Plain frozen dataclasses; ``cluster.jobs.store`` owns the rows.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum

from workers.messages import CacheControls, Priority, SamplingParams, TokenLogprob


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"   # every request has a result (ok or an error)
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.CANCELLED)


class JobNotFound(LookupError):
    """No job with that id (for that tenant)."""


class JobFinished(RuntimeError):
    """The job already finished; the operation needs a running or queued job."""


class StoreFull(RuntimeError):
    """The job store's disk (or its size limit) is full: the job was not created."""


@dataclass(frozen=True, slots=True)
class StagedRequest:
    """A request as accepted: stored as sent, tokenized only when dispatched."""
    index: int          # its place in the job (the file's order)
    custom_id: str
    prefix: bytes       # dispatch order: requests sharing leading messages sort together
    body: bytes         # opaque to the store (a serialized orchard.v1.Request)


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A request read back for dispatch; ``position`` resumes the reading after it."""
    job_id: str
    index: int
    custom_id: str
    body: bytes
    position: tuple[bytes, int]

    @property
    def request_id(self) -> str:
        """Stable across restarts, so a rerun after a crash is the same request."""
        return f"{self.job_id}-{self.index}"


EXCERPT_TOKENS = 8  # a diagnosis quotes this many prompt tokens on each side of a divergence


@dataclass(frozen=True, slots=True)
class CacheDiagnosis:
    """Why a request's prompt was not all read from cache (``cache_diagnostics: true``).

    ``outcome``: the worker's lookup (hit, partial, near_miss, miss); ``reason``: the miss
    cause the observer attributes (``router.attribution``: first_sight, evicted,
    ttl_expired, near_miss, ...; "" on a hit, or untraced); ``diverged_at``: the prompt's
    first token past its longest common prefix with the nearest sequence the worker holds,
    ``message_index`` the message it falls in (None: a token prompt, or past every
    message), ``before`` and ``after`` the prompt's own tokens on each side of it.
    """

    cached_tokens: int
    prompt_tokens: int
    outcome: str
    reason: str
    diverged_at: int
    message_index: int | None
    before: tuple[int, ...]
    after: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheVerification:
    """A ``read: false`` request's answer beside the cached path's (``cache.verify``): the
    same prompt and sampling run again reading the store (writing nothing)."""

    same_tokens: bool
    cached_tokens: int                 # what the cached pass read
    first_difference: int | None       # the first output index where they differ


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request templated, tokenized and checked: what runs."""
    custom_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    cache: CacheControls = CacheControls()
    cache_salt: str = ""  # enters the namespace's root (router.kv.key)
    diagnose: bool = False  # cache_diagnostics: the result carries a CacheDiagnosis
    message_ends: tuple[int, ...] = ()  # with diagnose: where each message's tokens end
    verify: bool = False  # cache.verify: the result carries a CacheVerification


@dataclass(frozen=True, slots=True)
class PendingRequest:
    job_id: str
    index: int
    custom_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    cache: CacheControls = CacheControls()
    cache_salt: str = ""

    @property
    def request_id(self) -> str:
        """Stable across restarts, so a rerun after a crash is the same request."""
        return f"{self.job_id}-{self.index}"


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    tenant: str
    state: JobState
    total: int
    completed: int     # results with ok
    failed: int        # results with an error
    model: str
    created_ms: int
    finished_ms: int
    owner: str = ""    # the frontend that runs it (cluster.jobs.lease); "": nobody's
    # the lane its requests take in the runner's slots and the engine's admission
    priority: Priority = Priority.BATCH

    @property
    def cancelled(self) -> int:
        return self.total - self.completed - self.failed if self.state is JobState.CANCELLED else 0


@dataclass(frozen=True, slots=True)
class StoredResult:
    index: int
    custom_id: str
    request_id: str
    ok: bool
    error_code: str = ""
    error_message: str = ""
    text: str = ""
    output_tokens: tuple[int, ...] = ()
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    written_tokens: int = 0
    worker_id: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    attempts: int = 0
    worker_s: float = 0.0  # the worker's own time on the request (received -> finished)
    seq: int | None = None  # position in the job's result stream, assigned when recorded
    # Effective input multiplier forecast at routing time and measured (router.cost), and
    # the miss cause (router.attribution); None / "" when not traced or a hit.
    forecast_multiplier: float | None = None
    measured_multiplier: float | None = None
    miss_cause: str = ""
    # one per output token when the request asked (stored as [token, logprob, [[t, v], ...]])
    logprobs: tuple[TokenLogprob, ...] = ()
    # of written_tokens, the prompt's (router.cost.measured_usage), kept write_ttl_s seconds
    # idle: the request's TTL, or the store's when it asked none (0.0: not written / failed)
    written_input_tokens: int = 0
    write_ttl_s: float = 0.0
    stop_sequence: str = ""  # the stop string that ended the text ("": EOS, length, none)
    diagnosis: CacheDiagnosis | None = None  # asked by single requests only: never stored
    verification: CacheVerification | None = None  # likewise

    def to_json(self) -> str:
        body = asdict(self)
        del body["seq"]
        if self.logprobs:
            body["logprobs"] = [[t.token, t.logprob, t.top] for t in self.logprobs]
        else:  # results without them read as they always have
            del body["logprobs"]
        del body["diagnosis"], body["verification"]
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, seq: int, body: str) -> StoredResult:
        data = json.loads(body)
        data["output_tokens"] = tuple(data["output_tokens"])
        data["logprobs"] = tuple(
            TokenLogprob(token, logprob, tuple((t, v) for t, v in top))
            for token, logprob, top in data.get("logprobs", ()))
        return cls(seq=seq, **data)
