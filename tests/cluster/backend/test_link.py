"""The frontend <-> worker request stream (``cluster.backend.link``, ``cluster.backend.wire``)
without Ray: a real ``EngineWorker`` serving on loopback, a ``WorkerLink`` to it. Streams
multiplexed on one connection, a wrong secret refused, an abort reaching the engine, a refused
request, a lost connection, and the codec's exact round trip."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct

import pytest

from cluster.backend import wire
from cluster.backend.link import WorkerLink
from cluster.backend.protocol import TokenChunk
from cluster.backend.wire import Kind, Prefilled, WorkerDone
from cluster.backend.worker_actor import EngineWorker
from router.kv.events import BlockRemoved, BlockStored, EventBatch, Tier
from router.kv.key import Namespace
from tests.support.forged_models import tiny_model
from tests.support.requests import generate_request
from workers.engine.engine import EngineConfig
from workers.messages import (GenerateRequest, GenerateResult, LookupOutcome, LookupReport,
                              ResponseFormat, SamplingParams, Timings, TokenLogprob,
                              WorkerFailed)

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


def test_the_codec_round_trips_every_message_exactly():
    report = LookupReport(LookupOutcome.PARTIAL, 40, 32, 35, 7, None, 1.5, 600.0, 16)
    result = GenerateResult("r", (1, 2), "hi", "length", 0.1, 0.02, 40, 32, 8, 16, report,
                            Timings(1, 2, 3, 4, 5, 6), "w0", {"k": "v"})
    batch = EventBatch("w0", 9, (BlockStored(2**127 + 5, 2**64 + 1, 16, "t"),
                                 BlockRemoved(3, "t", Tier.DISK)))
    scored = dataclasses.replace(result, logprobs=(
        TokenLogprob(1, -0.5, ((1, -0.5), (9, -1.25))), TokenLogprob(2, -2.0)))
    formatted = GenerateRequest("f", Namespace("t", "m", secret=b"s" * 32), (1, 2), SamplingParams(
        max_tokens=4, response_format=ResponseFormat("json_schema", '{"type": "object"}',
                                                     name="obj", strict=True), logprobs=3))
    for kind, body in ((Kind.ITEM, WorkerDone(result, 0.25, True, (batch,))),
                       (Kind.ITEM, WorkerDone(scored, 0.5)),
                       (Kind.GENERATE, [formatted, 3, True, "router-a"]),
                       (Kind.ITEM, TokenChunk("r", (4, 5), "ab")),
                       (Kind.GENERATE, [generate_request("r", (1,), 3, ns=Namespace("t", "m", "r1", "a")),
                                        7, False, ""])):
        data = wire.frame(kind, 42, body)
        assert struct.unpack("!I", data[:4])[0] == len(data) - 4
        decoded = wire._unpack(data[4:])
        assert decoded[:2] == (int(kind), 42)
        assert decoded[2] == (tuple(body) if isinstance(body, list) else body)
    done = wire._unpack(wire.frame(Kind.ITEM, 1, WorkerDone(result, 0.25))[4:])[2]
    assert done.result.lookup.outcome is LookupOutcome.PARTIAL
    with pytest.raises(TypeError, match="does not travel"):
        wire.frame(Kind.ITEM, 1, object())


def test_an_oversized_or_undecodable_frame_is_a_wire_error():
    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await wire.read_frame(reader)
    with pytest.raises(wire.WireError, match="at most"):
        asyncio.run(read(struct.pack("!I", wire.MAX_FRAME + 1)))
    with pytest.raises(wire.WireError, match="undecodable"):
        asyncio.run(read(struct.pack("!I", 3) + b"\xc1\xc1\xc1"))
