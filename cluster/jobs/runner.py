"""The job runner: runs every accepted request once, through the backend, into the job store.

It owns admission (backpressure, ``cluster.jobs.admission``) and execution; the job store owns
the state:

    SubmitJob ─► admit(tenant, n) ─► intake (store) ─► runner.launch(job)
                                                          │ one task per job; its requests and
                                                          ▼ direct requests share max_concurrent
                                                          │ slots (``cluster.jobs.slots``)
        store.next_requests (a page, in dispatch order) ─► prepare (template + tokenize, in a
        worker thread) ─► dispatch(backend, request, hashes, timeout) ─► store.record_result
                          (``cluster.jobs.dispatch``)

A request outside any job (``Generate``, the HTTP completions) comes in through
``runner.direct`` (``cluster.jobs.direct.DirectRequests``): the same admission counts, slots,
tracing and timeout, without the store: what an edge uses to run a request itself.

Memory follows what runs, not what is queued: a job's requests are read from the store a page
(``PAGE_ROWS``) at a time as slots free up, and tokenized only when dispatched. The job's
forecast is made before its first request runs, on its first ``FORECAST_REQUESTS`` requests in
dispatch order (all of a smaller job), so it sees the shared prefixes that order brings
together; those requests are tokenized again when dispatched (about 1 ms each, against a
model call of tens of milliseconds) rather than held, all but the first: the forecast hands
its tokenization to the job's first dispatch (one prompt held per job), so a job of one
request is tokenized once, not twice on its path. A small job (at most ``PREPARE_AT_INTAKE``
requests sent whole, ``SubmitJob`` or the HTTP Batch API) is prepared while its intake's
fsynced commit runs (``prepare_soon``), its prompts held for its forecast and dispatch: the
two overlap, and its job task needs no thread of its own.

Backpressure: requests accepted but without a result are counted per tenant and in total; an
``admit`` beyond ``max_pending_per_tenant`` or ``max_pending_total`` raises ``Overloaded``
(``RESOURCE_EXHAUSTED`` at the edge). The jobs this frontend's lease takes (its own after a
restart, a dead frontend's: ``cluster.jobs.lease``) are ``adopt``ed, counted and launched, so
a frontend resumes where one stopped: requests without a result run (again), and the store
keeps one result per request. A job the lease lost is ``abandon``ed. A job's requests take its
priority's lane (``JobRecord.priority``, stored with the job): a batch job's (the default) are
batch work, which slots serve after interactive requests, with a floor that keeps a job moving
(``cluster.jobs.slots``), and the engine prefills after them (``GenerateRequest.batch``); an
interactive job's take the interactive lane in both. A job, of either priority, is never shed
nor held to the tenants' quotas: it was accepted whole, and a refused request would be a
failed result. An interactive request outside a job may be refused at once: shed when it would start
past its deadline (``cluster.jobs.shedding``, fed the slot times of every request run here),
or over its tenant's quota (``cluster.jobs.quotas``); each refusal is counted by reason.

A request whose run fails becomes an error result (``ok = false`` with a gRPC status name):
``NoWorkerAvailable`` is retried with backoff until the request's deadline, then recorded as
``UNAVAILABLE``; a deadline as ``DEADLINE_EXCEEDED``; a ``ValueError`` as ``INVALID_ARGUMENT``,
and so does a request that ``prepare`` finds invalid (a prompt over the context); any other
exception, from ``prepare``, the backend or building the result, as ``INTERNAL``. A job whose
own task fails (its forecast, reading its pages) records ``INTERNAL`` for every request still
without a result, in-flight ones too once they are cancelled and unwound; so does a job whose
last page left requests behind. Every request gets a result, so every job ends.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Mapping, Sequence

from cluster.backend.protocol import Backend, NoWorkerAvailable
from cluster.jobs.admission import Admission, Overloaded
from cluster.jobs.direct import DirectRequests, Overload
from cluster.jobs.dispatch import dispatch, error_of, result_of
from cluster.jobs.quotas import Quotas
from cluster.jobs.shedding import LoadShedder
from cluster.jobs.slots import SlotPool
from cluster.jobs.store import (JobRecord, JobStore, NewRequest, PendingRequest,
                                StoredRequest, StoredResult)
from cluster.telemetry.job_tracing import JobTracing, RequestTrace, with_cost
from cluster.telemetry.metrics import SlotGauges
from router.kv.key import Namespace, hash_blocks
from workers.messages import GenerateRequest, Priority

log = logging.getLogger(__name__)

FORECAST_REQUESTS = 128  # tokenized twice (forecast, dispatch): 128 x ~1 ms per job
PREPARE_AT_INTAKE = 8    # a job of at most this many is prepared while its intake commits

Prepare = Callable[[bytes], NewRequest]  # a stored body, templated and tokenized (blocking)
Prepared = NewRequest | Exception        # what preparing a body gave: the request, or why not


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    """Admission and execution limits (``cluster.config.Limits``, narrowed to the runner's)."""

    max_concurrent: int            # requests in flight to the backend at once
    max_pending_per_tenant: int    # accepted but unfinished requests, per tenant
    max_pending_total: int         # ... and over all tenants
    request_timeout_s: float       # one request's deadline, retries included
    max_ttft_s: float = 0.0        # an interactive request predicted to start later is shed
                                   # (``cluster.jobs.shedding``); 0: callers' deadlines only


async def _unwind(running: set[asyncio.Task]) -> None:
    """Cancel the requests in flight and return once each has unwound (its backend call
    ended, the request aborted on its worker). A request already cancelled is not cancelled
    again: a second cancel would cut short its wait for the backend call to end."""
    for task in running:
        if not task.cancelling():
            task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


class JobRunner:
    def __init__(self, store: JobStore, backend: Backend, prepare: Prepare,
                 limits: RunnerLimits, *, namespace: Callable[[str], Namespace],
                 block_size: int, tracing: JobTracing | None = None,
                 quotas: Quotas | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._store = store
        self._prepare = prepare
        self._backend = backend
        self._namespace = namespace
        self._block_size = block_size
        self._slots = SlotPool(limits.max_concurrent)
        self._admission = Admission(limits.max_pending_per_tenant, limits.max_pending_total)
        self._timeout_s = limits.request_timeout_s
        self._jobs: dict[str, asyncio.Task] = {}
        self._running: dict[str, set[asyncio.Task]] = {}  # job id -> its requests in flight
        # set, then replaced by a new one, whenever a job makes progress (``_notify``): a
        # follower wakes in the loop's next turn, with no task or lock between
        self._changed = asyncio.Event()
        self._forecasting = asyncio.Lock()
        # a small job's requests, prepared beside its intake's fsynced commit (``prepare_soon``)
        self._preparer = ThreadPoolExecutor(2, thread_name_prefix="orchard-prepare")
        self._tracing = tracing or JobTracing()  # traces, cost forecast, miss causes
        self._shedder = LoadShedder(limits.max_ttft_s)
        self._clock = clock
        overload = Overload(self._shedder, quotas or Quotas(dict, clock), clock, sleep)
        self._direct = DirectRequests(backend, self._admission, self._slots, self._tracing,
                                      namespace, block_size, self._timeout_s, overload)

    # ------------------------------------------------------------ admission

    def admit(self, tenant: str, n: int) -> None:
        """Count ``n`` more pending requests for ``tenant``, or raise ``Overloaded`` (counted
        as a refusal: a job is never shed nor held to quotas, only to the pending limits)."""
        try:
            self._admission.admit(tenant, n)
        except Overloaded:
            self._tracing.refused(tenant, "pending")
            raise

    def pending(self) -> dict[str, int]:
        """Requests accepted and not finished, per tenant (the queue depth)."""
        return self._admission.pending()

    def release(self, tenant: str, n: int) -> None:
        self._admission.release(tenant, n)

    # ------------------------------------------------------------ lifecycle

    def adopt(self, jobs: Sequence[JobRecord]) -> list[str]:
        """Count and launch unfinished ``jobs`` this frontend runs from now on (its lease took
        them: its own after a restart, or a dead frontend's, ``cluster.jobs.lease``)."""
        for job in jobs:
            self._admission.add(job.tenant, job.total - job.completed - job.failed)
            self.launch(job)
        return [job.job_id for job in jobs]

    async def abandon(self, job_id: str) -> None:
        """Stop running ``job_id`` here: another frontend runs it now, or it was cancelled
        through one. Its requests in flight are unwound; the requests the store still has
        without a result stop counting here."""
        task = self._jobs.pop(job_id, None)
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._running.pop(job_id, None)
        job = self._store.get_job(job_id)
        self.release(job.tenant, min(job.total - job.completed - job.failed,
                                     self.pending().get(job.tenant, 0)))
        self._notify()

    def running_jobs(self) -> list[str]:
        """The jobs whose task runs in this runner."""
        return list(self._jobs)

    def launch(self, job: JobRecord, prepared: Mapping[int, Prepared] | None = None) -> None:
        """Run ``job`` in a task of its own. ``prepared``: its requests already templated and
        tokenized (by index, from ``prepare_soon``), which its forecast and dispatch use."""
        self._jobs[job.job_id] = asyncio.create_task(self._run_job(job, dict(prepared or {})),
                                                     name=job.job_id)

    def prepare_soon(self, bodies: Sequence[bytes]) -> list[Future[Prepared]]:
        """Template and tokenize ``bodies`` (stored request bodies, in index order) in the
        runner's own threads, from any thread: an intake starts a small job's (at most
        ``PREPARE_AT_INTAKE``) before its fsynced commit, so the two overlap, and hands them
        to ``launch``."""
        return [self._preparer.submit(self._prepare_body, body) for body in bodies]

    async def close(self) -> None:
        tasks = list(self._jobs.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._preparer.shutdown(wait=False, cancel_futures=True)
        await self._tracing.aclose()  # flush traces of the requests that finished

    def cancel(self, job_id: str, tenant: str) -> JobRecord:
        """Cancel in the store, stop the job's task; its unstarted requests never run."""
        job = self._store.cancel(job_id, tenant)
        task = self._jobs.pop(job_id, None)
        if task is None and job.owner != self._store.owner:
            self._notify()  # another frontend runs it: its next lease tick stops it there
            return job
        if task is not None:
            task.cancel()
        for request_task in self._running.pop(job_id, set()):
            # Synchronously: none of them records a result after this. Cancelling a task that
            # awaits ``backend.generate`` cancels that call; the backend stops the request on
            # its worker there (engine abort). A task not yet started gives its slot back
            # through ``SlotPool.hand_to``'s done callback. Once only (see ``_unwind``).
            if not request_task.cancelling():
                request_task.cancel()
        self.release(tenant, job.cancelled)
        self._notify()
        return job

    async def wait_changed(self, timeout_s: float) -> None:
        """Return when any job made progress, or after ``timeout_s``."""
        changed = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            pass

    @property
    def direct(self) -> DirectRequests:
        """Requests outside any job (``Generate``, the HTTP completions): the edges' way in."""
        return self._direct

    def slot_gauges(self) -> dict[str, SlotGauges]:
        """The slots per priority ("interactive", "batch"): held now, and waited for."""
        return {str(p): SlotGauges(self._slots.held_by(p), self._slots.waiting(p))
                for p in Priority}

    def slots_in_use(self) -> dict[str, int]:
        """Requests on the backend now, per tenant (job requests and direct requests)."""
        return self._slots.held()

    # ------------------------------------------------------------ execution

    async def _run_job(self, job: JobRecord, prepared: dict[int, Prepared]) -> None:
        self._store.mark_running(job.job_id)
        running = self._running.setdefault(job.job_id, set())
        try:
            first = await self._forecast(job, prepared)
            page = self._store.next_requests(job.job_id)
            while page:
                for stored in page:
                    await self._slots.acquire(job.tenant, job.priority)
                    ready = first.pop(stored.index, None)
                    task = self._slots.hand_to(
                        asyncio.create_task(self._run_one(job, stored, ready)), job.tenant,
                        job.priority)
                    running.add(task)
                    task.add_done_callback(running.discard)
                page = self._store.next_requests(job.job_id, page[-1].position)
            if running:
                await asyncio.gather(*running)
            if self._store.next_requests(job.job_id, limit=1):  # a page went missing
                raise RuntimeError("requests without a result after the job's last page")
        except asyncio.CancelledError:
            await _unwind(running)
            raise
        except Exception as exc:  # a bug in the job's own task: its requests still end
            log.exception("job %s: its task failed", job.job_id)
            await _unwind(running)
            self._fail_rest(job, f"{type(exc).__name__}: {exc}")
        finally:
            if self._jobs.get(job.job_id) is asyncio.current_task():
                del self._jobs[job.job_id]
                self._running.pop(job.job_id, None)

    def _fail_rest(self, job: JobRecord, why: str) -> None:
        """Record ``INTERNAL`` for every request of ``job`` still without a result."""
        failed = 0
        page = self._store.next_requests(job.job_id)
        while page:
            for stored in page:
                if self._store.record_result(job.job_id, error_of(stored, "INTERNAL", why)):
                    failed += 1
            page = self._store.next_requests(job.job_id, page[-1].position)
        self.release(job.tenant, failed)
        self._notify()

    def _prepare_body(self, body: bytes) -> Prepared:
        try:
            return self._prepare(body)
        except Exception as exc:  # cannot run (e.g. over the context), or a bug: its result
            return exc

    def _prepare_one(self, stored: StoredRequest) -> Prepared:
        return self._prepare_body(stored.body)

    async def _forecast(self, job: JobRecord, given: dict[int, Prepared]
                        ) -> dict[int, Prepared]:
        """Forecast the job on its first requests in dispatch order, before any runs (its
        span is the requests' link). One job at a time: the prepared prompts are dropped
        after, so memory holds one forecast's worth however many jobs are queued, but for
        the first and those ``given`` (prepared at intake), returned (index -> prepared) for
        its dispatch to use. The requests ``given`` are not prepared again: a small job
        whose every request was needs no thread here."""
        if self._tracing.observer is None:
            return given
        async with self._forecasting:
            stored = self._store.next_requests(job.job_id, limit=FORECAST_REQUESTS)
            missing = [r for r in stored if r.index not in given]
            if missing:
                made = await asyncio.to_thread(lambda: [self._prepare_one(r) for r in missing])
                fresh = {r.index: p for r, p in zip(missing, made)}
            else:
                fresh = {}
            prepared = [given[r.index] if r.index in given else fresh[r.index] for r in stored]
            pending = [PendingRequest(job.job_id, s.index, s.custom_id, p.prompt, p.sampling,
                                      p.cache, p.cache_salt)
                       for s, p in zip(stored, prepared) if isinstance(p, NewRequest)]
            self._tracing.job_launched(job.job_id, job.tenant, self._namespace(job.tenant),
                                       pending)
            if stored and stored[0].index in fresh:
                given[stored[0].index] = fresh[stored[0].index]
            return given

    async def _run_one(self, job: JobRecord, stored: StoredRequest,
                       ready: NewRequest | Exception | None = None) -> None:
        started = self._clock()
        try:
            await self._run_stored(job, stored, ready)
        finally:  # the slot's time, which the shedder's queue model drains at
            self._shedder.observe_slot(self._clock() - started)

    async def _run_stored(self, job: JobRecord, stored: StoredRequest,
                          ready: NewRequest | Exception | None) -> None:
        """``ready``: the request already prepared (by the job's forecast), else None."""
        tenant = job.tenant
        if ready is None:   # the slot is this task's
            ready = await asyncio.to_thread(self._prepare_one, stored)
        if isinstance(ready, ValueError):
            result = error_of(stored, "INVALID_ARGUMENT", str(ready))
        elif isinstance(ready, Exception):
            log.error("request %s: prepare failed: %r", stored.request_id, ready)
            result = error_of(stored, "INTERNAL", f"{type(ready).__name__}: {ready}")
        else:
            try:
                result = await self._execute(tenant, PendingRequest(
                    stored.job_id, stored.index, stored.custom_id, ready.prompt, ready.sampling,
                    ready.cache, ready.cache_salt), job.priority)
            except Exception as exc:  # a bug past the backend call: recorded, so the job ends
                log.exception("request %s: no result could be built", stored.request_id)
                result = error_of(stored, "INTERNAL", f"{type(exc).__name__}: {exc}")
        if self._store.record_result(stored.job_id, result) is not None:
            self.release(tenant, 1)
        self._notify()

    async def _execute(self, tenant: str, pending: PendingRequest, priority: Priority
                       ) -> StoredResult:
        with self._tracing.request(tenant, pending.request_id, pending.job_id, pending.custom_id,
                                   pending.sampling, prompt=pending.prompt) as trace:
            namespace = replace(self._namespace(tenant), salt=pending.cache_salt)
            request = GenerateRequest(request_id=pending.request_id, namespace=namespace,
                                      prompt=pending.prompt, sampling=pending.sampling,
                                      trace_context=trace.context,
                                      batch=priority is Priority.BATCH,
                                      cache=pending.cache)
            result = await self._dispatch(request, pending, trace)
            if not result.ok:
                trace.failed(result.error_code, result.error_message)
            return result

    async def _dispatch(self, request: GenerateRequest, pending: PendingRequest,
                        trace: RequestTrace) -> StoredResult:
        hashes = hash_blocks(pending.prompt, self._block_size, request.namespace)
        try:
            outcome = await dispatch(self._backend, request, hashes, self._timeout_s)
        except NoWorkerAvailable as exc:
            return error_of(pending, "UNAVAILABLE", f"no worker could take the request: {exc}")
        except TimeoutError:
            return error_of(pending, "DEADLINE_EXCEEDED",
                            f"the request ran longer than {self._timeout_s:g} s")
        except ValueError as exc:
            return error_of(pending, "INVALID_ARGUMENT", str(exc))
        except Exception as exc:  # a backend bug: recorded on the result and logged, not lost
            log.exception("request %s failed", pending.request_id)
            return error_of(pending, "INTERNAL", f"{type(exc).__name__}: {exc}")
        return with_cost(result_of(pending.index, pending.custom_id, outcome, request,
                                   self._block_size),
                         trace.done(request, hashes, outcome))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
