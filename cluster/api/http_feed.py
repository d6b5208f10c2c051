"""A streamed request's items, run in a task of their own: what the HTTP endpoints that stream
(``cluster.api.http_app``, ``cluster.api.http_messages``) read their answers from."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator


class Feed:
    """One streamed request run in a task of its own, its items handed over through a queue.

    The request's trace context is attached and detached inside that task: Starlette sends
    a streamed body from another task than the endpoint's, and a context opened in one task
    cannot be closed in another.
    """

    _END = object()

    def __init__(self, items: AsyncIterator):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(items))

    async def _run(self, items: AsyncIterator) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(self._END)
            await items.aclose()  # cancelled mid-stream: the request's own cleanup runs

    async def next(self):
        item = await self._queue.get()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()
