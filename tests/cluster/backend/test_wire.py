"""The frames of the frontend <-> worker stream (``cluster.backend.wire``): the codec's exact
round trip of every message that travels (a streamed chunk with its log-probabilities among
them), the frames a broken peer sends refused as a
``WireError``, and the stream's HMAC challenge and answer."""
from __future__ import annotations

import asyncio
import dataclasses
import struct

import msgpack
import pytest

from cluster.backend import wire
from cluster.backend.protocol import TokenChunk
from cluster.backend.wire import Kind, WorkerDone
from router.kv.events import BlockRemoved, BlockStored, EventBatch, Tier
from router.kv.key import Namespace
from tests.support.requests import generate_request
from workers.messages import (GenerateRequest, GenerateResult, LookupOutcome, LookupReport,
                              ResponseFormat, SamplingParams, Timings, TokenLogprob)


async def _read(data: bytes):
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await wire.read_frame(reader)


class TestTheCodec:
    def test_the_codec_round_trips_every_message_exactly(self):
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

    def test_an_oversized_or_undecodable_frame_is_a_wire_error(self):
        async def read(data: bytes):
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            return await wire.read_frame(reader)
        with pytest.raises(wire.WireError, match="at most"):
            asyncio.run(read(struct.pack("!I", wire.MAX_FRAME + 1)))
        with pytest.raises(wire.WireError, match="undecodable"):
            asyncio.run(read(struct.pack("!I", 3) + b"\xc1\xc1\xc1"))

    def test_an_unknown_extension_type_is_a_wire_error_naming_it(self):
        body = msgpack.packb([int(Kind.ITEM), 1, msgpack.ExtType(9, msgpack.packb([0, 0]))])
        with pytest.raises(wire.WireError, match="^unknown extension type 9$"):
            asyncio.run(_read(struct.pack("!I", len(body)) + body))

    def test_a_frame_is_read_back_as_its_kind_stream_and_body(self):
        async def both():
            reader = asyncio.StreamReader()
            reader.feed_data(wire.frame(Kind.NEXT, 7) + wire.frame(Kind.END, 3, 12))
            reader.feed_eof()
            return await wire.read_frame(reader), await wire.read_frame(reader)
        first, second = asyncio.run(both())
        assert first == (Kind.NEXT, 7, None) and type(first[0]) is Kind
        assert second == (Kind.END, 3, 12)

    def test_a_streamed_chunks_logprobs_travel_on_the_worker_stream(self):
        chunk = TokenChunk("r", (4,), "ab", (TokenLogprob(4, -0.5, ((4, -0.5), (1, -0.75))),))
        decoded = wire._unpack(wire.frame(wire.Kind.ITEM, 3, chunk)[4:])
        assert decoded[2] == chunk


class TestAuthentication:
    def test_the_answer_is_hmac_sha256_of_the_nonce_under_the_secret(self):
        # RFC 4231, test case 2
        assert wire.answer(b"Jefe", b"what do ya want for nothing?").hex() == (
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        assert wire.ANSWER_BYTES == 32

    def test_only_the_answer_under_the_same_secret_is_accepted(self):
        secret, nonce = b"s" * 32, wire.new_nonce()
        right = wire.answer(secret, nonce)
        assert wire.accepts(secret, nonce, right)
        assert not wire.accepts(secret, nonce, wire.answer(b"x" * 32, nonce))
        assert not wire.accepts(secret, wire.new_nonce(), right)
        flipped = bytes([right[0] ^ 0x01]) + right[1:]
        assert not wire.accepts(secret, nonce, flipped)

    def test_each_nonce_is_32_fresh_bytes(self):
        nonces = {wire.new_nonce() for _ in range(8)}
        assert len(nonces) == 8 and {len(n) for n in nonces} == {wire.NONCE_BYTES} == {32}
