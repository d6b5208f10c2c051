"""Concurrency slots: ``max_concurrent`` requests in flight to the backend, shared fairly.

Job requests and Generate calls take a slot for as long as they run on the backend. When slots
are short, a freed slot goes to the waiting tenant that holds the fewest (ties: the one whose
oldest waiter came first), so a tenant that floods Generate gets its share and no more: the
other tenants' jobs keep theirs.

Ownership is what keeps slots from leaking. ``slot(tenant)`` is an ``async with`` block; a
slot acquired for work that runs in another task is handed to that task with ``hand_to``,
whose done callback releases it (a done callback runs even when the task is cancelled before
its first step, when no ``finally`` inside it would). A waiter cancelled after a slot was
granted to it hands the slot straight on.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from typing import AsyncIterator


class SlotPool:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {capacity}")
        self._capacity = capacity
        self._held: dict[str, int] = {}
        self._waiting: dict[str, deque[tuple[int, asyncio.Future]]] = {}
        self._arrivals = itertools.count()

    @property
    def capacity(self) -> int:
        return self._capacity

    def held(self) -> dict[str, int]:
        """Slots held now, per tenant."""
        return dict(self._held)

    def in_use(self) -> int:
        return sum(self._held.values())

    async def acquire(self, tenant: str) -> None:
        """Wait for a slot for ``tenant``; the caller owns it until ``release``."""
        if self.in_use() < self._capacity and not self._waiting:
            self._take(tenant)
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append((next(self._arrivals), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled: pass it on
                self.release(tenant)
            else:
                self._forget(tenant, future)
            raise

    def release(self, tenant: str) -> None:
        held = self._held.get(tenant, 0)
        if held < 1:
            raise RuntimeError(f"slot released for {tenant!r}, which holds none")
        if held == 1:
            del self._held[tenant]
        else:
            self._held[tenant] = held - 1
        self._grant()

    def hand_to(self, task: asyncio.Task, tenant: str) -> asyncio.Task:
        """Make ``task`` the owner of a slot ``tenant`` acquired: released when it is done."""
        task.add_done_callback(lambda _task: self.release(tenant))
        return task

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        await self.acquire(tenant)
        try:
            yield
        finally:
            self.release(tenant)

    def _take(self, tenant: str) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + 1

    def _grant(self) -> None:
        while self.in_use() < self._capacity and self._waiting:
            tenant = min(self._waiting,
                         key=lambda t: (self._held.get(t, 0), self._waiting[t][0][0]))
            queue = self._waiting[tenant]
            _, future = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if future.done():  # cancelled while waiting
                continue
            self._take(tenant)
            future.set_result(None)

    def _forget(self, tenant: str, future: asyncio.Future) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        for entry in queue:
            if entry[1] is future:
                queue.remove(entry)
                break
        if not queue:
            del self._waiting[tenant]
