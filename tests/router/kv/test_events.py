"""Block event batches on the wire (``router.kv.events``): a batch's measured links from its
worker's peers round-trip exactly, a batch without them (or from before them) decodes with
none, and an impossible link is refused naming its peer."""
from __future__ import annotations

import msgpack
import pytest

from router.kv.events import (BlockStored, EventBatch, LinkMeasure, WorkerRates, decode_batch,
                              encode_batch)
from router.kv.key import Namespace, hash_blocks

NS = Namespace("acme", "tiny")
HASHES = hash_blocks(list(range(32)), 16, NS)
STORED = (BlockStored(HASHES[1], HASHES[0], 16, NS.label()),)


def test_a_batchs_links_round_trip_exactly():
    batch = EventBatch("w1", 3, STORED, WorkerRates(64, None, 900.0),
                       (LinkMeasure("w0", 1.25e9, 0.0015), LinkMeasure("w2", 1.1e8, 0.002)))
    assert decode_batch(encode_batch(batch)) == batch


def test_a_batch_without_links_is_encoded_as_before_and_decodes_with_none():
    batch = EventBatch("w1", 3, STORED)
    assert len(msgpack.unpackb(encode_batch(batch))) == 4
    assert decode_batch(encode_batch(batch)).links == ()


def test_an_impossible_link_is_refused_naming_its_peer():
    with pytest.raises(ValueError, match="LinkMeasure from 'w0' needs bytes_s > 0"):
        LinkMeasure("w0", 0.0, 0.001)
    with pytest.raises(ValueError, match="must name a worker"):
        LinkMeasure("", 1e9, 0.001)
    wire = msgpack.packb(["w1", 3, [], None, [["w0", float("nan"), 0.001]]])
    with pytest.raises(ValueError, match="malformed event batch: LinkMeasure from 'w0'"):
        decode_batch(wire)
