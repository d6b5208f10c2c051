"""The prefix store with one tier (memory), exactly: refusals word for word, the figures it
reports, what ``write`` takes from a cache that holds less than the tokens, the closest
stored block at a near miss, and every call that also serves a disk tier."""
from __future__ import annotations

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import Eviction
from workers.messages import LookupOutcome
from workers.cache.blocks import KVShape
from workers.cache.store import PrefixStore

from test_store import BS, NS, SHAPE, kv_for, make_store, put
from tests.conftest import Clock

A = list(range(1, 9))  # two blocks
OTHER = Namespace("tenant-b", "m", "r1")


def test_a_block_size_of_zero_and_heads_that_cannot_be_quantized_are_refused_word_for_word():
    with pytest.raises(ValueError) as zero:
        PrefixStore(SHAPE, 0, 1 << 20, 60.0, Clock())
    assert str(zero.value) == "block_size must be positive, got 0"
    with pytest.raises(ValueError) as heads:
        PrefixStore(SHAPE, BS, 1 << 20, 60.0, Clock(), kv_bits=8)
    assert str(heads.value) == ("8-bit K/V needs head_dim divisible by 64, this model has "
                                "head_dim 8: set the tier's kv bits to 0")


def test_the_store_keeps_its_eviction_policy():
    assert make_store(Eviction.REUSE).ledger.policy is Eviction.REUSE
    assert make_store(Eviction.LRU).ledger.policy is Eviction.LRU


def test_a_store_without_a_disk_tier_answers_every_call_for_memory_alone():
    clock = Clock()
    store = make_store(Eviction.LRU, ttl=60.0, clock=clock)
    assert put(store, A) == 8
    a0, a1 = hash_blocks(A, BS, NS)
    assert store.prefetch(NS, A + [9]) == 0  # nothing to read ahead
    assert [(h.block, h.parent) for h in store.holdings()] == [(a0, NS.root()), (a1, a0)]
    assert store.namespaces() == [NS.label()]
    assert store.written_blocks() == 2
    stats = store.stats()
    assert (stats.bytes_per_token, stats.tensor_bytes, stats.disk) == (256, 8 * 256, None)
    report = store.lookup(NS, A + [9]).report
    assert (report.ttl_s, report.entry_age_s, report.disk_tokens) == (60.0, 0.0, 0)
    store.flush()  # no disk: nothing to wait for
    clock.now = 60.0
    assert store.expire() == 2
    assert store.holdings() == [] and store.stats().tensor_bytes == 0
    store.close()


def test_write_takes_only_the_full_blocks_the_cache_holds():
    store = make_store(Eviction.LRU)
    assert store.write(NS, A, []) == 0                  # no cache, nothing held
    assert store.write(NS, A, kv_for(A[:4])) == 4       # the cache holds 4 of the 8 tokens
    assert store.write(NS, A[:4], kv_for(A[:4])) == 0   # already held: nothing new
    assert store.write(NS, A, kv_for(A)) == 4           # the second block now
    assert store.stats().ledger.blocks == 2
    one_token_blocks = PrefixStore(SHAPE, 1, 1 << 20, 60.0, Clock())
    assert one_token_blocks.write(NS, [1, 2], []) == 0
    one_layer = KVShape(layers=1, kv_heads=2, head_dim=8, dtype=mx.float32)
    single = PrefixStore(one_layer, BS, 1 << 20, 60.0, Clock())
    assert single.write(NS, A, kv_for(A)[:1]) == 8


def test_every_refused_hit_is_counted():
    from router.kv.key import BlockHash

    def colliding(tokens, block_size, namespace):  # every prompt's blocks hash alike
        return [BlockHash(1000 + i) for i in range(len(tokens) // block_size)]

    store = make_store(Eviction.LRU, hasher=colliding)
    put(store, A)
    for _ in range(2):
        assert store.lookup(NS, [1, 2, 3, 4, 60, 61, 62, 63, 64]).report.matched_tokens == 4
    assert store.stats().identity_mismatches == 2


def test_a_near_miss_at_the_first_token_of_a_block_names_both_tokens():
    store = make_store(Eviction.LRU)
    put(store, A)
    report = store.lookup(NS, [1, 2, 3, 4, 50, 51, 52, 53, 54]).report
    assert report.outcome == LookupOutcome.NEAR_MISS
    assert (report.common_prefix, report.next_prompt_token, report.next_stored_token) == (4, 50, 5)


def test_an_unknown_namespace_is_refused_naming_those_held():
    store = make_store(Eviction.LRU)
    with pytest.raises(ValueError) as empty:
        store.invalidate_namespace("tenant-x/m")
    assert str(empty.value) == "unknown namespace 'tenant-x/m': held namespaces are none"
    put(store, A)
    put(store, [11, 12, 13, 14], OTHER)
    with pytest.raises(ValueError) as two:
        store.invalidate_namespace("tenant-x/m")
    assert str(two.value) == (f"unknown namespace 'tenant-x/m': held namespaces are "
                              f"{NS.label()}, {OTHER.label()}")
    assert store.invalidate_namespace(OTHER.label()) == 1  # by its label, as a string
    assert store.namespaces() == [NS.label()]
