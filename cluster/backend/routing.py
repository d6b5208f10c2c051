"""The frontend's router: ``router.router.Router`` in the frontend's own process.

Routing costs no Ray hop: the frontend decides, then calls the chosen worker once, as Ray
Serve's handles do. Each frontend routes with its own ``FrontendRouter``; no router is shared
between processes. The router learns what each worker holds from the worker's block event
batches, which reach it two ways::

    worker ─ WorkerDone.events ─────────────────────► apply   on every result: the batches
                                                              after the caller's last one, so
                                                              the next request sees what this
                                                              one stored
    worker ─ its handle's events(after) feed ───────► apply   evictions, TTL expiry, requests
                                                              other callers sent

(The in-process engines have no feed: their runtime's callback applies every batch as it is
published, before the result it belongs to reaches the caller.)

Each batch is applied once, in sequence order (``_applied``, per worker); one that skips ahead
is a gap the index notices, and the pool's check rebuilds that worker's view from its
``Holdings`` (which say up to which batch they reach). A quiet worker's feed sends a
``FeedHeartbeat`` with its last batch's number: past what was applied, the last batch was lost
(a result that carried it was never applied), which is a gap too. A heartbeat that overtakes
a result still carrying that batch costs one needless rebuild, never a wrong view: the
rebuild's holdings include the batch, and the batch, arriving after, is skipped. Everything here runs on the frontend's
event loop; nothing blocks it.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from router.index import DEFAULT_INDEX_BYTES
from router.kv.events import EventBatch
from router.router import Router
from workers.engine.channel import Holdings



@dataclass(frozen=True, slots=True)
class FeedHeartbeat:
    """A quiet worker's feed: ``seq`` is the last event batch it published (0: none yet)."""

    seq: int


FeedItem = Sequence[EventBatch] | FeedHeartbeat
Feed = Callable[[int], AsyncIterator[FeedItem]]   # batches after a sequence number; heartbeats


class FrontendRouter:
    """The routing state of one frontend and the event feeds that keep it current."""

    def __init__(self, block_size: int, clock: Callable[[], float] = time.monotonic,
                 index_bytes: int = DEFAULT_INDEX_BYTES) -> None:
        self.router = Router(block_size, clock=clock, index_bytes=index_bytes)
        self.index_bytes = index_bytes              # the prefix index's budget ([router])
        self._applied: dict[str, int] = {}          # worker -> last batch applied
        self._feeds: dict[str, asyncio.Task] = {}   # worker -> its events() reader

    def add_worker(self, worker_id: str, feed: Feed | None = None) -> None:
        """Route to ``worker_id`` from now on and follow its block events' ``feed``."""
        self.router.add_worker(worker_id)
        self._applied[worker_id] = 0
        if feed is not None:
            self._feeds[worker_id] = asyncio.get_running_loop().create_task(
                self._follow(worker_id, feed), name=f"feed-{worker_id}")

    def drain_worker(self, worker_id: str) -> None:
        self.router.drain_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` and everything it held, at once."""
        feed = self._feeds.pop(worker_id, None)
        if feed is not None:
            feed.cancel()
        self._applied.pop(worker_id, None)
        self.router.remove_worker(worker_id)

    def feed_after(self, worker_id: str) -> int:
        """The last batch applied from ``worker_id``: a result carries the ones after it."""
        return self._applied.get(worker_id, 0)

    def apply(self, worker_id: str, batches: Sequence[EventBatch]) -> None:
        """Apply the batches not applied yet, in order (each arrives by result and by feed)."""
        for batch in batches:
            last = self._applied.get(worker_id)
            if last is None or batch.seq <= last:
                continue  # a removed worker, or already applied
            self.router.apply_events(batch)
            self._applied[worker_id] = batch.seq

    def heard(self, worker_id: str, heartbeat: FeedHeartbeat) -> None:
        """``worker_id``'s feed says its last batch is ``heartbeat.seq``: if that was never
        applied, it was lost, and the worker is stale until the pool's check rebuilds it."""
        applied = self._applied.get(worker_id)
        if applied is not None and heartbeat.seq > applied:
            self.router.lost_events(worker_id, heartbeat.seq)

    def rebuild(self, worker_id: str, holdings: Holdings) -> None:
        """Replace the view of ``worker_id`` by what it holds (batches up to ``seq`` included)."""
        if worker_id in self._applied:
            self.router.rebuild(worker_id, holdings.blocks, holdings.disk_blocks)
            self._applied[worker_id] = holdings.seq

    def stale_workers(self) -> list[str]:
        return self.router.stale_workers()

    async def close(self) -> None:
        for feed in self._feeds.values():
            feed.cancel()
        await asyncio.gather(*self._feeds.values(), return_exceptions=True)
        self._feeds.clear()

    async def _follow(self, worker_id: str, feed: Feed) -> None:
        async for item in feed(self.feed_after(worker_id)):  # ends with its worker
            if isinstance(item, FeedHeartbeat):
                self.heard(worker_id, item)
            else:
                self.apply(worker_id, item)
