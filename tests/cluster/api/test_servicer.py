"""``cluster.api.servicer.until_rpc_done``: a streamed RPC's items pumped by a task the RPC's
end cancels, the next item read only once the handler wants it."""
from __future__ import annotations

import asyncio

from cluster.api.servicer import until_rpc_done


class _Rpc:
    """The two calls ``until_rpc_done`` makes of a ``grpc.aio`` servicer context."""

    def __init__(self) -> None:
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def done(self) -> bool:
        return False

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


def _items(log: list[str], n: int):
    async def items():
        try:
            for i in range(n):
                log.append(f"yield {i}")
                yield i
                log.append(f"after {i}")
        finally:
            log.append("closed")
    return items()


def test_the_pump_reads_the_next_item_only_once_the_handler_wants_it():
    async def scenario():
        log: list[str] = []
        stream = until_rpc_done(_Rpc(), _items(log, 2))
        assert await anext(stream) == 0
        for _ in range(10):   # every chance to read ahead while the handler sends item 0
            await asyncio.sleep(0)
        before_next = list(log)
        assert [i async for i in stream] == [1]
        return before_next, log

    before_next, log = asyncio.run(scenario())
    # what the items do after their last yield (a request's trace) waits for the handler
    assert before_next == ["yield 0"]
    assert log == ["yield 0", "after 0", "yield 1", "after 1", "closed"]


def test_the_rpc_s_end_closes_the_items_where_they_wait():
    async def scenario():
        log: list[str] = []
        rpc = _Rpc()
        stream = until_rpc_done(rpc, _items(log, 3))
        assert await anext(stream) == 0
        assert await anext(stream) == 1
        rpc.end()               # the client went away while the handler sent item 1
        for _ in range(10):
            await asyncio.sleep(0)
        return log

    assert asyncio.run(scenario()) == ["yield 0", "after 0", "yield 1", "closed"]
