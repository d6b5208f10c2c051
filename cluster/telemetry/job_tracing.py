"""What the job runner and the gRPC servicer call to trace requests and forecast jobs.

``JobTracing`` wraps the frontend's ``cluster.telemetry.observe.RequestObserver`` (or nothing: then
every call is a no-op and nothing is traced)::

    with tracing.request(tenant, request_id, job_id, custom_id, sampling, metadata,
                         operation) as trace:
        request = GenerateRequest(..., trace_context=trace.context)
        outcome = await dispatch(...)
        observed = trace.done(request, hashes, outcome)      # or trace.failed(code, message)
    tracing.job_launched(job_id, tenant, namespace, pending)  # the job's forecast and span
    tracing.watch(backend, queue_depths)                      # store and queue gauges

``frontend_tracing`` builds it from the cluster config and the served model, named in spans
and metrics by its own name (``model_name``), so price tables in other tools match it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import socket
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from opentelemetry.trace import Span

from cluster.telemetry import spans
from cluster.telemetry.attrs import HOST_NAME
from cluster.telemetry.observe import Observed, RequestObserver, ServedCache
from cluster.telemetry.setup import extract_metadata, guarded, settings_from_config, setup_telemetry
from cluster.telemetry.metrics import StoreGauges
from cluster.telemetry.prometheus import (RouteOutcome, ServedRequest, ServingMetrics,
                                          default_status)
from router.cost import load_price_table
from router.kv.key import BlockHash, hash_blocks
from workers.messages import GenerateRequest
from workers.model.model_import import read_provenance

log = logging.getLogger("orchard.telemetry")
MAX_JOB_CONTEXTS = 10_000


class RequestTrace:
    """One request's tracing as the job runner holds it (see ``JobTracing.request``)."""

    def __init__(self, observer: RequestObserver | None, span: Span | None,
                 context: tuple[tuple[str, str], ...], tenant: str = "",
                 metrics: ServingMetrics | None = None) -> None:
        self._observer = observer
        self._span = span
        self.context = context
        self.started_ns = time.time_ns()
        self._tenant = tenant
        self._metrics = metrics
        self._started_s = observer.now() if observer is not None else 0.0
        self.ended = False  # counted in the metrics (a result, or a failure)

    def failed(self, code: str, message: str) -> None:
        """The request ended without a result: mark its span as an error."""
        self.end_with(code)
        if self._span is not None:
            spans.record_failure(self._span, code, message)

    def disconnected(self, input_tokens: int) -> None:
        """The caller went away before the result: the span keeps the prompt's size."""
        self.end_with("CANCELLED")
        if self._span is not None:
            spans.record_disconnect(self._span, input_tokens)

    def end_with(self, status: str) -> None:
        """Count the request as ended with ``status`` (once: later calls do nothing)."""
        if not self.ended and self._metrics is not None:
            self._metrics.finished(self._tenant, status)
        self.ended = True

    def done(self, request: GenerateRequest, block_hashes: Sequence[BlockHash],
             outcome: Any) -> Observed | None:
        """Record a finished ``cluster.backend.protocol.GenerateOutcome``; never raises."""
        if self._observer is None or self._span is None:
            return None
        result = outcome.result
        # Spans the worker actors drew in their own processes are not drawn twice.
        if outcome.decision is not None:
            self._observer.routed(outcome.decision, self.started_ns, result.timings.received_ns)
        if not outcome.worker_traced:
            self._observer.worker_done(request, result, self._observer.decode)
        pulled = outcome.pulled
        prefix = (spans.PulledPrefix(pulled.peer, pulled.tokens, pulled.refused)
                  if pulled is not None else None)
        observed = self._observer.finish(self._span, request, block_hashes, result,
                                         outcome.decision, outcome.attempts, prefix)
        self._count(result, outcome.decision, observed)
        return observed

    @guarded()
    def _count(self, result: Any, decision: Any, observed: Observed) -> None:
        if self.ended or self._metrics is None or self._observer is None:
            return
        self.ended = True
        route = None if decision is None else RouteOutcome.of(
            decision.expected_cached_tokens, result.input_tokens, self._observer.block_size)
        self._metrics.served(ServedRequest(
            worker=result.worker_id, tenant=self._tenant, prompt_tokens=result.input_tokens,
            cached_tokens=result.cached_tokens, disk_tokens=result.lookup.disk_tokens,
            generated_tokens=len(result.output_tokens), ttft_s=result.ttft_s,
            tpot_s=result.tpot_s, e2e_s=max(0.0, self._observer.now() - self._started_s),
            route=route, usage=observed.cost.measured if observed.cost else None))


def with_cost(result: Any, observed: Observed | None) -> Any:
    """``result`` (a ``cluster.jobs.store.StoredResult``) with the observed forecast and
    measured M and miss cause, for the job record."""
    if observed is None:
        return result
    cost, miss = observed.cost, observed.miss
    return dataclasses.replace(
        result, forecast_multiplier=cost.forecast_multiplier if cost else None,
        measured_multiplier=cost.measured_multiplier if cost else None,
        miss_cause=miss.cause.value if miss else "")


def conversation_of(custom_id: str) -> tuple[str, int]:
    """A batch request's conversation and turn from its ``custom_id``, when it says so:
    ``NAME-turn-3``, ``NAME-turn3``, ``NAME-t3`` or ``NAME:3``; else ``("", 0)``."""
    match = re.fullmatch(r"(.+?)(?:[-_:]turn[-_]?|[-_]t|:)(\d+)", custom_id)
    return (match.group(1), int(match.group(2))) if match else ("", 0)


class JobTracing:
    """What ``cluster.jobs.runner.JobRunner`` calls: a no-op when built without an observer."""

    def __init__(self, observer: RequestObserver | None = None,
                 metrics: ServingMetrics | None = None) -> None:
        self.observer = observer
        self.metrics = metrics  # the Prometheus counters (``cluster.telemetry.prometheus``)
        # job id -> its span's context, for the requests' links (recent jobs only)
        self._job_context: OrderedDict[str, tuple[tuple[str, str], ...]] = OrderedDict()
        self._poller: asyncio.Task | None = None
        self._backend: Any = None
        self._stores: dict[str, StoreGauges] = {}
        self.chat_opening: tuple[int, ...] = ()   # see ``chat_opening``

    @contextmanager
    def request(self, tenant: str, request_id: str, job_id: str, custom_id: str,
                sampling: Any, metadata: Sequence[tuple[str, Any]] | None = None,
                operation: str = "", prompt: Sequence[int] = ()) -> Iterator[RequestTrace]:
        """Around one request's run: its root span (a child of the caller's context when
        gRPC ``metadata`` carries one, else the root of a new trace linked to its job).

        ``operation`` is ``"chat"`` for messages and ``"text_completion"`` for token ids;
        when the caller no longer knows (a stored batch request keeps only its tokens), it
        is read from ``prompt``: ``"chat"`` when it opens as the model's chat template does.
        """
        if self.observer is None:
            yield RequestTrace(None, None, ())
            return
        conversation, turn = conversation_of(custom_id)
        info = spans.RequestInfo(
            request_id, tenant, self.observer.model, job_id, conversation, turn,
            operation or self.operation_of(prompt), sampling.max_tokens, sampling.temperature,
            self._job_context.get(job_id, ()))
        with self.observer.request(info, extract_metadata(metadata)) as span:
            trace = RequestTrace(self.observer, span, self.observer.context(), tenant,
                                 self.metrics)
            try:
                yield trace
            except BaseException as exc:  # cancelled, timed out, refused: counted, re-raised
                if self.metrics is not None and not trace.ended:
                    trace.end_with(self.metrics.status_of(exc))
                raise

    def operation_of(self, prompt: Sequence[int]) -> str:
        """``"chat"`` when ``prompt`` starts with the tokens every rendered conversation
        starts with (``chat_opening``), else ``"text_completion"``."""
        opening = self.chat_opening
        chat = bool(opening) and tuple(prompt[:len(opening)]) == opening
        return spans.A.OPERATION_CHAT if chat else spans.A.OPERATION_TEXT

    def watch(self, backend: Any, queue_depths: Callable[[], Mapping[str, int]],
              interval_s: float = 5.0) -> None:
        """Feed the store and queue gauges: poll ``backend.workers()`` every ``interval_s``
        on the running event loop (metric callbacks run on the exporter's thread and read
        the last snapshot); ``queue_depths`` gives the pending requests per tenant."""
        if self.observer is None:
            return
        self.observer.tel.instruments.watch_queue(queue_depths)
        self._backend = backend

        async def poll() -> None:
            while True:
                await self._poll_workers()
                await asyncio.sleep(interval_s)

        self._poller = asyncio.get_running_loop().create_task(poll(), name="store-metrics")

    async def _poll_workers(self) -> None:
        try:
            infos = await self._backend.workers()
        except Exception:  # one failed poll must not stop the metrics
            log.exception("polling the workers for store metrics failed")
            return
        self.observer.serving([i.worker_id for i in infos if i.state in ("starting", "ready")])
        instruments = self.observer.tel.instruments
        for info in infos:
            if info.worker_id not in self._stores:
                instruments.watch_store(info.worker_id,
                                        functools.partial(self._stores.get, info.worker_id))
            self._stores[info.worker_id] = StoreGauges(info.cache_bytes, info.evictions,
                                                       info.expirations)

    def watch_slots(self, slots: Callable[[], Mapping[str, Any]]) -> None:
        """Feed the slot gauges (``orchard.slots.in_use`` / ``waiting``, by priority) from
        ``slots``, read at each export."""
        if self.observer is not None:
            self.observer.tel.instruments.watch_slots(slots)

    def refused(self, tenant: str, reason: str) -> None:
        """A request of ``tenant`` refused at admission (``orchard.requests.refused``)."""
        if self.observer is not None:
            self.observer.tel.instruments.record_refusal(tenant, reason)

    def invalidated(self, tenant: str) -> None:
        """An operator invalidated ``tenant``'s cached prefixes: later misses on blocks used
        before now are attributed to the invalidation, and job forecasts no longer count
        them as held."""
        if self.observer is not None:
            self.observer.invalidated(tenant)

    async def aclose(self) -> None:
        """Take a last store snapshot, then flush and stop telemetry."""
        if self._poller is not None:
            self._poller.cancel()
            await self._poll_workers()
        if self.observer is not None:
            self.observer.tel.shutdown()

    @guarded()
    def job_launched(self, job_id: str, tenant: str, namespace: Any,
                     pending: Sequence[Any]) -> None:
        """Forecast a job about to run (its pending requests) and record its span.

        A worker admits one request at a time (lookup, prefill, store its blocks, then the
        next), and the router sends a prefix's requests to the worker that holds or was just
        sent it, so the job is modelled in admission order: each request sees the blocks of
        those before it once their prefill is done.
        """
        if self.observer is None or not pending:
            return
        obs = self.observer
        chains = [hash_blocks(p.prompt, obs.block_size, dataclasses.replace(
            namespace, salt=p.cache_salt)) for p in pending]
        plans, held = obs.plan_job(chains, [len(p.prompt) for p in pending],
                                   [p.sampling.max_tokens for p in pending], 1, obs.prefill_s(),
                                   [p.cache for p in pending])
        self._job_context[job_id] = obs.submit_job(job_id, tenant, plans, held)
        while len(self._job_context) > MAX_JOB_CONTEXTS:
            self._job_context.popitem(last=False)


def model_name(model_dir: str | Path, model_id: str) -> str:
    """The model's own name: the file or directory it was imported from (``SmolLM2-135M-
    Instruct`` for ``SmolLM2-135M-Instruct.Q4_1.gguf``), else its directory's name."""
    source = read_provenance(Path(model_dir)).get("source", "")
    if not source:
        return model_id
    name = Path(source).name
    return name.split(".", 1)[0] if name.endswith(".gguf") else name


def chat_opening(render: Callable[[Sequence[dict[str, str]]], Sequence[int]]) -> tuple[int, ...]:
    """The tokens every conversation the model's chat template renders starts with (the
    common prefix of two unlike conversations); () when the template renders none."""
    first = render([{"role": "user", "content": "a"}])
    second = render([{"role": "system", "content": "b"}, {"role": "user", "content": "c"}])
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    return tuple(first[:common])


def frontend_tracing(config: Any, model: Any, workers: int,
                     decode: Callable[[Sequence[int]], str] | None,
                     render: Callable[[Sequence[dict[str, str]]], Sequence[int]] | None = None,
                     status_of: Callable[[BaseException], str] = default_status
                     ) -> JobTracing:
    """The frontend's ``JobTracing`` from ``cluster.config.Config`` and the served
    ``cluster.backend.protocol.ModelInfo``; telemetry ``exporter = "none"`` still attributes,
    prices and counts (the Prometheus metrics). ``render`` (the chat template) tells chat
    prompts from token prompts; ``status_of`` names the status an exception ends a request
    with, for the metrics."""
    settings = settings_from_config(config, "orchard-frontend")
    settings = dataclasses.replace(settings, resource=(*settings.resource,
                                                       (HOST_NAME, socket.gethostname())))
    tel = setup_telemetry(settings)
    prices = load_price_table(config.telemetry.prices or None)
    # The engine's own figure (model dtype, kv_bits), never one recomputed from config.json.
    capacity = config.cache.capacity_bytes // model.kv_bytes_per_token
    disk = (config.cache.disk_bytes // model.disk_kv_bytes_per_token
            if model.disk_kv_bytes_per_token else 0)
    cache = ServedCache(model_name(model.model_dir, model.model_id), model.block_size,
                        config.cache.ttl_s, capacity, max(1, workers), disk)
    rates, ttl_s = prices.rates(cache.model), config.cache.ttl_s
    metrics = ServingMetrics(lambda usage: usage.multiplier(rates, ttl_s), status_of)
    tracing = JobTracing(RequestObserver(tel, prices, cache, decode=decode), metrics)
    if render is not None:
        try:
            tracing.chat_opening = chat_opening(render)
        except Exception:  # a model without a usable chat template serves token prompts only
            log.warning("the model's chat template did not render; every request is traced "
                        "as text_completion")
    return tracing
