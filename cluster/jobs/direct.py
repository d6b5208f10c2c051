"""One request outside any job: the jobs room's interface for ``Generate`` and the HTTP
completions (``cluster.api.work``), which need no job store but share everything else.

    direct = runner.direct
    with direct.admitted(tenant, priority,     one more pending request, counted until the
                         remaining_s) as ticket: block ends; or refused at once (``Overloaded``):
                                                 shed (``cluster.jobs.shedding``), over the
                                                 tenant's quota (``cluster.jobs.quotas``) or
                                                 past the pending limits
        request = ...validate and tokenize...
        async for item in direct.stream(tenant, request, metadata, remaining_s, priority,
                                        ticket):
            ...                                the tokens charged to the tenant's minute, then
                                               ``TokenChunk`` ... then one ``StoredResult``

Every refusal is counted (``orchard.requests.refused``, by tenant and reason). An interactive
request (the default) may be shed and is granted slots first; a ``BATCH`` one is never shed
and reaches the engine as a batch request (``GenerateRequest.batch``). An admitted
interactive request with a bound (its ``Ticket``'s ``first_token_by``) is refused as ``Late``
rather than served past it: when its slot comes too late for its worker's predicted TTFT, or
when its first token has not come by then (``cluster.jobs.shedding``).

``stream`` holds one of the runner's ``max_concurrent`` slots (``cluster.jobs.slots``: shared
with job requests, interactive first) while the request runs, traces it (``JobTracing.request``: a child
of the caller's trace when ``metadata`` carries one), and stops at the earlier of the
configured request timeout and the caller's own ``remaining_s`` (``TimeoutError``). Closing the
stream early aborts the request on its worker. Errors are the backend's own
(``NoWorkerAvailable``, ``ValueError``, ...), for the edge to map: a request outside a job has
no stored result to record them in.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable, Iterator, Sequence

from cluster.backend.protocol import Backend, GenerateOutcome, TokenChunk
from cluster.jobs.admission import Admission, Overloaded
from cluster.jobs.dispatch import dispatch, dispatch_stream, result_of
from cluster.jobs.quotas import QuotaExceeded, Quotas
from cluster.jobs.shedding import Late, LoadShedder, QueueState, Shed
from cluster.jobs.slots import SlotPool
from cluster.jobs.records import EXCERPT_TOKENS, CacheDiagnosis, CacheVerification
from cluster.jobs.store import NewRequest, StoredResult
from cluster.telemetry.job_tracing import JobTracing
from cluster.telemetry.observe import Observed
from router.kv.key import BlockHash, Namespace, hash_blocks
from workers.messages import GenerateRequest, Priority

Metadata = Sequence[tuple[str, str]]  # the caller's (gRPC or HTTP) headers: its trace context

MIN_TIMEOUT_S = 0.001  # a caller whose deadline has passed still gets a (failing) attempt


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request outside a job: by when its first token must come, on the
    ``Overload``'s clock (None: no ``max_ttft_s``, or a batch request; a caller's own
    deadline is its call's timeout instead)."""

    first_token_by: float | None = None
    bound_s: float = 0.0    # the configured bound it was admitted under (``max_ttft_s``)


@dataclass(frozen=True, slots=True)
class Overload:
    """What refuses a request outside a job before it runs, the clock its slot time is
    measured on (seconds), and the sleep that waits out a first-token bound."""

    shedder: LoadShedder
    quotas: Quotas
    clock: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # the first-token bound's alarm


class DirectRequests:
    """Built by the ``JobRunner`` over its own admission, slots, tracing and backend."""

    def __init__(self, backend: Backend, admission: Admission, slots: SlotPool,
                 tracing: JobTracing, namespace: Callable[[str], Namespace], block_size: int,
                 timeout_s: float, overload: Overload):
        self._backend = backend
        self._admission = admission
        self._slots = slots
        self._tracing = tracing
        self._namespace = namespace
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._overload = overload
        self._interactive = 0  # interactive requests admitted and not yet ended
        self._interactive_held = 0  # of those, the ones in a slot now

    def queue(self) -> QueueState:
        """The slots as a new interactive request finds them: those it takes turns on (less
        the batch floor while batch requests wait), and ahead of it, every interactive request
        admitted that holds no slot yet (being tokenized, or waiting for a slot). An
        interactive job's requests in their slots are not ahead of it (they drain with the
        slots), nor is the one each such job waits for at a time."""
        ahead = self._interactive - self._interactive_held
        return QueueState(self._slots.for_interactive(), self._slots.in_use(), max(0, ahead))

    @contextlib.contextmanager
    def admitted(self, tenant: str, priority: Priority = Priority.INTERACTIVE,
                 remaining_s: float | None = None) -> Iterator[Ticket]:
        """``with direct.admitted(tenant) as ticket:`` one pending request of ``tenant`` while
        the block runs; ``Overloaded`` (nothing counted, the refusal counted by reason) when it
        is shed, over the tenant's quota of requests in flight, or the tenant or cluster is
        full. The ticket says by when an interactive request's first token must come."""
        ticket = Ticket()
        with contextlib.ExitStack() as held:
            with self._refusals_counted(tenant):
                if priority is Priority.INTERACTIVE:
                    shedder = self._overload.shedder
                    shedder.check(self.queue(), remaining_s)
                    if shedder.max_ttft_s:  # the caller's own deadline is its timeout
                        ticket = Ticket(self._overload.clock() + shedder.max_ttft_s,
                                        shedder.max_ttft_s)
                retry_s = max(1, math.ceil(self._overload.shedder.slot_s or 1.0))
                held.enter_context(self._overload.quotas.in_flight(tenant, retry_s))
                held.enter_context(self._admission.admitted(tenant, 1))
            if priority is Priority.INTERACTIVE:
                held.callback(self._ended)
                self._interactive += 1
            yield ticket

    def _ended(self) -> None:
        self._interactive -= 1

    @contextlib.contextmanager
    def _refusals_counted(self, tenant: str) -> Iterator[None]:
        try:
            yield
        except QuotaExceeded as exc:
            self._tracing.refused(tenant, exc.reason)
            raise
        except Late:
            self._tracing.refused(tenant, "late")
            raise
        except Shed:
            self._tracing.refused(tenant, "shed")
            raise
        except Overloaded:
            self._tracing.refused(tenant, "pending")
            raise

    async def stream(self, tenant: str, request: NewRequest, metadata: Metadata = (),
                     remaining_s: float | None = None,
                     priority: Priority = Priority.INTERACTIVE, ticket: Ticket = Ticket()
                     ) -> AsyncIterator[TokenChunk | StoredResult]:
        """Run ``request`` (validated and tokenized) in a slot: its token chunks as the engine
        yields them, then its result; within the request timeout and ``remaining_s``. Its
        tokens (prompt + max_tokens) are charged to the tenant's quota first
        (``QuotaExceeded``). With the ticket's ``first_token_by``: ``Late`` when the slot
        comes too late for it, or the first token has not come by it."""
        with self._refusals_counted(tenant):
            self._overload.quotas.charge(tenant,
                                         len(request.prompt) + request.sampling.max_tokens)
        interactive = int(priority is Priority.INTERACTIVE)
        async with self._slots.slot(tenant, priority):
            started = self._overload.clock()
            self._interactive_held += interactive
            try:  # closed with this stream (a caller that leaves), not whenever collected
                by = ticket.first_token_by
                if by is not None:
                    self._in_time(tenant, ticket, started)
                async with contextlib.aclosing(self._run(tenant, request, metadata, remaining_s,
                                                         priority)) as items:
                    if by is not None:
                        first = await self._first_by(tenant, items, ticket)
                        if first is None:
                            return
                        yield first
                    async for item in items:
                        yield item
            finally:
                self._interactive_held -= interactive
                self._overload.shedder.observe_slot(self._overload.clock() - started)

    def _in_time(self, tenant: str, ticket: Ticket, now: float) -> None:
        """``Late`` when a request holding its slot at ``now`` cannot have its first token by
        the ticket's time, from its worker's predicted TTFT."""
        shedder = self._overload.shedder
        ttft = shedder.worker_ttft_s()
        if ttft is not None and now + ttft > ticket.first_token_by:
            with self._refusals_counted(tenant):
                raise shedder.late(self.queue(), ticket.bound_s, started=False)

    async def _first_by(self, tenant: str, items: AsyncIterator, ticket: Ticket):
        """The stream's first item if it comes by the ticket's time (None: the stream ended
        first), else the request is aborted (its stream cancelled) and refused as ``Late``."""
        shedder = self._overload.shedder
        left = max(0.0, ticket.first_token_by - self._overload.clock())
        nxt = asyncio.ensure_future(anext(items))
        alarm = asyncio.ensure_future(self._overload.sleep(left))
        try:
            await asyncio.wait([nxt, alarm], return_when=asyncio.FIRST_COMPLETED)
        finally:  # the caller may have left meanwhile: the request goes with it
            alarm.cancel()
            if not nxt.done():
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await nxt
        if nxt.cancelled():
            with self._refusals_counted(tenant):
                raise shedder.late(self.queue(), ticket.bound_s, started=True)
        try:
            return nxt.result()
        except StopAsyncIteration:
            return None

    async def _run(self, tenant: str, request: NewRequest, metadata: Metadata,
                   remaining_s: float | None, priority: Priority
                   ) -> AsyncIterator[TokenChunk | StoredResult]:
        request_id = f"gen-{secrets.token_hex(8)}"
        with self._tracing.request(tenant, request_id, "", request.custom_id,
                                   request.sampling, metadata, prompt=request.prompt) as trace:
            namespace = replace(self._namespace(tenant), salt=request.cache_salt)
            generate = GenerateRequest(request_id=request_id, namespace=namespace,
                                       prompt=request.prompt, sampling=request.sampling,
                                       trace_context=trace.context,
                                       batch=priority is Priority.BATCH, cache=request.cache)
            timeout_s = min(self._timeout_s, math.inf if remaining_s is None
                            else max(remaining_s, MIN_TIMEOUT_S))
            hashes = hash_blocks(request.prompt, self._block_size, generate.namespace)
            concluded = False
            try:
                async for item in dispatch_stream(self._backend, generate, hashes, timeout_s):
                    if isinstance(item, GenerateOutcome):
                        concluded = True
                        if priority is Priority.INTERACTIVE:
                            self._overload.shedder.observe_ttft(item.result.ttft_s)
                    if isinstance(item, GenerateOutcome) and (request.diagnose
                                                              or request.verify):
                        # the diagnosis names the observer's miss cause: traced first
                        observed = trace.done(generate, hashes, item)
                        result = result_of(0, request.custom_id, item, generate,
                                           self._block_size)
                        if request.diagnose:
                            result = replace(result,
                                             diagnosis=diagnosis_of(request, item, observed))
                        if request.verify:
                            result = replace(result, verification=await _verify_pass(
                                self._backend, generate, hashes, item, timeout_s))
                        yield result
                    elif isinstance(item, GenerateOutcome):
                        try:  # the caller gets its result first; the trace finishes after
                            yield result_of(0, request.custom_id, item, generate,
                                            self._block_size)
                            await asyncio.sleep(0)
                        finally:
                            trace.done(generate, hashes, item)
                    else:
                        yield item
            except (GeneratorExit, asyncio.CancelledError):
                if not concluded:  # the caller left: what it asked for still ran
                    trace.disconnected(len(request.prompt))
                raise


async def _verify_pass(backend: Backend, request: GenerateRequest, hashes: Sequence[BlockHash],
                       first: GenerateOutcome, timeout_s: float) -> CacheVerification:
    """Run ``request`` again on the cached path (reading the store, writing nothing) and
    compare its output with ``first``'s, the recompute's."""
    cached = replace(request, request_id=f"{request.request_id}-verify",
                     cache=replace(request.cache, read=True, write=False))
    again = (await dispatch(backend, cached, hashes, timeout_s)).result
    ours, theirs = first.result.output_tokens, again.output_tokens
    differ = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                  None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
    return CacheVerification(differ is None, again.cached_tokens, differ)


def diagnosis_of(request: NewRequest, outcome: GenerateOutcome, observed: Observed | None
                 ) -> CacheDiagnosis:
    """Where ``request``'s prompt left the nearest sequence its worker held, and why."""
    r = outcome.result
    at = min(r.lookup.common_prefix, len(request.prompt))
    index = next((i for i, end in enumerate(request.message_ends) if at < end), None)
    miss = observed.miss if observed is not None else None
    return CacheDiagnosis(
        cached_tokens=r.cached_tokens, prompt_tokens=r.input_tokens,
        outcome=r.lookup.outcome.value, reason=miss.cause.value if miss else "",
        diverged_at=at, message_index=index,
        before=tuple(request.prompt[max(0, at - EXCERPT_TOKENS):at]),
        after=tuple(request.prompt[at:at + EXCERPT_TOKENS]))
