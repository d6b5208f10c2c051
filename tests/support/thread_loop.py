"""An event loop on a thread of its own, for sync tests that await a backend, and the prompts
the Ray tests send (a shared system prefix, then a part of their own)."""
from __future__ import annotations

import asyncio
import threading


class Loop:
    """An event loop on a thread of its own, so sync tests can await the backend."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def shared_prompt(seed: int, shared: int = 96, own: int = 20) -> tuple[int, ...]:
    """``shared`` tokens every seed has, then ``own`` tokens of ``seed``'s."""
    system = tuple(100 + (i * 7) % 900 for i in range(shared))
    return system + tuple(1000 + seed * 31 + i for i in range(own))
