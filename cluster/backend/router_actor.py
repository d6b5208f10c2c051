"""The router actor: ``router.router.Router`` as an async Ray actor, with its process's telemetry.

The frontend routes in its own process (``cluster.backend.routing``); this actor keeps a second
copy of the routing state, fed by the workers' block events directly, for other frontends and
for recovery. The pool pings it and replaces a lost one, rebuilding its index from the workers
(``cluster.backend.ray_pool``). All logic lives in ``Router`` (tested without Ray); each call
runs to completion on the actor's event loop, so the state is never shared between threads::

    router = TracedRouterActor.remote(block_size=16)
    await router.add_worker.remote("w0")
    decision = await router.route_and_start.remote(rid, namespace, hashes, len(prompt))

``router`` never imports OpenTelemetry, so tracing lives here, in the control plane: the actor
sets up telemetry in its own process (service ``orchard-router``, its node as resource
attributes) and draws one ``orchard.route`` span per ``route_and_start`` decision, as a child of
the context the call carries. ``tracing`` says whether spans are drawn here. A tracing failure
is logged once and never fails a routing call. ``NoWorkerAvailable`` raised inside reaches the
caller as a ``RayTaskError`` whose ``cause`` is the ``NoWorkerAvailable``.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Iterable, Sequence

import ray

from cluster.backend.bootstrap import node_address, node_id
from cluster.telemetry import spans
from cluster.telemetry.setup import (SERVICE_ROUTER, TelemetrySettings, process_settings,
                                     process_telemetry)
from router.kv.events import EventBatch
from router.index import DEFAULT_INDEX_BYTES, IndexCounters
from router.kv.key import BlockHash, Namespace
from router.policy import PolicyConfig, RoutingDecision
from router.router import Router, WorkerStatus


class TracedRouter:
    """``Router``'s calls as coroutines, routing decisions traced in the router's process."""

    def __init__(self, block_size: int, telemetry: TelemetrySettings | None = None,
                 config: PolicyConfig = PolicyConfig(), seed: int = 0,
                 index_bytes: int = DEFAULT_INDEX_BYTES) -> None:
        self._router = Router(block_size, config, seed=seed, index_bytes=index_bytes)
        self._tel = process_telemetry(process_settings(
            telemetry, SERVICE_ROUTER, (), node_address(), node_id()))

    async def ping(self) -> int:
        """Liveness: the actor's process id."""
        return os.getpid()

    async def tracing(self) -> bool:
        """Whether this actor draws the routing spans."""
        return self._tel.enabled

    async def add_worker(self, worker_id: str) -> None:
        self._router.add_worker(worker_id)

    async def drain_worker(self, worker_id: str) -> None:
        self._router.drain_worker(worker_id)

    async def remove_worker(self, worker_id: str) -> None:
        self._router.remove_worker(worker_id)

    async def workers(self) -> list[WorkerStatus]:
        return self._router.workers()

    async def apply_events(self, batch: EventBatch | bytes) -> None:
        self._router.apply_events(batch)

    async def rebuild(self, worker_id: str, holdings: Iterable[BlockHash],
                      disk_holdings: Iterable[BlockHash] = ()) -> None:
        self._router.rebuild(worker_id, list(holdings), list(disk_holdings))

    async def stale_workers(self) -> list[str]:
        return self._router.stale_workers()

    async def index_counters(self) -> IndexCounters:
        return self._router.index_counters()

    async def route(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
                    prompt_tokens: int) -> RoutingDecision:
        return self._router.route(namespace, block_hashes, prompt_tokens)

    async def route_and_start(self, request_id: str, namespace: Namespace,
                              block_hashes: Sequence[BlockHash], prompt_tokens: int,
                              trace_context: Sequence[tuple[str, str]] = ()
                              ) -> RoutingDecision:
        """``route`` then ``started`` in one call (no load race between them), traced under
        ``trace_context``."""
        start_ns = time.time_ns()
        decision = self._router.route(namespace, block_hashes, prompt_tokens)
        self._router.started(request_id, decision)
        if self._tel.enabled and trace_context:  # an untraced request: no orphan trace
            spans.record_routing(self._tel, decision, start_ns, time.time_ns(),
                                 tuple(trace_context))
        return decision

    async def started(self, request_id: str, decision: RoutingDecision) -> None:
        self._router.started(request_id, decision)

    async def prefilled(self, request_id: str) -> None:
        self._router.prefilled(request_id)

    async def finished(self, request_id: str) -> None:
        self._router.finished(request_id)

    async def flush(self) -> None:
        """Export the spans drawn so far (before the actor is stopped)."""
        await asyncio.to_thread(self._tel.flush)


TracedRouterActor = ray.remote(num_cpus=0)(TracedRouter)
