"""The frontend <-> worker request stream (``cluster.backend.link``) without Ray: a real
``EngineWorker`` serving on loopback, a ``WorkerLink`` to it. Streams multiplexed on one
connection, a wrong secret refused, an abort reaching the engine, a refused request, a lost
connection. The frames themselves: ``tests/cluster/backend/test_wire.py``."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from cluster.backend.link import WorkerLink
from cluster.backend.protocol import TokenChunk
from cluster.backend.wire import Prefilled, WorkerDone
from cluster.backend.worker_actor import EngineWorker
from router.kv.events import BlockStored
from router.kv.key import Namespace
from tests.support.forged_models import tiny_model
from tests.support.requests import generate_request
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, WorkerFailed

BLOCK = 16
SECRET = b"s" * 32


@contextlib.asynccontextmanager
async def _served():
    worker = EngineWorker("w0", str(tiny_model()), EngineConfig(block_size=BLOCK))
    hello = await worker.start()
    host, port = await worker.listen(SECRET)
    assert host == "127.0.0.1"  # outside Ray: served on loopback
    try:
        yield worker, port, Namespace("t", hello.model.model_id, hello.model.revision)
    finally:
        await worker.close()


async def _collect(link: WorkerLink, request: GenerateRequest, chunks: bool = True):
    async with contextlib.aclosing(link.stream(request, 0, chunks)) as items:
        return [item async for item in items]


def test_streams_share_one_connection_and_carry_block_events():
    async def scenario():
        async with _served() as (worker, port, ns):
            link = await WorkerLink.connect("w0", "127.0.0.1", port, SECRET)
            a, b = await asyncio.gather(
                _collect(link, generate_request("a", tuple(range(20, 84)), 5, ns=ns)),
                _collect(link, generate_request("b", tuple(range(100, 132)), 3, ns=ns), chunks=False))
            assert [type(i) for i in a] == [TokenChunk] * 5 + [WorkerDone]
            assert tuple(t for c in a[:-1] for t in c.token_ids) == a[-1].result.output_tokens
            assert a[-1].result.request_id == "a" and a[-1].result.input_tokens == 64
            assert [type(i) for i in b] == [Prefilled, WorkerDone]
            assert b[-1].result.request_id == "b" and len(b[-1].result.output_tokens) == 3
            stored = {e.block for r in (a, b) for batch in r[-1].events for e in batch.events
                      if isinstance(e, BlockStored)}
            assert len(stored) == 64 // BLOCK + 32 // BLOCK  # every stored block, once
            assert (await worker.stats()).requests_served == 2
            await link.close()
    asyncio.run(scenario())


def test_a_wrong_secret_is_refused_before_any_request_runs():
    async def scenario():
        async with _served() as (worker, port, ns):
            link = await WorkerLink.connect("w0", "127.0.0.1", port, b"x" * 32)
            with pytest.raises(WorkerFailed, match="stream closed"):
                await asyncio.wait_for(_collect(link, generate_request("a", (1, 2, 3), 2, ns=ns)), 10)
            assert (await worker.stats()).requests_served == 0
            await link.close()
    asyncio.run(scenario())


def test_a_stream_closed_early_is_aborted_in_the_engine():
    async def scenario():
        async with _served() as (worker, port, ns):
            link = await WorkerLink.connect("w0", "127.0.0.1", port, SECRET)
            stream = link.stream(generate_request("long", tuple(range(10, 60)), 1500, ns=ns), 0, True)
            assert isinstance(await anext(stream), TokenChunk)
            await stream.aclose()
            for _ in range(100):  # 1,500 tokens take far longer than this to decode
                if (await worker.stats()).running == 0:
                    break
                await asyncio.sleep(0.02)
            stats = await worker.stats()
            assert stats.running == 0 and stats.requests_served == 0
            await link.close()
    asyncio.run(scenario())


def test_a_refused_request_is_a_value_error_and_the_link_stays_up():
    async def scenario():
        async with _served() as (worker, port, ns):
            link = await WorkerLink.connect("w0", "127.0.0.1", port, SECRET)
            with pytest.raises(ValueError):
                await _collect(link, generate_request("bad", (10**9,), 2, ns=ns))
            ok = await _collect(link, generate_request("ok", (5, 6, 7), 2, ns=ns))
            assert [type(i) for i in ok] == [TokenChunk, TokenChunk, WorkerDone]
            await link.close()
    asyncio.run(scenario())


def test_a_lost_worker_fails_its_open_streams():
    async def scenario():
        async with _served() as (worker, port, ns):
            link = await WorkerLink.connect("w0", "127.0.0.1", port, SECRET)
            stream = link.stream(generate_request("long", tuple(range(10, 60)), 1500, ns=ns), 0, True)
            assert isinstance(await anext(stream), TokenChunk)
            await worker.close()  # its server and its connections go
            with pytest.raises(WorkerFailed, match="w0"):
                async for _ in stream:
                    pass
            with pytest.raises(WorkerFailed, match="w0"):  # and every later one, at once
                await _collect(link, generate_request("next", (1, 2), 2, ns=ns))
            await link.close()
    asyncio.run(scenario())
