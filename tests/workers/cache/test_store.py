"""PrefixStore with real tensors: exact bytes, dedup, outcomes, near misses, TTL, invalidation.

The prefix store with one tier (memory), exactly: refusals word for word, the figures it
reports, what ``write`` takes from a cache that holds less than the tokens, the closest
stored block at a near miss, and every call that also serves a disk tier; then the store
over a disk tier, exactly (``TestStoreTiersExact``).
"""
from __future__ import annotations

import logging
import os

import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from router.kv.events import BlockRemoved, BlockStored, Tier
from router.kv.key import BlockHash, BlockIdentity, ChainIdentities, Namespace, hash_blocks
from router.kv.ledger import Eviction, LedgerEventKind
from workers.messages import LookupOutcome
from workers.cache.blocks import KVShape
from workers.cache.store import PrefixStore
from tests.conftest import Clock
from tests.support.prefix_stores import (B, BLOCK_BYTES, BS, NS, SHAPE, TTL, WALL_START, WIDE,
                                         WIDE_BS, WIDE_TOKENS, every_policy,  # noqa: F401
                                         ha, kv_for, put, random_cache, spilled_a, tiered)
from workers.cache.disk_files import BlockRecord, block_path, encode_block
from workers.cache.open_store import open_store


def make_store(eviction: Eviction, blocks: int = 1000, ttl: float = 60.0,
               clock: Clock | None = None, hasher=hash_blocks) -> PrefixStore:
    return PrefixStore(SHAPE, BS, blocks * BS * SHAPE.bytes_per_token, ttl, clock or Clock(),
                       eviction, hasher=hasher)


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


@pytest.mark.usefixtures("bounded", "every_policy")  # the disk tier waits on its threads
class TestStoreTiersExact:
    """The prefix store over a disk tier, exactly: prefetch, promotion back into memory
    (events, counts, what a later spill and restart keep), precision changes between tiers,
    the closest stored block across tiers, ages and invalidation over both."""

    def test_prefetch_starts_the_reads_of_the_blocks_only_the_disk_holds(self, tmp_path):
        store = spilled_a(tmp_path)
        assert store.stats().disk.prefetched == 0
        assert store.prefetch(NS, A + [9]) == 2
        assert store.stats().disk.prefetched == 2
        assert store.prefetch(NS, A + [9]) == 2  # still on disk, already being read
        assert store.stats().disk.prefetched == 2
        assert store.lookup(NS, A + [9]).report.disk_tokens == 8
        assert store.stats().disk.prefetched == 2  # the lookup started no read of its own
        store.close()

    def test_promoted_blocks_are_announced_counted_and_kept_by_a_restart(self, tmp_path):
        store = tiered(tmp_path / "w0", mem_blocks=2, disk_blocks=2)
        put(store, A)
        put(store, B)  # A to disk
        store.flush()
        store.drain_events()
        a0, a1 = ha()
        b0, b1 = hash_blocks(B, BS, NS)
        assert store.lookup(NS, A + [9]).report.disk_tokens == 8  # A back in memory, B to disk
        stored = [e for e in store.drain_events() if isinstance(e, BlockStored)]
        assert stored == [BlockStored(a0, NS.root(), BS, NS.label()), BlockStored(a1, a0, BS, NS.label()),
                          BlockStored(b1, b0, BS, NS.label(), Tier.DISK),
                          BlockStored(b0, NS.root(), BS, NS.label(), Tier.DISK)]
        assert store.lookup(NS, B + [9]).report.disk_tokens == 8  # and back again
        assert store.written_blocks() == 4  # computed here: A and B once; 4 more were promoted
        assert store.stats().ledger.stored_blocks == 8
        store.close()  # B, promoted, is written from memory: its parent and namespace as read
        again = tiered(tmp_path / "w0", mem_blocks=2, disk_blocks=2)
        assert again.drain_events() == [BlockStored(b1, b0, BS, NS.label(), Tier.DISK),
                                        BlockStored(b0, NS.root(), BS, NS.label(), Tier.DISK)]
        again.close()

    def test_a_block_promoted_from_a_4_bit_disk_is_held_at_memory_precision(self, tmp_path):
        from tests.support.prefix_stores import WIDE, WIDE_BS, WIDE_TOKENS as TOKENS, random_cache

        store = open_store(WIDE, WIDE_BS, 60.0, lambda: 0.0, memory_bytes=2 * WIDE_BS * 2048,
                           disk_dir=tmp_path / "w", disk_bytes=1 << 20, disk_kv_bits=4,
                           model="m", revision="r1")
        cache = random_cache(32)
        store.write(NS, TOKENS, cache)
        store.write(NS, list(range(100, 132)), random_cache(32))  # TOKENS spilled, as 4-bit
        store.flush()
        assert store.lookup(NS, TOKENS + [99]).report.disk_tokens == 32  # promoted
        assert store.stats().tensor_bytes == 32 * 2048  # float32 again: 2 x 2 x 2 x 64 x 4 bytes
        found = store.lookup(NS, TOKENS + [99])  # from memory now
        assert (found.report.matched_tokens, found.report.disk_tokens) == (32, 0)
        for layer in range(WIDE.layers):
            for got, want in ((found.cache[layer].keys, cache[layer].keys),
                              (found.cache[layer].values, cache[layer].values)):
                err = mx.abs(got[:, :, :32] - want[:, :, :32]).max().item()
                assert 0 < err < 0.5  # within 4-bit steps of the original
        store.close()

    def test_the_closest_stored_block_is_looked_for_in_both_tiers_memory_first(self, tmp_path):
        store = tiered(tmp_path / "w0", mem_blocks=2)
        put(store, A)
        put(store, B)  # A's two blocks to disk
        report = store.lookup(NS, [1, 2, 3, 4, 5, 6, 0, 0, 9]).report  # a0 read back; a1 on disk
        assert (report.outcome, report.common_prefix, report.next_stored_token) == (
            LookupOutcome.NEAR_MISS, 6, 7)
        put(store, [1, 2, 3, 4, 5, 6, 9, 9])  # a sibling of a1, in memory
        report = store.lookup(NS, [1, 2, 3, 4, 5, 6, 0, 0, 9]).report  # a tie: 2 tokens each
        assert (report.common_prefix, report.next_stored_token) == (6, 9)
        store.close()

    def test_a_hit_ending_in_a_block_memory_could_not_take_is_aged_on_disk(self, tmp_path):
        c = list(range(1, 13))  # three blocks
        first = tiered(tmp_path / "w0", mem_blocks=10)
        put(first, c)
        first.close()
        for h in hash_blocks(c, BS, NS):  # last used 10 s before the restart
            os.utime(block_path(tmp_path / "w0", h), (WALL_START - 10, WALL_START - 10))
        store = tiered(tmp_path / "w0", mem_blocks=2)
        report = store.lookup(NS, c + [13]).report
        assert (report.matched_tokens, report.disk_tokens, report.entry_age_s) == (12, 12, 10.0)
        assert [h.block for h in store.ledger.holdings()] == hash_blocks(c, BS, NS)[:2]
        store.close()

    def test_namespaces_and_invalidation_cover_both_tiers(self, tmp_path):
        store = tiered(tmp_path / "w0", mem_blocks=2)
        put(store, A, OTHER)
        put(store, B)  # OTHER's blocks to disk
        assert store.namespaces() == sorted([NS.label(), OTHER.label()])
        assert store.invalidate_namespace(OTHER.label()) == 2  # held on disk only
        assert store.namespaces() == [NS.label()]
        put(store, A)  # B to disk as well
        assert store.lookup(NS, A + [9]).report.disk_tokens == 0
        assert store.lookup(NS, B + [9]).report.disk_tokens == 8  # B in both tiers now
        assert store.invalidate_prefix(NS, B) == 2  # b1 in memory and b1 on disk
        store.close()

    def test_blocks_whose_parents_loop_are_dropped_at_restart_as_torn(self, tmp_path):
        directory = tmp_path / "w0"
        tiered(directory).close()  # the directory, empty
        kv = kv_for([1, 2, 3, 4])
        keys = (mx.stack([c.keys[0, :, :4] for c in kv]),)
        values = (mx.stack([c.values[0, :, :4] for c in kv]),)
        loop = {11: 12, 12: 11, 13: 12, 14: NS.root()}  # 11 and 12 loop; 13 hangs off the loop
        for block, parent in loop.items():
            record = BlockRecord(block, BlockIdentity(NS.label(), parent, 0, (1, 2, 3, 4)), "m", "r1", 0)
            path = block_path(directory, block)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode_block(record, keys, values))
        store = tiered(directory)
        start = store.stats().disk.start
        assert (start.restored, start.torn) == (1, 3)
        assert [h.block for h in store.holdings()] == [14]
        assert sorted(p.name for p in directory.glob("*/*.kv")) == [block_path(directory, 14).name]
        store.close()

    def test_a_block_spilled_as_its_own_ancestor_is_refused(self, tmp_path):
        from workers.cache.disk_tier import DiskTier
        from workers.cache.kv_quant import KVCodec

        tier = DiskTier(tmp_path / "w0", 100 * BLOCK_BYTES, TTL, Clock(), KVCodec(0, mx.float32),
                        SHAPE.bytes_per_token, "m", "r1")
        kv = kv_for([1, 2, 3, 4])
        keys = (mx.stack([c.keys[0, :, :4] for c in kv]),)
        values = (mx.stack([c.values[0, :, :4] for c in kv]),)
        mx.eval(keys, values)

        def spill(block: int, parent: int) -> bool:
            identity = BlockIdentity(NS.label(), parent, 0, (1, 2, 3, 4))
            return tier.spill(BlockRecord(block, identity, "m", "r1", 0), keys, values)

        assert spill(21, 22)  # its parent is not held here: taken
        for block, parent in ((22, 21), (23, 23)):  # 22 -> 21 -> 22; 23 -> 23
            with pytest.raises(RuntimeError) as info:
                spill(block, parent)
            assert str(info.value) == (f"disk tier {tmp_path / 'w0'}: block {block:032x} would be "
                                       "its own ancestor (a broken hash chain); it was not spilled")
        assert [h.block for h in tier.ledger.holdings()] == [21]
        tier.close()


class TestServedAndAdopted:
    """What a store serves a peer (``served``: blocks ``start`` to ``stop``, each verified, from
    either tier) and what it keeps of a peer's (``adopt``), exactly."""

    TOKENS = list(range(1, 17))  # four blocks

    def test_served_are_the_blocks_between_start_and_stop_with_their_identity_and_kv(self, eviction):
        store = make_store(eviction)
        put(store, self.TOKENS)
        want = ChainIdentities(NS, hash_blocks(self.TOKENS, BS, NS), self.TOKENS, BS)
        served = store.served(NS, self.TOKENS, 1, 3)
        assert [(block.identity, codec) for block, codec in served] == [
            (want[1], store.codec), (want[2], store.codec)]
        keys, values = served[0][0].keys[0], served[1][0].values[0]  # [layers, heads, bs, dim]
        assert keys.shape == (2, 2, 4, 8)
        assert float(keys[0, 0, 0, 0]) == 5 * 1000 + 4          # token 5 at position 4
        assert float(values[1, 0, 3, 0]) == -(12 * 1000 + 11) - 1  # token 12, position 11, layer 1

    def test_serving_stops_at_the_first_block_the_store_lacks(self, eviction):
        store = make_store(eviction)
        put(store, self.TOKENS)
        assert len(store.served(NS, self.TOKENS + list(range(50, 58)), 0, 6)) == 4
        assert store.served(OTHER, self.TOKENS, 0, 4) == []  # another tenant's chain

    @pytest.mark.usefixtures("bounded", "every_policy")
    def test_a_block_only_the_disk_holds_is_served_in_the_disk_tiers_codec(self, tmp_path):
        store = spilled_a(tmp_path)
        want = ChainIdentities(NS, ha(), A, BS)
        served = store.served(NS, A, 0, 2)
        assert [(block.identity, codec) for block, codec in served] == [
            (want[0], store.disk.codec), (want[1], store.disk.codec)]
        first = served[0][0]
        assert float(first.keys[0][0, 0, 0, 0]) == 1 * 1000 + 0       # token 1 at position 0
        assert float(first.values[0][1, 0, 3, 0]) == -(4 * 1000 + 3) - 1  # token 4, layer 1
        store.close()

    def test_adopted_blocks_are_stored_read_not_written_and_then_hit(self, eviction):
        source, receiver = make_store(eviction), make_store(eviction)
        put(source, self.TOKENS)
        blocks = [block for block, _ in source.served(NS, self.TOKENS, 0, 4)]
        chain = hash_blocks(self.TOKENS, BS, NS)
        assert receiver.adopt(NS, chain, 2, blocks[2:], source.codec) == 0  # lacks the head
        assert receiver.adopt(NS, chain, 0, blocks, source.codec) == 4
        assert (receiver.written_blocks(), receiver.stats().ledger.blocks) == (0, 4)
        assert receiver.lookup(NS, self.TOKENS + [99]).report.matched_tokens == 16

    def test_a_4_bit_disk_serves_its_blocks_in_its_own_codec(self, tmp_path):
        store = open_store(WIDE, WIDE_BS, 60.0, lambda: 0.0, memory_bytes=2 * WIDE_BS * 2048,
                           disk_dir=tmp_path / "w", disk_bytes=1 << 20, disk_kv_bits=4,
                           model="m", revision="r1")
        store.write(NS, WIDE_TOKENS, random_cache(32))
        store.write(NS, list(range(100, 132)), random_cache(32))  # WIDE_TOKENS spilled, 4-bit
        store.flush()
        served = store.served(NS, WIDE_TOKENS, 0, 2)
        assert [codec for _, codec in served] == [store.disk.codec] * 2
        assert (store.disk.codec.bits, store.codec.bits) == (4, 0)
        store.close()

    def test_blocks_after_a_head_already_held_are_adopted_after_it(self, eviction):
        source, receiver = make_store(eviction), make_store(eviction)
        put(source, self.TOKENS)
        put(receiver, self.TOKENS[:8])
        blocks = [block for block, _ in source.served(NS, self.TOKENS, 2, 4)]
        assert receiver.adopt(NS, hash_blocks(self.TOKENS, BS, NS), 2, blocks, source.codec) == 2
        assert receiver.lookup(NS, self.TOKENS + [99]).report.matched_tokens == 16

    def test_a_full_memory_adopts_what_fits(self, eviction):
        source, small = make_store(eviction), make_store(eviction, blocks=2)
        put(source, self.TOKENS)
        blocks = [block for block, _ in source.served(NS, self.TOKENS, 0, 4)]
        assert small.adopt(NS, hash_blocks(self.TOKENS, BS, NS), 0, blocks, source.codec) == 2


class TestAnIdentityMismatch:
    """A block refused for its identity (``mismatch``): counted each time, logged once per
    block, word for word, for at most 64 blocks."""

    WANT = BlockIdentity("tenant-a/m/r1", BlockHash(0xA), 1, (1, 2, 3, 4))

    def test_it_is_counted_every_time_and_logged_once_saying_what_differs(self, caplog):
        store = make_store(Eviction.LRU)
        held = BlockIdentity("tenant-b/m/r1", BlockHash(0xB), 2, (1, 2, 3, 4))
        with caplog.at_level(logging.WARNING, logger="workers.cache.store"):
            store.mismatch(BlockHash(0x5), self.WANT, held)
            store.mismatch(BlockHash(0x5), self.WANT, held)
        assert store.stats().identity_mismatches == 2
        assert [r.getMessage() for r in caplog.records] == [
            f"cache identity mismatch at block {0x5:032x}: the lookup wants namespace "
            f"tenant-a/m/r1, parent {0xA:032x}, position 1; the store holds namespace "
            f"tenant-b/m/r1, parent {0xB:032x}, position 2: served as a miss"]

    def test_other_tokens_are_named(self, caplog):
        store = make_store(Eviction.LRU)
        held = BlockIdentity("tenant-a/m/r1", BlockHash(0xA), 1, (9, 9, 9, 9))
        with caplog.at_level(logging.WARNING, logger="workers.cache.store"):
            store.mismatch(BlockHash(0x5), self.WANT, held)
        assert caplog.records[0].getMessage().endswith(
            "position 1, other tokens: served as a miss")

    def test_64_blocks_are_logged_and_no_more(self, caplog):
        store = make_store(Eviction.LRU)
        held = BlockIdentity("tenant-b/m/r1", BlockHash(0xB), 1, (1, 2, 3, 4))
        with caplog.at_level(logging.WARNING, logger="workers.cache.store"):
            for block in range(65):
                store.mismatch(BlockHash(block), self.WANT, held)
        assert len(caplog.records) == 64
        assert store.stats().identity_mismatches == 65


class TestAWritesTtl:
    def test_a_block_written_for_an_hour_outlives_the_stores_ttl(self, eviction):
        clock = Clock()
        store = make_store(eviction, ttl=60.0, clock=clock)
        hour, default = list(range(1, 9)), list(range(101, 109))
        store.write(NS, hour, kv_for(hour), ttl_s=3600.0)
        put(store, default)
        clock.now = 61.0
        assert store.lookup(NS, hour + [99]).report.matched_tokens == 8
        assert store.lookup(NS, default + [99]).report.matched_tokens == 0
