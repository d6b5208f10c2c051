"""Concurrency slots: ``max_concurrent`` requests in flight to the backend, shared fairly.

Job requests and Generate calls take a slot for as long as they run on the backend. When slots
are short, a freed slot goes to the waiting tenant that holds the fewest (ties: the one whose
oldest waiter came first), so a tenant that floods Generate gets its share and no more: the
other tenants' jobs keep theirs. Waiters have a priority (``workers.messages.Priority``): a
freed slot goes to an interactive waiter whenever one waits, and to a batch waiter only when
none does, so a batch job's queued requests never go to the backend ahead of a person's
(fairness between tenants applies within each priority). One exception keeps batch work
moving under an interactive flood: while batch requests hold fewer than ``batch_floor`` slots
(a quarter of them, at least one), a waiting batch request takes the freed slot first. So a
flood slows a job to a quarter of the slots and never stops it (``orchard bench overload``
measures its progress)::

    capacity 4, held: i i i b   waiting: i5 i6 b2      freed i  -> i5   (batch holds 1 = floor)
    capacity 4, held: i i i i   waiting: i5 b1         freed i  -> b1   (batch holds 0 < 1)

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

from workers.messages import Priority

LANES = (Priority.INTERACTIVE, Priority.BATCH)  # the order freed slots are granted in
BATCH_SHARE = 4  # batch requests are owed 1 slot in 4 (at least 1) while they wait


class SlotPool:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {capacity}")
        self._capacity = capacity
        self._batch_floor = max(1, capacity // BATCH_SHARE)
        self._held: dict[str, int] = {}
        self._batch_held = 0  # of the slots held, those held by batch requests
        self._lanes: dict[Priority, dict[str, deque[tuple[int, asyncio.Future]]]] = {
            p: {} for p in LANES}
        self._arrivals = itertools.count()

    @property
    def capacity(self) -> int:
        return self._capacity

    def held(self) -> dict[str, int]:
        """Slots held now, per tenant."""
        return dict(self._held)

    def in_use(self) -> int:
        return sum(self._held.values())

    def held_by(self, priority: Priority) -> int:
        """Slots held now by requests of ``priority``."""
        return self._batch_held if priority is Priority.BATCH else (
            self.in_use() - self._batch_held)

    def for_interactive(self) -> int:
        """Slots that interactive requests take turns on: all, less the batch floor while
        batch requests wait (a slot batch holds within its floor goes back to batch)."""
        kept = min(self._batch_floor, self._batch_held) if self._lanes[Priority.BATCH] else 0
        return self._capacity - kept

    def waiting(self, priority: Priority) -> int:
        """Waiters of ``priority`` (cancelled ones not yet passed over included)."""
        return sum(len(queue) for queue in self._lanes[priority].values())

    async def acquire(self, tenant: str, priority: Priority = Priority.INTERACTIVE) -> None:
        """Wait for a slot for ``tenant``; the caller owns it until ``release`` (with the
        same priority)."""
        if self.in_use() < self._capacity and not any(self._lanes.values()):
            self._take(tenant, priority)
            return
        future = asyncio.get_running_loop().create_future()
        waiting = self._lanes[priority]
        waiting.setdefault(tenant, deque()).append((next(self._arrivals), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled: pass it on
                self.release(tenant, priority)
            else:
                self._forget(waiting, tenant, future)
            raise

    def release(self, tenant: str, priority: Priority = Priority.INTERACTIVE) -> None:
        held = self._held.get(tenant, 0)
        if held < 1 or (priority is Priority.BATCH and self._batch_held < 1):
            raise RuntimeError(f"a {priority} slot released for {tenant!r}, which holds none")
        if held == 1:
            del self._held[tenant]
        else:
            self._held[tenant] = held - 1
        if priority is Priority.BATCH:
            self._batch_held -= 1
        self._grant()

    def hand_to(self, task: asyncio.Task, tenant: str,
                priority: Priority = Priority.INTERACTIVE) -> asyncio.Task:
        """Make ``task`` the owner of a slot ``tenant`` acquired: released when it is done."""
        task.add_done_callback(lambda _task: self.release(tenant, priority))
        return task

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, priority: Priority = Priority.INTERACTIVE
                   ) -> AsyncIterator[None]:
        await self.acquire(tenant, priority)
        try:
            yield
        finally:
            self.release(tenant, priority)

    def _take(self, tenant: str, priority: Priority) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + 1
        if priority is Priority.BATCH:
            self._batch_held += 1

    def _next_lane(self) -> Priority | None:
        """Interactive first, unless batch requests wait holding fewer than their floor."""
        if self._lanes[Priority.BATCH] and self._batch_held < self._batch_floor:
            return Priority.BATCH
        return next((p for p in LANES if self._lanes[p]), None)

    def _grant(self) -> None:
        while self.in_use() < self._capacity:
            priority = self._next_lane()
            if priority is None:
                return
            waiting = self._lanes[priority]
            tenant = min(waiting, key=lambda t: (self._held.get(t, 0), waiting[t][0][0]))
            queue = waiting[tenant]
            _, future = queue.popleft()
            if not queue:
                del waiting[tenant]
            if future.done():  # cancelled while waiting
                continue
            self._take(tenant, priority)
            future.set_result(None)

    @staticmethod
    def _forget(waiting: dict[str, deque[tuple[int, asyncio.Future]]], tenant: str,
                future: asyncio.Future) -> None:
        queue = waiting.get(tenant)
        if queue is None:
            return
        for entry in queue:
            if entry[1] is future:
                queue.remove(entry)
                break
        if not queue:
            del waiting[tenant]
