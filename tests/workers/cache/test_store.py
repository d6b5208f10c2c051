"""PrefixStore with real tensors: exact bytes, dedup, outcomes, near misses, TTL, invalidation.

The prefix store with one tier (memory), exactly: refusals word for word, the figures it
reports, what ``write`` takes from a cache that holds less than the tokens, the closest
stored block at a near miss, and every call that also serves a disk tier.
"""
from __future__ import annotations

import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from router.kv.events import BlockRemoved, BlockStored
from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import Eviction, LedgerEventKind
from workers.messages import LookupOutcome
from workers.cache.blocks import KVShape
from workers.cache.store import PrefixStore
from tests.conftest import Clock
from router.kv.ledger import Eviction


BS = 4

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=8, dtype=mx.float32)

NS = Namespace("tenant-a", "m", "r1")

def kv_for(tokens: list[int]) -> list[KVCache]:
    """A per-layer cache whose K/V encode (layer, position, token) so slices can be checked."""
    caches = []
    n = len(tokens)
    tok = mx.array(tokens, dtype=mx.float32).reshape(1, 1, n, 1)
    pos = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
    for layer in range(SHAPE.layers):
        base = mx.broadcast_to(tok * 1000 + pos, (1, SHAPE.kv_heads, n, SHAPE.head_dim))
        c = KVCache()
        # a cache with spare room, like mlx-lm's (it allocates 256 positions at a time)
        keys = mx.concatenate([base + layer, mx.zeros((1, SHAPE.kv_heads, 256, SHAPE.head_dim))], 2)
        values = mx.concatenate([-base - layer, mx.zeros_like(keys[:, :, :256])], 2)
        c.keys, c.values, c.offset = keys, values, n
        caches.append(c)
    return caches

def make_store(eviction: Eviction, blocks: int = 1000, ttl: float = 60.0,
               clock: Clock | None = None, hasher=hash_blocks) -> PrefixStore:
    return PrefixStore(SHAPE, BS, blocks * BS * SHAPE.bytes_per_token, ttl, clock or Clock(),
                       eviction, hasher=hasher)

def put(store: PrefixStore, tokens: list[int], ns: Namespace = NS) -> int:
    return store.write(ns, tokens, kv_for(tokens))


class TestBehaviour:
    def test_bytes_per_cached_token_is_exactly_theoretical(self, eviction):
        store = make_store(eviction)
        assert SHAPE.bytes_per_token == 2 * 2 * 2 * 8 * 4
        assert put(store, list(range(1, 19))) == 16  # 4 full blocks; the 2-token tail is not stored
        stats = store.stats()
        assert stats.ledger.tokens == 16
        assert stats.tensor_bytes == 16 * SHAPE.bytes_per_token

    def test_shared_prefix_is_stored_once(self, eviction):
        store = make_store(eviction)
        system = list(range(100, 140))  # 10 blocks
        for conv in range(100):
            put(store, system + [conv + 1, conv + 2, conv + 3, conv + 4])
        stats = store.stats()
        assert stats.ledger.blocks == 10 + 100
        assert stats.tensor_bytes == (10 + 100) * BS * SHAPE.bytes_per_token

    def test_hit_reuses_at_most_len_minus_one_and_returns_the_stored_kv(self, eviction):
        store = make_store(eviction)
        tokens = list(range(1, 13))  # 3 blocks exactly
        put(store, tokens)
        found = store.lookup(NS, tokens)
        assert found.report.outcome == LookupOutcome.HIT
        assert found.report.matched_tokens == 11
        expected = kv_for(tokens)
        for got, want in zip(found.cache, expected):
            assert got.offset == 11
            assert mx.array_equal(got.keys, want.keys[:, :, :11])
            assert mx.array_equal(got.values, want.values[:, :, :11])

    def test_outcomes_partial_near_miss_and_miss(self, eviction):
        store = make_store(eviction)
        put(store, list(range(1, 9)))                        # blocks [1..4] [5..8]
        longer = store.lookup(NS, list(range(1, 15))).report  # runs past what is stored
        assert (longer.outcome, longer.matched_tokens, longer.common_prefix) == (LookupOutcome.PARTIAL, 8, 8)
        assert longer.next_stored_token is None and longer.next_prompt_token == 9

        drift = store.lookup(NS, [1, 2, 3, 4, 5, 6, 99, 8, 9, 10]).report
        assert drift.outcome == LookupOutcome.NEAR_MISS
        assert (drift.matched_tokens, drift.common_prefix) == (4, 6)
        assert (drift.next_prompt_token, drift.next_stored_token) == (99, 7)
        assert drift.line() == "common=6 of 10"

        first_block = store.lookup(NS, [1, 2, 77, 4, 5]).report
        assert (first_block.outcome, first_block.matched_tokens, first_block.common_prefix) == (
            LookupOutcome.NEAR_MISS, 0, 2)

        none = store.lookup(NS, [50, 51, 52, 53, 54]).report
        assert (none.outcome, none.common_prefix, none.entry_age_s) == (LookupOutcome.MISS, 0, None)

    def test_namespaces_never_share(self, eviction):
        store = make_store(eviction)
        put(store, list(range(1, 9)))
        other = Namespace("tenant-b", "m", "r1")
        assert store.lookup(other, list(range(1, 9))).report.outcome == LookupOutcome.MISS
        assert store.lookup(Namespace("tenant-a", "m", "r2"), list(range(1, 9))).report.matched_tokens == 0

    def test_eviction_drops_tensors_and_emits_events(self, eviction):
        store = make_store(eviction, blocks=3)
        put(store, list(range(1, 9)))       # a0 a1
        put(store, list(range(20, 28)))     # b0 b1 -> evicts a1 (the LRU leaf) before a0
        stats = store.stats()
        assert stats.ledger.blocks == 3 and stats.ledger.evictions == 1
        assert stats.tensor_bytes == 3 * BS * SHAPE.bytes_per_token
        assert store.lookup(NS, list(range(1, 9))).report.matched_tokens == 4
        events = store.drain_events()
        assert [type(e) for e in events] == [BlockStored] * 3 + [BlockRemoved] + [BlockStored]
        a1 = hash_blocks(list(range(1, 9)), BS, NS)[1]
        assert events[3] == BlockRemoved(a1, NS.label())  # exactly a1, under either policy
        kinds = [e.kind for e in store.log()]
        assert LedgerEventKind.EVICTED in kinds and LedgerEventKind.HIT in kinds

    def test_ttl_expiry_with_injected_clock(self, eviction):
        clock = Clock()
        store = make_store(eviction, ttl=10, clock=clock)
        put(store, list(range(1, 9)))
        clock.now = 9
        assert store.lookup(NS, list(range(1, 10))).report.matched_tokens == 8
        clock.now = 18.9  # 9.9 s after the last use: still there
        assert store.lookup(NS, list(range(1, 10))).report.entry_age_s == pytest.approx(18.9)
        clock.now = 40
        report = store.lookup(NS, list(range(1, 10))).report
        assert report.outcome == LookupOutcome.MISS
        assert store.stats().ledger.expirations == 2 and store.stats().tensor_bytes == 0

    def test_invalidation_by_namespace_and_prefix(self, eviction):
        store = make_store(eviction)
        put(store, list(range(1, 13)))
        put(store, list(range(1, 5)) + [40, 41, 42, 43])
        other = Namespace("tenant-b", "m", "r1")
        put(store, list(range(1, 13)), ns=other)
        assert store.invalidate_prefix(NS, list(range(1, 9))) == 2  # [5..8] and [9..12] below it
        assert store.lookup(NS, list(range(1, 13))).report.matched_tokens == 4
        assert store.lookup(NS, list(range(1, 5)) + [40, 41, 42, 43, 44]).report.matched_tokens == 8
        assert store.invalidate_namespace(other) == 3
        with pytest.raises(ValueError, match="unknown namespace"):
            store.invalidate_namespace(other)
        assert store.stats().tensor_bytes == 2 * BS * SHAPE.bytes_per_token

    def test_capacity_exhaustion_stores_what_fits(self, eviction):
        store = make_store(eviction, blocks=2)
        assert put(store, list(range(1, 21))) == 8
        assert store.lookup(NS, list(range(1, 21))).report.outcome == LookupOutcome.PARTIAL

    def test_a_hash_collision_is_caught_by_the_token_check(self, eviction):
        from router.kv.key import BlockHash

        def colliding(tokens, block_size, namespace):  # every prompt's blocks hash alike
            return [BlockHash(1000 + i) for i in range(len(tokens) // block_size)]

        store = make_store(eviction, hasher=colliding)
        put(store, list(range(1, 13)))
        report = store.lookup(NS, list(range(1, 5)) + [60, 61, 62, 63, 64]).report
        assert report.matched_tokens == 4  # block 0 really matches; block 1 only by hash
        assert store.stats().identity_mismatches == 1

    def test_blocks_hold_their_own_slices_not_the_cache_buffer(self, eviction):
        import gc

        store = make_store(eviction)
        tokens = list(range(1, 4001))
        cache = kv_for(tokens)  # per layer: 4,256 positions allocated, 4,000 used
        mx.eval([c.keys for c in cache], [c.values for c in cache])
        gc.collect()
        before = mx.get_active_memory()
        store.write(NS, tokens, cache)
        gc.collect()
        grown = mx.get_active_memory() - before
        assert store.stats().tensor_bytes == 4000 * SHAPE.bytes_per_token
        assert grown <= 1.1 * store.stats().tensor_bytes  # real memory, not only the bookkeeping


A = list(range(1, 9))  # two blocks

OTHER = Namespace("tenant-b", "m", "r1")


class TestExact:
    def test_a_block_size_of_zero_and_heads_that_cannot_be_quantized_are_refused_word_for_word(self):
        with pytest.raises(ValueError) as zero:
            PrefixStore(SHAPE, 0, 1 << 20, 60.0, Clock())
        assert str(zero.value) == "block_size must be positive, got 0"
        with pytest.raises(ValueError) as heads:
            PrefixStore(SHAPE, BS, 1 << 20, 60.0, Clock(), kv_bits=8)
        assert str(heads.value) == ("8-bit K/V needs head_dim divisible by 64, this model has "
                                    "head_dim 8: set the tier's kv bits to 0")

    def test_the_store_keeps_its_eviction_policy(self):
        assert make_store(Eviction.REUSE).ledger.policy is Eviction.REUSE
        assert make_store(Eviction.LRU).ledger.policy is Eviction.LRU

    def test_a_store_without_a_disk_tier_answers_every_call_for_memory_alone(self):
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

    def test_write_takes_only_the_full_blocks_the_cache_holds(self):
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

    def test_every_refused_hit_is_counted(self):
        from router.kv.key import BlockHash

        def colliding(tokens, block_size, namespace):  # every prompt's blocks hash alike
            return [BlockHash(1000 + i) for i in range(len(tokens) // block_size)]

        store = make_store(Eviction.LRU, hasher=colliding)
        put(store, A)
        for _ in range(2):
            assert store.lookup(NS, [1, 2, 3, 4, 60, 61, 62, 63, 64]).report.matched_tokens == 4
        assert store.stats().identity_mismatches == 2

    def test_a_near_miss_at_the_first_token_of_a_block_names_both_tokens(self):
        store = make_store(Eviction.LRU)
        put(store, A)
        report = store.lookup(NS, [1, 2, 3, 4, 50, 51, 52, 53, 54]).report
        assert report.outcome == LookupOutcome.NEAR_MISS
        assert (report.common_prefix, report.next_prompt_token, report.next_stored_token) == (4, 50, 5)

    def test_an_unknown_namespace_is_refused_naming_those_held(self):
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
