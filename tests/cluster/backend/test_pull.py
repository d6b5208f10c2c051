"""A prefix pulled from a peer (``cluster.backend.pull``) between two real ``EngineWorker``s on
loopback, without Ray: the pulled prefix reused with outputs equal to a recompute; a holder
killed mid-pull, a block corrupted in transit, a truncated stream, a wrong secret and a
receiver without room each end the pull, the request computes the prefix and succeeds, and
each kind of failure is logged once naming the peer; the receiver's batches carry its measured
link; and a pull between two hosts (network namespaces, skipped where they cannot be made)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import subprocess
import sys

import pytest

from cluster.backend import wire
from cluster.backend.link import WorkerLink
from cluster.backend.pull import WINDOW, PullLog
from cluster.backend.wire import Kind, PullPlan, WorkerDone
from cluster.backend.worker_actor import EngineWorker
from router.kv.events import LinkMeasure
from router.kv.key import Namespace
from router.pull_cost import DEFAULT_LINK, observed
from tests.support.netns_hosts import INFRA, netns_cluster
from tests.support.forged_models import tiny_model
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams

BLOCK = 16
SECRET = b"s" * 32
PROMPT = tuple(random.Random(7).randrange(1, 250) for _ in range(200))   # 12 full blocks
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4


def _request(ns: Namespace, rid: str, prompt=PROMPT) -> GenerateRequest:
    return GenerateRequest(rid, ns, prompt, SamplingParams(max_tokens=8))


@contextlib.asynccontextmanager
async def _worker(name: str, pace=None, **config):
    worker = EngineWorker(name, str(tiny_model()), EngineConfig(block_size=BLOCK, **config),
                          pace=pace)
    hello = await worker.start()
    host, port = await worker.listen(SECRET)
    try:
        yield worker, port, Namespace("t", hello.model.model_id, hello.model.revision)
    finally:
        await worker.close()


async def _run(worker: EngineWorker, request: GenerateRequest, pull: PullPlan | None = None
               ) -> WorkerDone:
    async with contextlib.aclosing(worker.generate(request, None, False, pull=pull)) as items:
        return [item async for item in items][-1]


def _plan(port: int, blocks: int = 12, peer: str = "w0") -> PullPlan:
    return PullPlan(peer, "127.0.0.1", port, blocks, 0.5)


def test_a_pulled_prefix_is_reused_and_the_outputs_equal_a_recompute():
    async def scenario():
        async with _worker("w0") as (w0, port, ns), _worker("w1") as (w1, _, _):
            first = await _run(w0, _request(ns, "warm"))   # computed whole on w0
            done = await _run(w1, _request(ns, "pulled"), _plan(port))
            assert done.pulled.refused == ""
            assert (done.pulled.blocks, done.pulled.tokens) == (12, 192)
            assert done.pulled.nbytes > 12 * BLOCK_BYTES   # K/V plus each block's header
            assert (done.result.cached_tokens, done.result.computed_tokens) == (192, 8)
            assert done.result.output_tokens == first.result.output_tokens
            # nothing written: 200 prompt + 8 output tokens, the last output token's K/V never
            # computed, leave block 12 one token short (207 of 208)
            assert (await w1.stats()).written_tokens == 0
    asyncio.run(scenario())


def test_a_holder_killed_mid_pull_leaves_the_request_to_compute_its_prefix(caplog):
    async def scenario():
        reached = asyncio.Event()

        async def stall(nbytes: int) -> None:   # the holder stops at its third block
            stall.sent += 1
            if stall.sent == 3:
                reached.set()
                await asyncio.Event().wait()
        stall.sent = 0
        async with _worker("w0", pace=stall) as (w0, port, ns), _worker("w1") as (w1, _, _):
            first = await _run(w0, _request(ns, "warm"))
            pulling = asyncio.create_task(_run(w1, _request(ns, "pulled"), _plan(port)))
            await reached.wait()
            await w0.close()   # killed: its server and its connections go
            done = await pulling
            assert done.pulled.blocks == 0
            assert done.pulled.refused == "truncated: the stream ended before its last block"
            assert (done.result.cached_tokens, done.result.computed_tokens) == (0, 200)
            assert done.result.output_tokens == first.result.output_tokens
    with caplog.at_level(logging.WARNING, logger="cluster.backend.pull"):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.name == "cluster.backend.pull"] == [
        "pull from w0 refused: truncated: the stream ended before its last block; the "
        "request computes the prefix itself"]


@contextlib.asynccontextmanager
async def _bad_holder(frames: list[bytes], close_after: int):
    """A peer that authenticates like a holder and sends ``frames`` as blocks 0..; it ends
    with END unless ``close_after`` cuts the stream after that many blocks."""
    async def serve(reader, writer):
        nonce = wire.new_nonce()
        writer.write(nonce)
        await reader.readexactly(wire.ANSWER_BYTES)
        await wire.read_frame(reader)                  # the PULL
        for i, data in enumerate(frames[:close_after]):
            writer.write(wire.frame(Kind.BLOCK, i, data))
            if (i + 1) % WINDOW == 0:
                await wire.read_frame(reader)          # NEXT
        if close_after >= len(frames):
            writer.write(wire.frame(Kind.END, 0, len(frames)))
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def _frames(worker: EngineWorker, ns: Namespace) -> list[bytes]:
    return await worker.runtime.call("w0", lambda e: e.transfer.serve(ns, PROMPT, 0, 12))


def test_a_block_corrupted_in_transit_is_dropped_and_the_rest_computed(caplog):
    async def scenario():
        async with _worker("w0") as (w0, _, ns), _worker("w1") as (w1, _, _):
            first = await _run(w0, _request(ns, "warm"))
            frames = await _frames(w0, ns)
            bad = bytearray(frames[9])
            bad[-40] ^= 0x01
            frames[9] = bytes(bad)
            async with _bad_holder(frames, 12) as port:
                for rid in ("a", "b"):   # twice: logged once
                    await w1.invalidate(ns, None)   # nothing of the prompt held before
                    done = await _run(w1, _request(ns, rid), _plan(port, peer="bad-peer"))
                    assert done.pulled.refused.startswith("block 9: corrupted in transit")
                    assert done.result.output_tokens == first.result.output_tokens
                    if rid == "a":   # the first window's 8 blocks were kept, then 1 more
                        assert (done.pulled.blocks, done.result.cached_tokens) == (9, 144)
    with caplog.at_level(logging.WARNING, logger="cluster.backend.pull"):
        asyncio.run(scenario())
    (record,) = [r for r in caplog.records if r.name == "cluster.backend.pull"]
    assert record.getMessage().startswith(
        "pull from bad-peer refused: block 9: corrupted in transit")


def test_a_truncated_stream_keeps_the_whole_windows_before_it():
    async def scenario():
        async with _worker("w0") as (w0, _, ns), _worker("w1") as (w1, _, _):
            first = await _run(w0, _request(ns, "warm"))
            async with _bad_holder(await _frames(w0, ns), 10) as port:
                done = await _run(w1, _request(ns, "cut"), _plan(port))
            assert done.pulled.refused == "truncated: the stream ended before its last block"
            assert (done.pulled.blocks, done.result.cached_tokens) == (8, 128)
            assert done.result.output_tokens == first.result.output_tokens
    asyncio.run(scenario())


def test_a_holder_with_another_secret_refuses_the_pull():
    async def scenario():
        async with _worker("w0") as (w0, port, ns):
            first = await _run(w0, _request(ns, "warm"))
            other = EngineWorker("w9", str(tiny_model()), EngineConfig(block_size=BLOCK))
            await other.start()
            await other.listen(b"o" * 32)
            try:
                done = await _run(other, _request(ns, "x"), _plan(port))
            finally:
                await other.close()
            assert done.pulled.blocks == 0 and done.pulled.refused.startswith("truncated")
            assert done.result.output_tokens == first.result.output_tokens
    asyncio.run(scenario())


def test_a_receiver_without_room_refuses_the_pull_and_computes():
    async def scenario():
        async with _worker("w0") as (w0, port, ns), \
                _worker("w1", store_bytes=4 * BLOCK_BYTES) as (w1, _, _):
            first = await _run(w0, _request(ns, "warm"))
            done = await _run(w1, _request(ns, "full"), _plan(port))
            assert done.pulled.refused == (f"no room: 12 blocks take {12 * BLOCK_BYTES} bytes, "
                                           f"this worker's memory tier holds {4 * BLOCK_BYTES}")
            assert (done.pulled.blocks, done.pulled.nbytes) == (0, 0)
            assert done.result.cached_tokens == 0
            assert done.result.output_tokens == first.result.output_tokens
    asyncio.run(scenario())


def test_a_pull_comes_over_the_frontends_link_too():
    async def scenario():
        async with _worker("w0") as (w0, port0, ns), _worker("w1") as (w1, port1, _):
            await _run(w0, _request(ns, "warm"))
            link = await WorkerLink.connect("w1", "127.0.0.1", port1, SECRET)
            async with contextlib.aclosing(link.stream(_request(ns, "via-link"), 0, False,
                                                       _plan(port0))) as items:
                done = [item async for item in items][-1]
            await link.close()
            assert done.pulled.blocks == 12 and done.result.cached_tokens == 192
    asyncio.run(scenario())


async def _send_pull(port: int, secret: bytes, body) -> bytes:
    """Open a transfer connection, answer the nonce with ``secret``, send a PULL; what the
    holder sent back before it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(wire.answer(secret, await reader.readexactly(wire.NONCE_BYTES)))
    writer.write(wire.frame(Kind.PULL, 0, body))
    received = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return received


def test_a_malformed_pull_or_a_wrong_secret_is_refused_and_logged_naming_the_peer(caplog):
    async def scenario():
        async with _worker("w0") as (w0, port, ns):
            await _run(w0, _request(ns, "warm"))
            assert await _send_pull(port, SECRET, [ns, PROMPT, 0, 12, 0]) == b""
            assert await _send_pull(port, SECRET, [ns, "tokens", 0, 12, 8]) == b""
            assert await _send_pull(port, b"x" * 32, [ns, PROMPT, 0, 12, 8]) == b""
            served = await _send_pull(port, SECRET, [ns, PROMPT, 12, 12, 8])   # nothing asked
            reader = asyncio.StreamReader()
            reader.feed_data(served)
            reader.feed_eof()
            assert await wire.read_frame(reader) == (Kind.END, 0, 0)
    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("cluster.backend")]
    refused = [m for m in messages if "refused" in m or "authentication" in m]
    assert len(refused) == 3 and all("127.0.0.1" in m for m in refused)
    assert refused[0].endswith("refused: window 0: want 1 to 64")
    assert refused[1].endswith("refused: tokens: not a list of token ids")
    assert "failed authentication" in refused[2]


def test_each_kind_of_failure_is_logged_once_per_peer(caplog):
    failures = PullLog()
    with caplog.at_level(logging.WARNING, logger="cluster.backend.pull"):
        failures.failed("w0", "block 3: corrupted in transit (<in transit>: checksum mismatch)")
        failures.failed("w0", "block 5: corrupted in transit (<in transit>: checksum mismatch)")
        failures.failed("w0", "truncated: the stream ended before its last block")
        failures.failed("w1", "block 3: corrupted in transit (<in transit>: checksum mismatch)")
    assert [r.getMessage().split(" refused: ")[0] for r in caplog.records] == [
        "pull from w0", "pull from w0", "pull from w1"]
    assert "block 3: corrupted" in caplog.records[0].getMessage()
    assert "truncated" in caplog.records[1].getMessage()


def test_the_receivers_batches_after_a_pull_carry_its_measured_link_from_the_holder():
    async def fed(worker: EngineWorker, request: GenerateRequest, pull: PullPlan | None = None
                  ) -> WorkerDone:   # with every batch since the first
        async with contextlib.aclosing(worker.generate(request, 0, False, pull=pull)) as items:
            return [item async for item in items][-1]

    async def scenario():
        async with _worker("w0") as (w0, port, ns), _worker("w1") as (w1, _, _):
            await _run(w0, _request(ns, "warm"))
            other = tuple(range(300, 340))
            assert [b.links for b in (await fed(w1, _request(ns, "own", other))).events] == [()]
            done = await fed(w1, _request(ns, "pulled"), _plan(port))
            # the pull's own bytes and time, folded into the default link by the rule
            expected = observed(DEFAULT_LINK, done.pulled.nbytes, done.pulled.seconds)
            assert done.events[-1].links == (LinkMeasure("w0", expected.bytes_s,
                                                         expected.fixed_s),)
            assert [b.links for b in done.events[:-1]] == [()] * (len(done.events) - 1)
    asyncio.run(scenario())


@pytest.fixture(scope="module")
def hosts():
    """Two hosts: network namespaces joined by veth pairs on a bridge (``infra/netns.py``)."""
    with netns_cluster(workers=1) as cluster:
        yield cluster


def _rx_bytes(hosts, node) -> int:
    done = hosts.run_in(node, ["cat", f"/sys/class/net/i{hosts.tag}{node.name}/statistics/"
                                      "rx_bytes"], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.slow
def test_a_pull_crosses_the_veth_between_two_hosts_with_the_outputs_of_a_recompute(hosts):
    """The holder in one namespace, the receiver in another, the link shaped by the holder's
    rate limit in the transfer stream (10 Gbit/s): the whole prefix comes over the veth."""
    a, b = hosts.nodes
    script = [sys.executable, str(INFRA / "netns_pull.py")]
    common = ["--model", str(tiny_model()), "--secret", SECRET.hex(), "--tokens",
              str(len(PROMPT)), "--seed", "7"]
    holder = hosts.popen_in(a, [*script, "holder", "--host", a.address, *common],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(holder.stdout.readline())
        assert held["host"] == a.address
        before = _rx_bytes(hosts, b)
        done = hosts.run_in(b, [*script, "receiver", "--host", b.address, *common, "--holder",
                                f"{a.address}:{held['port']}"],
                            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        received = _rx_bytes(hosts, b) - before
    finally:
        holder.stdin.close()
        holder.wait(60)
    pulled = got["pulled"]
    assert (pulled["peer"], pulled["blocks"], pulled["tokens"], pulled["refused"]) == (
        "w0", 12, 192, "")
    assert received > pulled["nbytes"] > 12 * BLOCK_BYTES   # the blocks came over the veth
    assert (got["cached_tokens"], got["computed_tokens"]) == (192, 8)
    assert got["output_tokens"] == got["recomputed_output_tokens"] == held["output_tokens"]
    assert holder.returncode == 0
