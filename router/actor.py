"""The router as a Ray actor: a thin async shell around ``router.router.Router``.

All logic lives in ``Router`` (tested without Ray). ``AsyncRouter`` exposes the same calls as
``async`` methods so one actor serves many callers concurrently without threads: each call
runs to completion on the actor's event loop (the routing state is never shared between
threads), and nothing here blocks on ``ray.get``. ``RouterActor`` is the one-line Ray actor.

    router = RouterActor.remote(block_size=16)
    await router.add_worker.remote("w0")
    decision = await router.route.remote(namespace, hashes, len(prompt))

``NoWorkerAvailable`` raised inside reaches the caller as a ``RayTaskError`` whose ``cause``
is the ``NoWorkerAvailable``; the cluster maps it to ``UNAVAILABLE``.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import ray

from router.events import EventBatch
from router.index import IndexCounters
from router.key import BlockHash, Namespace
from router.policy import PolicyConfig, RoutingDecision
from router.router import Router, WorkerStatus


class AsyncRouter:
    """``Router``'s calls as coroutines, for an async Ray actor."""

    def __init__(self, block_size: int, config: PolicyConfig = PolicyConfig(),
                 seed: int = 0) -> None:
        self._router = Router(block_size, config, seed=seed)

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

    async def rebuild(self, worker_id: str, holdings: Iterable[BlockHash]) -> None:
        self._router.rebuild(worker_id, list(holdings))

    async def stale_workers(self) -> list[str]:
        return self._router.stale_workers()

    async def index_counters(self) -> IndexCounters:
        return self._router.index_counters()

    async def route(self, namespace: Namespace, block_hashes: Sequence[BlockHash],
                    prompt_tokens: int) -> RoutingDecision:
        return self._router.route(namespace, block_hashes, prompt_tokens)

    async def route_and_start(self, request_id: str, namespace: Namespace,
                              block_hashes: Sequence[BlockHash],
                              prompt_tokens: int) -> RoutingDecision:
        """``route`` then ``started`` in one call: one round trip, no load race between them."""
        decision = self._router.route(namespace, block_hashes, prompt_tokens)
        self._router.started(request_id, decision)
        return decision

    async def started(self, request_id: str, decision: RoutingDecision) -> None:
        self._router.started(request_id, decision)

    async def prefilled(self, request_id: str) -> None:
        self._router.prefilled(request_id)

    async def finished(self, request_id: str) -> None:
        self._router.finished(request_id)


RouterActor = ray.remote(num_cpus=0)(AsyncRouter)
