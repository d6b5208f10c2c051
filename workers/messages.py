"""Typed messages between the cluster and a worker's engine (frozen, slotted dataclasses).

The cluster builds a ``GenerateRequest`` (prompt already tokenized, namespace resolved), the
engine answers with a ``GenerateResult`` carrying what it did and how long it took, including
the prefix store's ``LookupReport``. Timestamps are ``time.time_ns()`` values so that a caller
in another process can place spans for the lookup, the prefill and the decode afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Iterable

from router.kv.key import Namespace


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What a request's output must be (``workers.engine.constraints`` enforces it).

    ``kind``: ``json_object`` (any JSON object), ``json_schema`` (``schema``: the schema as
    canonical JSON text, so equal schemas are one cache entry), ``regex`` (``pattern``) or
    ``choice`` (exactly one of ``choices``) or ``lark`` (``pattern``: a grammar the cluster
    builds itself, e.g. for a required tool call).
    """

    kind: str
    schema: str = ""
    pattern: str = ""
    choices: tuple[str, ...] = ()
    name: str = ""        # the schema's name, as the client gave it
    strict: bool = False  # the client asked for strict validation (always enforced here)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings; the model's EOS tokens always stop
    response_format: ResponseFormat | None = None  # None: free text
    # None: no log-probabilities; N (0..20): each output token's, with the N likeliest
    # alternatives. Of the model's logits before temperature and any mask.
    logprobs: int | None = None


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability, and the likeliest tokens at that step (most
    likely first; ties by token id)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Priority(StrEnum):
    """Who waits on a request: a person (``INTERACTIVE``, the default for single requests) or
    a job's wall time (``BATCH``, the default for jobs). Interactive requests are admitted and
    prefilled first, in the engine (``workers.engine.scheduler``) and in the cluster's slots;
    only interactive requests are ever shed under load."""

    INTERACTIVE = "interactive"
    BATCH = "batch"
CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # the TTLs a request may ask for (Anthropic's)


@dataclass(frozen=True, slots=True)
class CacheControls:
    """What a request asks of the prefix store (the cluster's ``cluster.api.cache_fields``
    checks them): everything is computed whatever these say; only reuse and storing change.

    ``read``: reuse cached K/V (False: the whole prompt is computed). ``write``: store new
    blocks (False: nothing is stored, nor kept for the next turn). ``write_limit``: store
    only the full blocks of the first ``write_limit`` tokens (the last breakpoint; None: every
    full block, the output's included). ``ttl_s``: how long written blocks are kept idle
    (None: the store's own TTL). ``session``: the client's session or prompt cache key, which
    the router uses as a tie-break only (``router.policy``).
    """

    read: bool = True
    write: bool = True
    write_limit: int | None = None
    ttl_s: float | None = None
    session: str = ""

    def __post_init__(self) -> None:
        if self.write_limit is not None and self.write_limit < 0:
            raise ValueError(f"write_limit must be >= 0 tokens, got {self.write_limit}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive seconds, got {self.ttl_s}")

    def writable(self, tokens: int) -> int:
        """How many of a sequence's first ``tokens`` tokens may be stored."""
        if not self.write:
            return 0
        return tokens if self.write_limit is None else min(tokens, self.write_limit)

    @property
    def keeps(self) -> bool:
        """Whether a finished request's whole cache may be kept for the next turn: only when
        nothing stops writing (a kept cache holds every token, past any breakpoint)."""
        return self.write and self.write_limit is None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    namespace: Namespace
    prompt: tuple[int, ...]  # token ids, chat template already applied
    sampling: SamplingParams
    # W3C trace context (``traceparent``/``tracestate``) carried across process boundaries.
    trace_context: tuple[tuple[str, str], ...] = ()
    # A batch job's request: throughput first. The step budget's decode-stall bound protects
    # only the decodes of interactive requests (``workers.engine.scheduler``).
    batch: bool = False
    cache: CacheControls = CacheControls()

    @property
    def priority(self) -> Priority:
        """``BATCH`` for a request with ``batch`` set, else ``INTERACTIVE``."""
        return Priority.BATCH if self.batch else Priority.INTERACTIVE


class LookupOutcome(str, Enum):
    HIT = "hit"              # every reusable token came from the store
    PARTIAL = "partial"      # a prefix came from the store; the prompt runs past what is stored
    NEAR_MISS = "near_miss"  # the closest stored sequence diverges from the prompt
    MISS = "miss"            # nothing reusable and no stored sequence shares a prefix


@dataclass(frozen=True, slots=True)
class LookupReport:
    outcome: LookupOutcome
    prompt_tokens: int
    matched_tokens: int           # tokens reused from the store (<= prompt_tokens - 1)
    common_prefix: int            # longest common prefix with the closest stored sequence
    next_prompt_token: int | None  # the prompt's token at ``common_prefix`` (None at its end)
    next_stored_token: int | None  # the stored sequence's token there (None where it ends)
    entry_age_s: float | None     # age of the deepest matched block, None on a miss
    ttl_s: float
    disk_tokens: int = 0          # of matched_tokens, those read from the disk tier
    # past matched_tokens, those reused from a finished request's kept cache: the partial
    # block after the store's match, which the store (whole blocks only) cannot hold
    kept_tokens: int = 0
    # blocks refused because the block under the prompt's hash is another block (its
    # namespace, parent, position or tokens differ): a collision, served as a miss
    identity_mismatches: int = 0

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens not computed: the store's match and the kept tail."""
        return self.matched_tokens + self.kept_tokens

    def line(self) -> str:
        """The line an engineer reads: ``common=5919 of 5923``."""
        return f"common={self.common_prefix} of {self.prompt_tokens}"


@dataclass(frozen=True, slots=True)
class Timings:
    """Wall-clock ``time_ns`` stamps of one request's phases on the worker."""

    received_ns: int
    lookup_start_ns: int
    lookup_end_ns: int
    prefill_start_ns: int
    first_token_ns: int
    finished_ns: int


@dataclass(frozen=True, slots=True)
class GenerateResult:
    request_id: str
    output_tokens: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    ttft_s: float       # request received -> first output token
    tpot_s: float       # mean time per output token after the first (0.0 for one token)
    input_tokens: int   # prompt tokens, cached ones included
    cached_tokens: int  # read from the store
    computed_tokens: int  # prefilled (input_tokens - cached_tokens)
    written_tokens: int   # newly stored in the store by this request
    lookup: LookupReport
    timings: Timings
    worker_id: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # "stop": the stop string that ended it
    logprobs: tuple[TokenLogprob, ...] = ()  # one per output token, when the request asked
    drafted_tokens: int = 0   # speculative decoding: tokens drafted for this request
    accepted_tokens: int = 0  # of those, accepted into its output


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What an opened engine says of the model it serves (``Engine.facts``): a worker reports
    it when it starts, and the cluster's ``ModelInfo`` is made from it."""

    model_id: str
    revision: str
    vocab_size: int
    max_context: int          # prompt + output tokens may not exceed this
    block_size: int           # tokens per cache block
    kv_bytes_per_token: int   # the memory tier's, as the store accounts it
    disk_kv_bytes_per_token: int = 0  # the disk tier's (0: none)


class WorkerFailed(RuntimeError):
    """A worker's engine broke (or the worker left) under a request: retry it elsewhere."""


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """A worker's disk tier (or several workers' summed), as operators read it."""

    blocks: int
    bytes: int
    capacity_bytes: int
    free_bytes: int | None  # the file system's free space (None: unreadable)
    corrupt: int           # files that failed verification on read: deleted, never served
    torn: int              # truncated or half-written files found at start: deleted
    outdated: int          # files of an older format found at start: deleted
    full: bool             # writes stopped: the file system is full
    evictions: int = 0     # blocks the tier evicted for capacity so far

    @classmethod
    def total(cls, tiers: Iterable[DiskTierStats]) -> DiskTierStats | None:
        """Several workers' tiers summed (free space: None if any is unknown)."""
        tiers = list(tiers)
        if not tiers:
            return None
        free = [t.free_bytes for t in tiers]
        return cls(sum(t.blocks for t in tiers), sum(t.bytes for t in tiers),
                   sum(t.capacity_bytes for t in tiers),
                   None if None in free else sum(free),  # type: ignore[arg-type]
                   sum(t.corrupt for t in tiers), sum(t.torn for t in tiers),
                   sum(t.outdated for t in tiers), any(t.full for t in tiers),
                   sum(t.evictions for t in tiers))


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker's engine and store, as ``workers.engine.runtime`` counts them."""

    running: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_blocks: int
    written_tokens: int    # the store's stored blocks x block size (``Engine.written_tokens``)
    input_tokens: int
    cached_tokens: int
    requests_served: int
    evictions: int = 0     # blocks the store evicted so far (capacity)
    expirations: int = 0   # blocks the store dropped after their TTL so far
    disk: DiskTierStats | None = None  # None: no disk tier
