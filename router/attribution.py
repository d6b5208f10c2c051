"""Why a request missed: one cause for every miss or partial hit.

``MissAttributor`` sits where every routed request is seen (the frontend, or the simulator)
and keeps a bounded history of which worker last used which block, which tenants have sent
the same tokens, and which child each block had. For a request that did not reuse all it
could, it looks at the first full block it did not reuse (``k`` below) and names one cause,
checked in this order::

    prompt  [ b0 ][ b1 ][ b2 ][ b3 ][ tail ]
    cached  [ b0 ][ b1 ]                        k = 2: why was b2 not read?

    1. shorter_than_block  the prompt has no full block that may be reused
                           (it is at most ``block_size`` tokens long)
    2. routed_elsewhere    another worker held more of the prefix at routing time (the
                           router's candidates), or by this history still holds b2 and
                           was not a candidate (draining, say)
    3. ttl_expired         the chosen worker (or the last one) used b2 ``ttl_s`` or more ago
    4. invalidated         the tenant's blocks were invalidated after b2's last use
    5. evicted             b2 was used there less than ``ttl_s`` ago and is gone: capacity
    6. tenant_boundary     the same tokens were seen under another tenant's namespace
    7. near_miss           a stored sequence shares the prompt's run and diverges inside or
                           right at b2 (template drift, a mutating block near the top): the
                           engine's lookup says so, or b2's parent had another child
    8. first_sight         none of the above: these tokens were never seen

A request whose worker pulled part of its prefix from a peer first (``RequestSeen.
pulled_tokens``) is neither a plain hit nor a plain miss: its cause is ``pulled_from_peer``
(the peer as ``holder``, the tokens pulled as ``pulled_tokens``), whatever it then read or
computed. Pulled tokens are read from the receiver's store, so they are priced as
``cache_read`` tokens (``router/prices.toml`` has no price of their own).

Concurrent requests: history is read as it stood when the request was sent (``sent``), so
blocks another request stored while this one was in flight count as never seen. Two requests
that compute the same new prefix at once are then both first_sight (or both near_miss),
whichever finishes first, and the causes do not depend on finishing order. What still
depends on timing is routing: which worker a request is sent to, and so whether a sibling's
blocks were stored there before it was sent; the report says so (``TIMING_DEPENDENT``).

A request that reused every token it could (``reusable_tokens`` of its full blocks) is a
hit and gets no cause. ``Attribution.tokens`` is the request's computed tokens, so summing
it per cause splits a job's prefill work by why it was not read from cache.

Tiers: the tokens a request did read came from its worker's memory tier, its disk tier, or
both (``RequestSeen.disk_tokens`` of its cached tokens were read from disk). ``served_from``
names that (``ServedTier``) for every request, hit or not, and a miss's ``Attribution``
carries it with the disk tokens: a partial hit read from disk is a capacity story (memory
too small, disk large enough), one read from memory is not.

Time is passed in (``now`` in seconds); the TTL rule is the store's: from last use.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Sequence

from router.kv.key import BlockHash, Namespace, hash_blocks, reusable_tokens


class ServedTier(str, Enum):
    """Which of the worker's store tiers the request's cached tokens came from."""

    NONE = "none"            # nothing was read
    MEMORY = "memory"
    DISK = "disk"
    BOTH = "memory+disk"     # a memory prefix, continued on disk


def served_from(cached_tokens: int, disk_tokens: int) -> ServedTier:
    """The tier(s) of ``cached_tokens`` tokens read, ``disk_tokens`` of them from disk."""
    if not 0 <= disk_tokens <= cached_tokens:
        raise ValueError(f"disk_tokens must be within [0, cached_tokens = {cached_tokens}], "
                         f"got {disk_tokens}")
    if cached_tokens == 0:
        return ServedTier.NONE
    if disk_tokens == 0:
        return ServedTier.MEMORY
    return ServedTier.DISK if disk_tokens == cached_tokens else ServedTier.BOTH


class MissCause(str, Enum):
    SHORTER_THAN_BLOCK = "shorter_than_block"
    ROUTED_ELSEWHERE = "routed_elsewhere"
    TTL_EXPIRED = "ttl_expired"
    INVALIDATED = "invalidated"
    EVICTED = "evicted"
    TENANT_BOUNDARY = "tenant_boundary"
    NEAR_MISS = "near_miss"
    FIRST_SIGHT = "first_sight"
    PULLED_FROM_PEER = "pulled_from_peer"   # its prefix was pulled from a peer first


# Between these causes the split follows routing order, which concurrency makes timing-
# dependent (which sibling's blocks were stored before the other was sent); their sum, the
# tokens no request had stored before, does not.
TIMING_DEPENDENT = frozenset({MissCause.NEAR_MISS, MissCause.FIRST_SIGHT})


@dataclass(frozen=True, slots=True)
class Attribution:
    cause: MissCause
    tokens: int        # the request's computed tokens
    holder: str = ""   # routed_elsewhere: a worker that held more of the prefix
    served: ServedTier = ServedTier.NONE  # the tier(s) its cached tokens came from
    disk_tokens: int = 0                  # of its cached tokens, read from disk
    pulled_tokens: int = 0                # pulled_from_peer: tokens pulled from ``holder``


@dataclass(frozen=True, slots=True)
class RequestSeen:
    """One finished request as the attributor needs it."""

    namespace: Namespace
    prompt: Sequence[int]
    worker: str
    cached_tokens: int
    written_tokens: int
    # Matched tokens per worker at routing time (the router's candidates); may be empty.
    candidate_matches: Mapping[str, int] = field(default_factory=dict)
    engine_near_miss: bool = False   # the worker's lookup said near_miss
    block_hashes: Sequence[BlockHash] = ()  # the prompt's chain when already computed
    sent: float | None = None   # when it was sent (attributor's clock); None: when observed
    disk_tokens: int = 0        # of cached_tokens, read from the worker's disk tier
    pulled_tokens: int = 0      # of cached_tokens, pulled from a peer just before it ran
    pulled_from: str = ""       # that peer


class _Bounded(OrderedDict):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.limit:
            self.popitem(last=False)


class MissAttributor:
    """Bounded history of block use; ``observe`` attributes a request and then records it."""

    def __init__(self, block_size: int, ttl_s: float, max_blocks: int = 1_000_000) -> None:
        if block_size <= 0 or ttl_s <= 0 or max_blocks <= 0:
            raise ValueError("block_size, ttl_s and max_blocks must be positive")
        self.block_size = block_size
        self.ttl_s = ttl_s
        self._used: _Bounded = _Bounded(max_blocks)      # block -> {worker: last use}
        self._tenants: _Bounded = _Bounded(max_blocks)   # tenant-free block -> {tenant: when}
        self._child: _Bounded = _Bounded(max_blocks)     # parent block -> (first child, when)
        self._born: _Bounded = _Bounded(max_blocks)      # block -> when first stored
        self._invalidated: dict[str, float] = {}         # tenant -> time of last invalidation

    def invalidated(self, tenant: str, now: float) -> None:
        """Record that ``tenant``'s cached blocks were invalidated at ``now`` (on every
        worker, as the admin API does)."""
        self._invalidated[tenant] = now

    def forget_worker(self, worker: str) -> None:
        for users in self._used.values():
            users.pop(worker, None)

    def held(self, chain: Sequence[BlockHash], now: float) -> dict[BlockHash, float]:
        """The leading blocks of ``chain`` some worker used within the TTL, with TTL left."""
        out: dict[BlockHash, float] = {}
        for block in chain:
            users = self._used.get(block)
            left = self.ttl_s - (now - max(users.values())) if users else 0.0
            if left <= 0:
                break
            out[block] = left
        return out

    def observe(self, seen: RequestSeen, now: float) -> Attribution | None:
        """The cause of ``seen``'s miss (None for a hit), then remember what it did."""
        chain = list(seen.block_hashes) or hash_blocks(seen.prompt, self.block_size, seen.namespace)
        neutral_ns = Namespace("*", seen.namespace.model, seen.namespace.revision,
                               seen.namespace.adapter)
        neutral = hash_blocks(seen.prompt, self.block_size, neutral_ns)
        if len(chain) != len(neutral):
            raise ValueError(f"block_hashes has {len(chain)} blocks but the prompt has "
                             f"{len(neutral)} full blocks of {self.block_size}")
        served = served_from(seen.cached_tokens, seen.disk_tokens)
        result = self._attribute(seen, chain, neutral, now)
        self._remember(seen, chain, neutral, now)
        if seen.pulled_tokens:
            return Attribution(MissCause.PULLED_FROM_PEER, len(seen.prompt) - seen.cached_tokens,
                               seen.pulled_from, served, seen.disk_tokens, seen.pulled_tokens)
        if result is None:
            return None
        return Attribution(result.cause, result.tokens, result.holder, served, seen.disk_tokens)

    def _attribute(self, seen: RequestSeen, chain: list[BlockHash],
                   neutral: list[BlockHash], now: float) -> Attribution | None:
        computed = len(seen.prompt) - seen.cached_tokens
        best = reusable_tokens(len(seen.prompt), len(chain), self.block_size)
        if best == 0:
            return Attribution(MissCause.SHORTER_THAN_BLOCK, computed)
        if seen.cached_tokens >= best:
            return None
        k = min(math.ceil(seen.cached_tokens / self.block_size), len(chain) - 1)
        block = chain[k]
        sent = now if seen.sent is None else seen.sent
        # A block first stored after this request was sent was not there to read.
        users = self._used.get(block, {}) if self._born.get(block, -math.inf) <= sent else {}
        holder = self._elsewhere(seen, users, now)
        if holder:
            return Attribution(MissCause.ROUTED_ELSEWHERE, computed, holder)
        last = users.get(seen.worker)
        if last is None and users:
            last = max(users.values())
        if last is not None:
            if now - last >= self.ttl_s:
                return Attribution(MissCause.TTL_EXPIRED, computed)
            if self._invalidated.get(seen.namespace.tenant, -math.inf) >= last:
                return Attribution(MissCause.INVALIDATED, computed)
            return Attribution(MissCause.EVICTED, computed)
        tenants = self._tenants.get(neutral[k], {})
        if any(t != seen.namespace.tenant and at <= sent for t, at in tenants.items()):
            return Attribution(MissCause.TENANT_BOUNDARY, computed)
        parent = chain[k - 1] if k else seen.namespace.root()
        sibling, born = self._child.get(parent, (None, math.inf))
        if seen.engine_near_miss or (sibling is not None and sibling != block and born <= sent):
            return Attribution(MissCause.NEAR_MISS, computed)
        return Attribution(MissCause.FIRST_SIGHT, computed)

    def _elsewhere(self, seen: RequestSeen, users: Mapping[str, float], now: float) -> str:
        """A worker that held more of the prefix: the router's candidates are authoritative
        for the workers they list; history speaks for the others (draining ones, say)."""
        matches = seen.candidate_matches
        better = [(m, w) for w, m in matches.items()
                  if w != seen.worker and m > seen.cached_tokens]
        if better:
            return max(better)[1]
        alive = [(t, w) for w, t in users.items()
                 if w != seen.worker and w not in matches and now - t < self.ttl_s]
        return max(alive)[1] if alive else ""

    def _remember(self, seen: RequestSeen, chain: list[BlockHash],
                  neutral: list[BlockHash], now: float) -> None:
        held = math.ceil(seen.cached_tokens / self.block_size) + seen.written_tokens // self.block_size
        for i, block in enumerate(chain):
            if i < held:
                users = self._used.get(block) or {}
                users[seen.worker] = now
                self._used.put(block, users)
                if block not in self._born:
                    self._born.put(block, now)
            tenants = self._tenants.get(neutral[i]) or {}
            tenants.setdefault(seen.namespace.tenant, now)
            self._tenants.put(neutral[i], tenants)
            parent = chain[i - 1] if i else seen.namespace.root()
            if parent not in self._child:
                self._child.put(parent, (block, now))
