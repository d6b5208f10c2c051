"""A worker as the backend reaches it: the ``WorkerHandle`` protocol and what a pool keeps.

``cluster.backend.backend.Backend`` routes, runs, retries and reports over handles, whatever
stands behind them::

    WorkerHandle            the in-process engine             a Ray worker actor
    ────────────            ─────────────────────             ──────────────────
    stream(request, ...)    its runtime slot                  its link (cluster.backend.link)
    stats / invalidate /    runtime.call on the engine        Ray calls to the actor
      holdings / ping         thread (cluster.backend.local)    (cluster.backend.ray_pool)
    events                  None: the runtime's callback      the actor's event feed
                              applies its batches at once

A handle's ``stream`` yields what a worker says of a request: ``TokenChunk``s (or one
``Prefilled`` when no chunks are wanted), then one ``WorkerDone`` carrying the result and the
block event batches after the caller's ``feed_after``. ``engine_items`` makes those from an
``EngineRuntime`` run, for both the in-process handle and the worker actor.

A ``Launcher`` starts and stops the workers of one kind; the one ``WorkerPool``
(``cluster.backend.pool``) keeps their lives. Each started worker reports a ``WorkerHello``:
where it runs and what it serves (``workers.messages.ModelFacts``, from its engine).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol, Sequence

from cluster.backend.protocol import TokenChunk
from cluster.backend.routing import Feed, FrontendRouter
from cluster.backend.wire import Prefilled, PullPlan, WorkerDone
from router.kv.key import Namespace
from workers.blas import openblas_in_use
from workers.engine.channel import Finished, Holdings
from workers.engine.config import EngineConfig
from workers.messages import GenerateRequest, ModelFacts, WorkerStats

if TYPE_CHECKING:
    from workers.engine.runtime import EngineRuntime

Items = AsyncIterator[TokenChunk | Prefilled | WorkerDone]


@dataclass(frozen=True, slots=True)
class WorkerHello:
    """What a started worker reports about itself and the model it loaded."""

    worker_id: str
    node_id: str
    node: str             # the node's address, as operators know it
    pid: int
    model: ModelFacts
    openblas: bool

    @classmethod
    def here(cls, worker_id: str, node_id: str, node: str, model: ModelFacts) -> WorkerHello:
        """The hello of a worker in this process."""
        return cls(worker_id, node_id, node, os.getpid(), model, openblas_in_use())


class WorkerHandle(Protocol):
    """One started worker, as the backend and the pool reach it."""

    # the worker's block event feed, followed by the frontend's router; None where its
    # batches reach the router another way (the in-process runtime's callback)
    events: Feed | None
    # where peers pull this worker's blocks from (its stream's host and port); None where
    # its workers cannot pull from each other (the in-process engines)
    address: tuple[str, int] | None

    def stream(self, request: GenerateRequest, feed_after: int, chunks: bool,
               pull: PullPlan | None = None) -> Items:
        """The worker's items for ``request`` (its prefix first pulled as ``pull`` says),
        its ``WorkerDone`` last. ``ValueError`` when refused, ``WorkerFailed`` when the
        worker broke; closed early, the request is aborted on the worker."""

    async def stats(self) -> WorkerStats | None:
        """The worker's own counts; None when it gave no answer (logged)."""

    async def invalidate(self, namespace: Namespace, prefix_tokens: Sequence[int] | None
                         ) -> int:
        """Drop a namespace's blocks, or those under a prompt prefix; how many."""

    async def holdings(self) -> Holdings:
        """What the worker holds; ``WorkerFailed`` when it cannot say."""

    async def ping(self) -> None:
        """Returns while the worker lives; ``WorkerFailed`` once it is gone."""

    def kill(self) -> None:
        """Put a dead worker down at once (its stream is closed by ``close``)."""

    async def close(self) -> None:
        """Stop the worker in order: its stream, then the worker (telemetry flushed)."""


class Launcher(Protocol):
    """Starts and stops workers of one kind for the ``WorkerPool``."""

    prefix: str            # worker ids are the prefix and a counter
    # "" when the launcher starts its workers; else who did (another frontend): the pool then
    # follows them (``discover``, ``launch`` attaches) and never scales, drains or replaces
    owner: str
    model_dir: str
    engine: EngineConfig   # every worker's engine (each with its own worker id)
    replace_dead: bool     # a serving worker that died is replaced
    watch: bool            # the pool pings the workers and rebuilds stale views meanwhile
    pulls: bool            # its workers pull prefixes from each other (``cluster.backend.pull``)

    async def start(self, routes: FrontendRouter) -> None:
        """Before the first worker: what the workers need (Ray, an engine thread)."""

    async def check_room(self, missing: int, in_use: int) -> None:
        """Raise (``NoRoom``) with the fix when ``missing`` more workers cannot be placed."""

    async def launch(self, worker_id: str) -> tuple[WorkerHandle, WorkerHello]:
        """Start one worker and open its stream; it cleans up after itself when it fails."""

    async def discover(self) -> set[str]:
        """The ids of the owner's workers now (only where ``owner`` is set)."""

    async def close(self, handles: Sequence[WorkerHandle]) -> None:
        """Stop every live worker, then what ``start`` started."""


@dataclass(slots=True, eq=False)
class PoolWorker:
    """A worker as the pool keeps it (the frontend's event loop only)."""

    worker_id: str
    state: str = "starting"              # "starting" | "ready" | "draining" | "dead"
    running: int = 0                     # requests in flight (this side's count)
    in_router: bool = False              # added to the frontend's router (once ready)
    handle: WorkerHandle | None = None   # once started
    hello: WorkerHello | None = None     # once started


async def engine_items(runtime: EngineRuntime, worker_id: str, request: GenerateRequest,
                       chunks: bool) -> AsyncIterator[TokenChunk | Prefilled | Finished]:
    """A run on ``runtime`` as a worker tells it: ``TokenChunk``s (or one ``Prefilled`` when
    ``chunks`` is off and more than one token is asked for), then its ``Finished``. Closed
    before ``Finished``, the request is aborted in the engine."""
    first = True
    async with contextlib.aclosing(runtime.run(worker_id, request)) as run:
        async for item in run:
            if isinstance(item, Finished):
                yield item
                return
            if chunks:
                yield TokenChunk(request.request_id, (item.token,), item.text,
                                 item.token_logprobs)
            elif first and request.sampling.max_tokens > 1:  # else: done at once
                yield Prefilled(request.request_id)
            first = False
