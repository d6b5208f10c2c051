"""A traced in-process cluster: real engines and the real router, observed like the frontend does.

``TracedCluster`` runs requests one at a time through ``router.router.Router`` and one
``workers.engine.engine.Engine`` per worker (each with its own prefix store), feeding the stores'
block events back to the router after every request, and records every request through a
``RequestObserver`` as the job runner does. The telemetry tests drive it to get traces that
come from the real engine and router rather than from hand-written results, with a clock they
control (``orchard bench telemetry`` measures the frontend itself, not this).

The clock is injected and shared by the engines' stores, the router and the observer, so a
test can step past a TTL. With ``disk_bytes`` each worker's store has a disk tier too (worker
``w`` in ``disk_dir/w``); ``close`` writes and releases them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cluster.telemetry import spans
from cluster.telemetry.observe import Observed, RequestObserver, ServedCache
from cluster.telemetry.setup import Telemetry
from router.cost import PriceTable, TokenUsage
from router.kv.events import EventBatch
from router.kv.key import hash_blocks
from router.router import Router
from workers.engine.engine import Engine, EngineConfig
from workers.messages import CacheControls, GenerateRequest, GenerateResult, SamplingParams


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a workload: token ids, or chat messages rendered by the model."""

    request_id: str
    tenant: str
    prompt: tuple[int, ...]
    max_tokens: int
    job_id: str = ""
    conversation: str = ""
    turn: int = 0
    cache: CacheControls = CacheControls()  # what it asks of the store
    salt: str = ""                          # its cache_salt


@dataclass(frozen=True, slots=True)
class Ran:
    result: GenerateResult
    observed: Observed
    telemetry_s: float   # wall time spent in telemetry calls for this request


class TracedCluster:
    def __init__(self, model_dir: Path | str, workers: int, tel: Telemetry, *,
                 block_size: int = 16, ttl_s: float = 300.0, store_bytes: int = 1 << 28,
                 clock: Callable[[], float] = time.monotonic,
                 prices: PriceTable = PriceTable(), disk_dir: Path | str | None = None,
                 disk_bytes: int = 0) -> None:
        if workers <= 0:
            raise ValueError(f"workers must be positive, got {workers}")
        self.tel = tel
        self._disk = (Path(disk_dir), disk_bytes) if disk_bytes else None
        if disk_bytes and disk_dir is None:
            raise ValueError("disk_bytes needs a disk_dir: each worker's disk tier lives there")
        self._ttl_s = ttl_s
        self.engines = {f"w{i}": self._open(model_dir, f"w{i}", block_size, store_bytes, clock)
                        for i in range(workers)}
        self.router = Router(block_size, clock=clock)
        for worker in self.engines:
            self.router.add_worker(worker)
        first = next(iter(self.engines.values()))
        bytes_per_token = first.store_stats().bytes_per_token
        disk_tokens = disk_bytes // first.disk_kv_bytes_per_token if disk_bytes else 0
        cache = ServedCache(first.model_id, block_size, ttl_s, store_bytes // bytes_per_token,
                            workers, disk_tokens)
        self.observer = RequestObserver(tel, prices, cache, clock=clock)
        self._seq = {w: 0 for w in self.engines}
        self._clock = clock

    def _open(self, model_dir: Path | str, worker: str, block_size: int, store_bytes: int,
              clock: Callable[[], float]) -> Engine:
        disk = {}
        if self._disk is not None:
            disk = dict(disk_dir=str(self._disk[0]), disk_bytes=self._disk[1])  # + /worker
        return Engine.open(model_dir, EngineConfig(block_size=block_size, store_bytes=store_bytes,
                                                   ttl_s=self._ttl_s, worker_id=worker, **disk),
                           clock=clock)

    def close(self) -> None:
        """Close every engine (a disk tier writes what it holds and releases its directory)."""
        for engine in self.engines.values():
            engine.close()

    @property
    def block_size(self) -> int:
        return self.router.block_size

    def engine(self) -> Engine:
        return next(iter(self.engines.values()))

    def render(self, messages: Sequence[dict[str, str]]) -> tuple[int, ...]:
        return tuple(self.engine().render_chat(messages))

    def run(self, turn: Turn, traced: bool = True) -> Ran:
        """Route, generate and observe one request (``traced=False``: no telemetry at all)."""
        engine0 = self.engine()
        namespace = dataclasses.replace(engine0.namespace(turn.tenant), salt=turn.salt)
        hashes = hash_blocks(turn.prompt, self.block_size, namespace)
        if not traced:
            decision = self.router.route(namespace, hashes, len(turn.prompt))
            return Ran(self._generate(turn, namespace, decision, ()), Observed(None, None), 0.0)
        info = spans.RequestInfo(turn.request_id, turn.tenant, engine0.model_id, turn.job_id,
                                 turn.conversation, turn.turn, "text_completion", turn.max_tokens)
        started = time.perf_counter()
        with self.observer.request(info) as span:
            context = self.observer.context()
            work, route_ns = time.perf_counter(), time.time_ns()
            decision = self.router.route(namespace, hashes, len(turn.prompt))
            routed_ns = time.time_ns()
            result = self._generate(turn, namespace, decision, context)
            work = time.perf_counter() - work   # routing and generation: not telemetry
            self.observer.routed(decision, route_ns, routed_ns)
            request = GenerateRequest(turn.request_id, namespace, turn.prompt,
                                      SamplingParams(turn.max_tokens), trace_context=context,
                                      cache=turn.cache)
            decode = self.engines[decision.worker_id].tokenizer.decode
            self.observer.worker_done(request, result, decode)
            observed = self.observer.finish(span, request, hashes, result, decision)
        return Ran(result, observed, time.perf_counter() - started - work)

    def _generate(self, turn: Turn, namespace, decision, context) -> GenerateResult:
        worker = decision.worker_id
        engine = self.engines[worker]
        request = GenerateRequest(turn.request_id, namespace, turn.prompt,
                                  SamplingParams(turn.max_tokens), trace_context=context,
                                  cache=turn.cache)
        self.router.started(turn.request_id, decision)
        try:
            (result,) = engine.generate([request])
        finally:
            self.router.finished(turn.request_id)
        self._send_events(worker)
        if not isinstance(result, GenerateResult):
            raise ValueError(f"request {turn.request_id} failed: {result.error}")
        return result

    def invalidate(self, tenant: str) -> int:
        """Drop ``tenant``'s blocks on every worker, as the admin API does; blocks removed."""
        removed = 0
        for worker, engine in self.engines.items():
            removed += engine.invalidate(engine.namespace(tenant))
            self._send_events(worker)
        self.observer.invalidated(tenant)
        return removed

    def remove_worker(self, worker: str) -> None:
        """``worker`` leaves (lost, or drained and stopped): its store goes with it."""
        self.engines.pop(worker).close()
        self.router.remove_worker(worker)
        self.observer.serving(list(self.engines))

    def add_worker(self, worker: str, model_dir: Path | str, store_bytes: int) -> None:
        """Scale out by one worker with an empty store."""
        self.engines[worker] = self._open(model_dir, worker, self.block_size, store_bytes,
                                          self._clock)
        self._seq[worker] = 0
        self.router.add_worker(worker)
        self.observer.serving(list(self.engines))

    def _send_events(self, worker: str) -> None:
        self._seq[worker] += 1
        self.router.apply_events(EventBatch(worker, self._seq[worker],
                                            tuple(self.engines[worker].drain_events())))

    def forecast(self, turns: Sequence[Turn], concurrency: int = 1,
                 request_s: float = 1.0) -> list[TokenUsage]:
        """The job-level forecast of ``turns`` (as one job) from what the cluster holds now."""
        engine0 = self.engine()
        chains = [hash_blocks(t.prompt, self.block_size, engine0.namespace(t.tenant)) for t in turns]
        plans, held = self.observer.plan_job(chains, [len(t.prompt) for t in turns],
                                             [t.max_tokens for t in turns], concurrency, request_s)
        return self.observer.forecast_job(plans, held)
