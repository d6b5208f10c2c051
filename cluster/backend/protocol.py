"""The Backend protocol: what the gRPC frontend needs from whatever runs the model.

The frontend (``cluster.api.frontend``) owns the public edge: auth, validation, tokenization, the
job store. Everything behind it — routing, workers, retries — is a ``Backend``:

    frontend ──► Backend.generate(request, block_hashes) ──► router ──► worker engine
                                                              │
              ◄── GenerateOutcome(result, decision, attempts) ◄┘

One implementation exists, ``cluster.backend.backend.Backend``, over worker handles; its two
constructors pick the workers: ``cluster.backend.local.LocalBackend`` (in-process engines and
the real router, no Ray; used by fast tests and ``python -m cluster.api.frontend``) and
``cluster.backend.ray_backend.RayBackend`` (worker actors across Ray nodes). Everything
crossing the protocol is a frozen, slotted dataclass; the router's ``RoutingDecision`` travels
back inside ``GenerateOutcome`` so that traces can carry it.

Errors: ``NoWorkerAvailable`` (the router's, re-exported here) when no worker can take a request
(the frontend answers ``UNAVAILABLE``); ``ValueError`` for bad input the frontend did not catch
(``INVALID_ARGUMENT``);
``UnknownWorker`` for an admin call naming a worker that does not exist (``NOT_FOUND``);
``NotOwned`` for scaling or draining workers another frontend started (``FAILED_PRECONDITION``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol, Sequence, runtime_checkable

from router.kv.key import BlockHash, Namespace
from router.policy import NoWorkerAvailable, RoutingDecision  # the router's, used unchanged
from workers.messages import (DiskTierStats, GenerateRequest, GenerateResult, ModelFacts,
                              TokenLogprob, WorkerStats)

if TYPE_CHECKING:   # wire imports this module's TokenChunk
    from cluster.backend.wire import PullOutcome


class UnknownWorker(LookupError):
    """An admin call named a worker id the backend does not know."""


class NotOwned(Exception):
    """An admin call would change workers this frontend attached to but did not start
    (``cluster.backend.ray_attach``): their owner scales, drains and replaces them."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the frontend needs to validate and tokenize: the served model, as loaded."""

    model_id: str          # namespace model id, e.g. the model directory's name
    revision: str          # weights revision (part of the cache namespace)
    vocab_size: int
    max_context: int       # prompt + output tokens may not exceed this
    model_dir: str         # local mlx-lm model directory: tokenizer and chat template live here
    block_size: int        # tokens per cache block, one value per cluster
    kv_bytes_per_token: int  # the engine's memory tier, as its store accounts it
    disk_kv_bytes_per_token: int = 0  # its disk tier's (0: no disk tier)
    cache_secret: bytes = field(default=b"", repr=False)  # the workers' cache-key secret

    @classmethod
    def of(cls, facts: ModelFacts, model_dir: str, cache_secret: bytes) -> ModelInfo:
        """The model a worker reported (its ``WorkerHello``), served from ``model_dir``."""
        return cls(facts.model_id, facts.revision, facts.vocab_size, facts.max_context,
                   model_dir, facts.block_size, facts.kv_bytes_per_token,
                   facts.disk_kv_bytes_per_token, cache_secret)

    def namespace(self, tenant: str) -> Namespace:
        """``tenant``'s cache namespace on this model, keyed as the workers key theirs."""
        return Namespace(tenant, self.model_id, self.revision, secret=self.cache_secret)


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens produced since the previous chunk of a streamed request."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked


@dataclass(frozen=True, slots=True)
class GenerateOutcome:
    """A finished request, with how it was placed.

    ``decision`` is the router's ``RoutingDecision`` for the attempt that succeeded; ``None``
    under the round-robin baseline, which does not consult the router.
    """

    result: GenerateResult
    decision: RoutingDecision | None
    attempts: int          # 1 unless a worker died and the request was retried elsewhere
    worker_id: str
    # The worker's own wall time on the request: received -> result handed back, cache
    # writes included. 0.0 when the backend does not measure it (then the engine's
    # received -> last token stamps stand in).
    worker_s: float = 0.0
    # The worker actor drew this request's lookup / prefill / decode spans in its own process
    # (``cluster.telemetry.setup``): the frontend does not draw them again.
    worker_traced: bool = False
    # The prefix pulled from a peer before the request ran there (``cluster.backend.pull``),
    # when the decision planned one.
    pulled: PullOutcome | None = None

    def worker_time_s(self) -> float:
        t = self.result.timings
        return self.worker_s or (t.finished_ns - t.received_ns) / 1e9


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    node: str
    state: str             # "starting" | "ready" | "draining" | "dead"
    running: int           # requests in flight on the worker
    queued_tokens: int     # prefill tokens waiting on the worker
    cache_bytes: int
    cache_capacity_bytes: int
    cache_blocks: int
    hit_ratio: float       # token-weighted: cached / input tokens served so far (0.0 if none)
    requests_served: int
    evictions: int = 0     # blocks the worker's store evicted so far (capacity)
    expirations: int = 0   # blocks the worker's store dropped after their TTL so far
    disk: DiskTierStats | None = None  # its disk tier (None: none)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Cluster-wide prefix cache statistics (sums over live workers)."""

    workers: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_blocks: int
    input_tokens: int
    cached_tokens: int
    computed_tokens: int
    written_tokens: int
    disk: DiskTierStats | None = None  # the workers' disk tiers, summed (None: none has one)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    @classmethod
    def of(cls, stats: Sequence[WorkerStats]) -> CacheStats:
        """Sums over live workers' stats: the one way every backend counts."""
        return cls(
            workers=len(stats), cache_bytes=sum(s.cache_bytes for s in stats),
            cache_capacity_bytes=sum(s.cache_capacity_bytes for s in stats),
            cache_blocks=sum(s.cache_blocks for s in stats),
            input_tokens=sum(s.input_tokens for s in stats),
            cached_tokens=sum(s.cached_tokens for s in stats),
            computed_tokens=sum(s.input_tokens - s.cached_tokens for s in stats),
            written_tokens=sum(s.written_tokens for s in stats),
            disk=DiskTierStats.total(s.disk for s in stats if s.disk is not None))


@runtime_checkable
class Backend(Protocol):
    async def start(self) -> None:
        """Bring workers up; returns once at least one can serve."""

    async def close(self) -> None:
        """Stop workers and release resources; idempotent."""

    def model_info(self) -> ModelInfo:
        """The served model; valid after ``start``."""

    async def generate(
        self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
    ) -> GenerateOutcome:
        """Route, run on the chosen worker, retry elsewhere if that worker dies."""

    def stream(
        self, request: GenerateRequest, block_hashes: Sequence[BlockHash]
    ) -> AsyncIterator[TokenChunk | GenerateOutcome]:
        """Like ``generate`` but yields ``TokenChunk``s, then the ``GenerateOutcome`` last."""

    async def workers(self) -> list[WorkerInfo]:
        """Every known worker, draining and dead ones included."""

    async def scale(self, n: int) -> list[WorkerInfo]:
        """Add or drain-and-remove workers until ``n`` serve; returns the new list."""

    async def drain(self, worker_id: str) -> WorkerInfo:
        """Stop routing to ``worker_id``; it finishes what it has, then leaves."""

    async def invalidate(
        self, namespace: Namespace | None, prefix_tokens: Sequence[int] | None
    ) -> int:
        """Drop cached blocks of a namespace, or of a prompt prefix (within ``namespace``
        when given, in every namespace otherwise); returns the number of blocks removed."""

    async def cache_stats(self) -> CacheStats:
        """Sums over live workers."""
