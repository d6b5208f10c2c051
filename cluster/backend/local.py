"""``LocalBackend``: the one ``Backend`` over in-process engines and the real router, no Ray.

Used by the fast tests and by ``python -m cluster.api.frontend``. The engines run on one
``workers.engine.runtime.EngineRuntime`` (one engine thread, as MLX wants); each worker's
handle is its slot on that runtime (``RuntimeSlot``), and the router and the pool live on the
event loop::

    event loop                                   engine thread (workers.engine.runtime)
    ──────────                                   ─────────────
    Backend._attempt ─► slot.stream ─ runtime.run ─► engine.submit
        router.prefilled ◄─ the first TokenChunk ─┤ loop: step() every busy engine
        routes.apply ◄──────────── EventBatch ────┤ (block events, after every step, before
                                                  │  the results they belong to)
        GenerateOutcome ◄─ WorkerDone ◄ Finished ─┘
      closed early (cancel, deadline) ─► Abort: the request leaves its batch
    stats, invalidate, holdings ── runtime.call (on the engine thread)

Each worker is one ``workers.engine.engine.Engine`` with its own prefix store; its block events
reach the router exactly as a Ray worker's would, so routing sees what each worker really
holds. A worker whose engine breaks leaves; its requests are retried elsewhere
(``cluster.backend.retry``); it is not replaced.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Callable, Sequence

from cluster.backend.backend import Backend
from cluster.backend.handle import Items, WorkerHello, engine_items
from cluster.backend.routing import FrontendRouter
from cluster.backend.wire import PullPlan, WorkerDone
from cluster.backend.engine_config import engine_config
from router.index import DEFAULT_INDEX_BYTES
from router.kv.events import EventBatch
from router.kv.key import Namespace
from workers.engine.channel import Finished, Holdings
from workers.engine.config import EngineConfig
from workers.engine.runtime import EngineRuntime
from workers.messages import GenerateRequest, WorkerFailed, WorkerStats

LOCAL_NODE = "local"   # the node id and address of an in-process worker


class RuntimeSlot:
    """One engine on the runtime, as the backend reaches it (``cluster.backend.handle``)."""

    events = None   # no feed: the runtime's callback applies every batch as it is published
    address = None  # engines on one runtime pull nothing from each other

    def __init__(self, runtime: EngineRuntime, worker_id: str) -> None:
        self._runtime = runtime
        self._id = worker_id

    async def stream(self, request: GenerateRequest, feed_after: int, chunks: bool,
                     pull: PullPlan | None = None) -> Items:
        if pull is not None:
            raise RuntimeError(f"worker {self._id} runs in-process: it pulls from no peer")
        async with contextlib.aclosing(engine_items(self._runtime, self._id, request,
                                                    chunks)) as items:
            async for item in items:
                if isinstance(item, Finished):
                    yield WorkerDone(item.result, item.worker_s)
                    return
                yield item

    async def stats(self) -> WorkerStats | None:
        try:
            return await self._runtime.stats(self._id)
        except WorkerFailed:   # broken or retired meanwhile: the pool learns it from a request
            return None

    async def invalidate(self, namespace: Namespace, prefix_tokens: Sequence[int] | None
                         ) -> int:
        return await self._runtime.call(
            self._id, lambda engine: engine.invalidate(namespace, prefix_tokens))

    async def holdings(self) -> Holdings:
        return await self._runtime.holdings(self._id)

    async def ping(self) -> None:
        await self._runtime.call(self._id, lambda engine: None)

    def kill(self) -> None:
        self._runtime.retire(self._id)

    async def close(self) -> None:
        self._runtime.retire(self._id)   # its store persisted on the engine thread


class LocalLauncher:
    """Opens each worker's engine on the process's one engine thread."""

    prefix = "local-"
    owner = ""             # its workers are its own
    replace_dead = False   # a broken engine leaves; scale up to replace it
    watch = False          # no background checks: batches never go missing in-process
    pulls = False          # one runtime's engines: no stream between them

    def __init__(self, model_dir: Path | str, engine: EngineConfig,
                 clock: Callable[[], float]) -> None:
        self.model_dir = str(model_dir)
        self.engine = engine
        self._clock = clock
        self._runtime: EngineRuntime | None = None

    @property
    def runtime(self) -> EngineRuntime:
        if self._runtime is None:
            raise RuntimeError("the backend is not started: call start() first")
        return self._runtime

    async def start(self, routes: FrontendRouter) -> None:
        loop = asyncio.get_running_loop()

        def on_events(batch: EventBatch) -> None:   # the engine thread
            loop.call_soon_threadsafe(routes.apply, batch.worker_id, (batch,))
        self._runtime = EngineRuntime(on_events, self._clock)

    async def check_room(self, missing: int, in_use: int) -> None:
        return None   # engines share this process: room is the machine's memory

    async def launch(self, worker_id: str) -> tuple[RuntimeSlot, WorkerHello]:
        engine = await self.runtime.open(worker_id, self.model_dir, self.engine, self._clock)
        return (RuntimeSlot(self.runtime, worker_id),
                WorkerHello.here(worker_id, LOCAL_NODE, LOCAL_NODE, engine.facts))

    async def close(self, handles: Sequence[RuntimeSlot]) -> None:
        if self._runtime is not None:   # every engine dropped, its store persisted
            await self._runtime.close()
            self._runtime = None


class LocalBackend(Backend):
    """``Backend`` over ``workers`` engines in this process."""

    def __init__(self, model_dir: Path | str, workers: int = 1, engine: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, policy: str = "orchard",
                 index_bytes: int = DEFAULT_INDEX_BYTES):
        self._local = LocalLauncher(model_dir, engine or EngineConfig(), clock)
        super().__init__(self._local, workers, policy, clock, index_bytes)

    @classmethod
    def from_config(cls, config, workers: int = 1) -> LocalBackend:
        """From a ``cluster.config.Config`` (the embedded default model when none is set)."""
        from workers.model.default_model import ensure_default_model

        model_dir = config.model_dir or str(ensure_default_model())
        return cls(model_dir, workers=workers, engine=engine_config(config),
                   index_bytes=config.router.index_bytes)

    @property
    def runtime(self) -> EngineRuntime:
        """The engine thread every worker's engine runs on."""
        return self._local.runtime
