"""PrefixIndex: events in, per-worker matched depth out; pending, churn, bounds, rebuild.

PrefixIndex at its edges: exact counters, staleness, retired slots, the disk tier, bounds.

Each test pins an exact value that a one-token slip in ``router/index.py`` changes: a sequence
rule off by one, a counter assigned instead of added, a removed worker's bit brought back, a
pending entry dropped for every worker when one confirms it, the size of a drop batch, the
block a full index forgets first.
"""
from __future__ import annotations

from router.kv.events import BlockRemoved, BlockStored, EventBatch
from router.index import PrefixIndex
from router.kv.key import BlockHash
import re
import pytest
from router.kv.events import BlockRemoved, BlockStored, EventBatch, Tier
from router.index import DEFAULT_INDEX_BYTES, Match, PrefixIndex


ROOT = BlockHash(1)

def chain(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]

def stored(worker: str, seq: int, blocks: list[BlockHash]) -> EventBatch:
    parents = [ROOT] + blocks[:-1]
    return EventBatch(worker, seq, tuple(BlockStored(b, p, 16, "ns")
                                         for b, p in zip(blocks, parents)))

def removed(worker: str, seq: int, blocks: list[BlockHash]) -> EventBatch:
    return EventBatch(worker, seq, tuple(BlockRemoved(b, "ns") for b in blocks))

def index(*workers: str, max_blocks: int | None = None, **kw) -> PrefixIndex:
    """An index of ``workers``; ``max_blocks``: a budget that holds exactly that many blocks."""
    if max_blocks is not None:
        kw["max_bytes"] = PrefixIndex.bytes_for(max_blocks)
    idx = PrefixIndex(**kw)
    assert max_blocks is None or idx.max_blocks == max_blocks
    for w in workers:
        idx.add_worker(w)
    return idx


class TestBehaviour:
    def test_match_reports_each_workers_leading_blocks(self):
        idx = index("a", "b", "c")
        idx.apply(stored("a", 0, chain(10, 11, 12, 13)))
        idx.apply(stored("b", 0, chain(10, 11)))
        idx.apply(stored("c", 0, chain(20, 21)))
        assert idx.match(chain(10, 11, 12, 13, 14), now=0).blocks == {"a": 4, "b": 2}
        assert idx.match(chain(10, 11, 99), now=0).blocks == {"a": 2, "b": 2}
        assert idx.match(chain(99, 10), now=0).blocks == {}
        assert idx.match([], now=0).blocks == {}

    def test_bisection_agrees_with_a_linear_walk_on_long_chains(self):
        idx = index(*[f"w{i}" for i in range(8)])
        long = chain(*range(100, 400))
        for i in range(8):
            idx.apply(stored(f"w{i}", 0, long[: 37 * i + 1]))
        got = idx.match(long, now=0).blocks
        assert got == {f"w{i}": 37 * i + 1 for i in range(8)}

    def test_removed_events_shrink_what_a_worker_holds(self):
        idx = index("a")
        idx.apply(stored("a", 0, chain(10, 11, 12)))
        idx.apply(removed("a", 1, chain(12)))
        assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 2}
        assert idx.blocks_held("a") == 2

    def test_pending_entries_steer_siblings_then_expire_or_get_confirmed(self):
        idx = index("a", "b", pending_ttl_s=5.0)
        idx.note_routed("b", chain(30, 31), now=0.0)
        assert idx.match(chain(30, 31, 32), now=1.0).blocks == {"b": 2}
        assert idx.match(chain(30, 31), now=5.0).blocks == {}  # expired, never confirmed
        assert idx.counters().pending_expired == 2
        idx.note_routed("a", chain(40), now=10.0)
        idx.apply(stored("a", 0, chain(40)))  # confirmed: now held, no longer pending
        assert idx.match(chain(40), now=100.0).blocks == {"a": 1}
        assert idx.counters().pending_expired == 2

    def test_pending_covers_a_bounded_window_past_what_is_held(self):
        idx = index("a", pending_blocks=2)
        idx.apply(stored("a", 0, chain(1, 2)))
        idx.note_routed("a", chain(1, 2, 3, 4, 5, 6), now=0.0, held_blocks=2)
        assert idx.match(chain(1, 2, 3, 4, 5, 6), now=0.0).blocks == {"a": 4}

    def test_removing_a_worker_forgets_its_blocks_at_once(self):
        idx = index("a", "b")
        idx.apply(stored("a", 0, chain(10, 11)))
        idx.apply(stored("b", 0, chain(10)))
        idx.note_routed("a", chain(10, 11, 12), now=0.0)
        idx.remove_worker("a")
        assert idx.match(chain(10, 11, 12), now=0.0).blocks == {"b": 1}
        idx.add_worker("a")  # back under the same name: starts empty
        assert idx.match(chain(10, 11), now=0.0).blocks == {"b": 1}
        assert idx.blocks_held("a") == 0

    def test_unknown_workers_and_never_stored_removals_are_counted_not_raised(self):
        idx = index("a")
        idx.apply(stored("ghost", 0, chain(10, 11)))
        idx.apply(removed("a", 0, chain(77)))
        counters = idx.counters()
        assert counters.unknown_worker_events == 2
        assert counters.unknown_block_removals == 1
        assert len(idx) == 0

    def test_a_sequence_gap_marks_the_worker_stale_until_rebuilt(self):
        idx = index("a")
        idx.apply(stored("a", 0, chain(10)))
        idx.apply(stored("a", 2, chain(10, 11)))  # batch 1 was lost
        assert idx.stale_workers() == ["a"]
        idx.rebuild("a", chain(10, 11, 12))
        assert idx.stale_workers() == []
        assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 3}
        idx.rebuild("a", chain(10))
        assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 1}
        assert idx.blocks_held("a") == 1

    def test_a_lost_last_batch_marked_as_a_gap_is_stale_until_rebuilt_and_counted_once(self):
        idx = index("a")
        idx.apply(stored("a", 0, chain(10)))
        idx.mark_gap("a", 2)                       # batches 1 and 2 were lost
        assert (idx.stale_workers(), idx.counters().sequence_gaps) == (["a"], 1)
        idx.apply(stored("a", 3, chain(10, 11)))   # the next batch: no second gap
        assert (idx.stale_workers(), idx.counters().sequence_gaps) == (["a"], 1)
        idx.rebuild("a", chain(10, 11))
        assert idx.stale_workers() == []
        with pytest.raises(ValueError):
            idx.mark_gap("ghost", 1)

    def test_memory_is_bounded_by_dropping_the_least_recently_used_entries(self):
        idx = index("a", max_blocks=100)
        for seq in range(30):
            idx.apply(stored("a", seq, chain(*range(10 * seq + 1000, 10 * seq + 1010))))
        assert len(idx) <= 100
        assert idx.counters().dropped == 300 - len(idx)
        assert idx.blocks_held("a") == len(idx)
        newest = chain(*range(1290, 1300))
        assert idx.match(newest, now=0).blocks == {"a": 10}

    def test_a_replayed_or_out_of_order_batch_is_a_gap(self):
        idx = index("a", "b")
        idx.apply(stored("a", 0, chain(10)))
        idx.apply(stored("a", 1, chain(10, 11)))
        idx.apply(stored("a", 1, chain(10, 11)))   # batch 1 again: replayed
        assert (idx.stale_workers(), idx.counters().sequence_gaps) == (["a"], 1)
        idx.apply(stored("b", 5, chain(20)))
        idx.apply(stored("b", 4, chain(20, 21)))   # an older batch after a newer one
        assert (idx.stale_workers(), idx.counters().sequence_gaps) == (["a", "b"], 2)
        idx.rebuild("a", chain(10, 11))
        idx.apply(stored("a", 0, chain(10, 11, 12)))  # the rebuild restarts the sequence
        assert (idx.stale_workers(), idx.counters().sequence_gaps) == (["b"], 2)


def disk_stored(worker: str, seq: int, blocks: list[BlockHash]) -> EventBatch:
    return EventBatch(worker, seq, tuple(BlockStored(b, BlockHash(1), 16, "ns", Tier.DISK)
                                         for b in blocks))


class TestEdges:
    def test_constructor_bounds_and_unknown_worker_messages(self):
        with pytest.raises(ValueError, match=re.escape(
                "max_bytes must hold at least one block (22 bytes), got 21")):
            PrefixIndex(max_bytes=21)
        with pytest.raises(ValueError, match=re.escape("pending_ttl_s must be >= 0 seconds, got -1")):
            PrefixIndex(pending_ttl_s=-1)
        idx = PrefixIndex(max_bytes=22, pending_ttl_s=0.5)
        assert idx.max_blocks == 1 and PrefixIndex.bytes_for(1) == 22
        with pytest.raises(ValueError, match="unknown worker 'x': known workers are none"):
            idx.blocks_held("x")
        idx.add_worker("b")
        idx.add_worker("a")
        with pytest.raises(ValueError, match="unknown worker 'x': known workers are a, b"):
            idx.remove_worker("x")
        with pytest.raises(ValueError, match="worker 'a' is already in the index; remove it first"):
            idx.add_worker("a")
        assert idx.workers() == ["b", "a"]

    def test_counters_add_up_over_batches(self):
        idx = index("a", "b")
        idx.apply(stored("ghost", 0, chain(10, 11)))
        idx.apply(stored("ghost", 1, chain(12)))
        idx.apply(removed("a", 0, chain(77)))
        idx.apply(removed("a", 1, chain(78)))
        for seq in (2, 3, 5, 6, 9):  # consecutive batches are no gap; 3 -> 5 and 6 -> 9 are
            idx.apply(stored("b", seq, chain(10)))
        c = idx.counters()
        assert (c.unknown_worker_events, c.unknown_block_removals, c.sequence_gaps,
                c.dropped, c.pending_expired) == (3, 2, 2, 0, 0)
        assert PrefixIndex().counters().sequence_gaps == 0

    def test_a_worker_added_again_starts_a_fresh_sequence_and_is_not_stale(self):
        idx = index("a")
        idx.apply(stored("a", 4, chain(10)))
        idx.apply(stored("a", 6, chain(11)))   # a gap: stale
        idx.remove_worker("a")
        idx.add_worker("a")
        assert idx.stale_workers() == [] and idx.blocks_held("a") == 0
        idx.apply(stored("a", 0, chain(10)))   # a new process counts from 0
        assert idx.counters().sequence_gaps == 1 and idx.stale_workers() == []
        assert idx.match(chain(10, 11), now=0) == Match({"a": 1})

    def test_rebuild_replaces_only_that_workers_blocks_and_restarts_its_sequence(self):
        idx = index("a", "b")
        idx.apply(stored("a", 0, chain(10, 11)))
        idx.apply(stored("b", 0, chain(10, 11, 12)))
        idx.apply(stored("b", 3, chain(13)))          # a gap: b is stale
        idx.rebuild("b", chain(10, 20))
        assert idx.counters().unknown_block_removals == 0
        assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 2, "b": 1}
        assert (idx.blocks_held("a"), idx.blocks_held("b")) == (2, 2)
        idx.apply(stored("b", 0, chain(21)))          # after a rebuild any sequence starts anew
        assert idx.counters().sequence_gaps == 1 and idx.stale_workers() == []

    def test_removals_by_one_holder_leave_the_others(self):
        idx = index("a", "b", "c")
        idx.apply(stored("a", 0, chain(10, 11)))
        idx.apply(stored("b", 0, chain(10, 11)))
        idx.apply(removed("b", 1, chain(11)))
        assert idx.holders(BlockHash(11)) == ["a"] and idx.holders(BlockHash(10)) == ["a", "b"]
        assert idx.match(chain(10, 11), now=0).blocks == {"a": 2, "b": 1}
        assert (idx.blocks_held("a"), idx.blocks_held("b")) == (2, 1)

    def test_pending_entries_of_two_workers_on_one_block_are_kept_apart(self):
        idx = index("a", "b", pending_ttl_s=1)
        idx.note_routed("a", chain(10, 11), now=0)
        idx.note_routed("b", chain(10, 11), now=0.5)
        idx.apply(stored("a", 0, chain(10)))   # a confirms block 10: b's pending entry stays
        assert idx.match(chain(10, 11), now=0.9).blocks == {"a": 2, "b": 2}
        assert idx.match(chain(10, 11), now=1.0).blocks == {"a": 1, "b": 2}  # a's 11 expired
        assert idx.counters().pending_expired == 1
        assert idx.match(chain(10, 11), now=1.5).blocks == {"a": 1}
        assert idx.counters().pending_expired == 3

    def test_a_zero_pending_ttl_notes_nothing(self):
        idx = index("a", pending_ttl_s=0)
        idx.note_routed("a", chain(10, 11), now=0)
        assert idx.match(chain(10, 11), now=0).blocks == {}

    def test_the_disk_tier_counts_as_held_and_is_reported_apart(self):
        idx = index("a", "b")
        idx.apply(stored("a", 0, chain(10, 11)))
        idx.apply(disk_stored("a", 1, chain(12, 13)))
        idx.apply(disk_stored("b", 0, chain(10)))
        assert idx.holders(BlockHash(12)) == ["a"]
        assert idx.match(chain(10, 11, 12, 13, 14), now=0) == Match({"a": 4, "b": 1},
                                                                      {"a": 2, "b": 1})
        assert idx.match(chain(10, 11), now=0) == Match({"a": 2, "b": 1}, {"b": 1})
        assert idx.blocks_held("a") == 2   # memory blocks only
        idx.apply(EventBatch("a", 2, (BlockRemoved(BlockHash(13), "ns", Tier.DISK),)))
        assert idx.match(chain(10, 11, 12, 13), now=0).blocks == {"a": 3, "b": 1}

    def test_bisection_finds_every_depth_on_a_long_chain(self):
        idx = index("a", "b", "c")
        blocks = chain(*range(100, 137))
        idx.apply(stored("a", 0, blocks))
        idx.apply(stored("b", 0, blocks[:23]))
        idx.apply(stored("c", 0, blocks[:1]))
        assert idx.match(blocks, now=0).blocks == {"a": 37, "b": 23, "c": 1}
        assert idx.match(blocks[:2], now=0).blocks == {"a": 2, "b": 2, "c": 1}

    def test_drops_come_in_batches_of_one_percent_at_least_one(self):
        small = index("a", max_blocks=10)
        small.apply(stored("a", 0, chain(*range(100, 111))))
        assert (len(small), small.counters().dropped) == (10, 1)  # full at the 11th: 1 goes
        big = index("a", max_blocks=300)
        big.apply(stored("a", 0, chain(*range(1000, 1301))))
        assert (len(big), big.counters().dropped) == (298, 3)    # full at the 301st: 3 go
        assert big.blocks_held("a") == 298
        assert big.match(chain(1002, 1003), now=0).blocks == {}  # 1000 to 1002, the oldest
        assert big.match(chain(1003, 1004), now=0).blocks == {"a": 2}

    def test_exactly_max_blocks_drops_nothing(self):
        idx = index("a", max_blocks=4)
        idx.apply(stored("a", 0, chain(10, 11, 12, 13)))
        assert (len(idx), idx.counters().dropped) == (4, 0)

    def test_drops_count_down_each_live_holder_and_skip_removed_workers(self):
        idx = index("a", "b", "c", "d", max_blocks=4)
        idx.apply(stored("a", 0, chain(10)))
        idx.apply(stored("b", 0, chain(10)))
        idx.apply(stored("c", 0, chain(10)))
        idx.apply(stored("c", 1, chain(11)))
        idx.remove_worker("a")
        idx.apply(stored("d", 0, chain(20, 21, 22)))  # full at 22: 10 goes, the least recent
        assert idx.counters().dropped == 1
        assert [idx.blocks_held(w) for w in ("b", "c", "d")] == [0, 1, 3]
        assert idx.holders(BlockHash(10)) == [] and idx.holders(BlockHash(11)) == ["c"]
        assert idx.holders(BlockHash(20)) == ["d"]

    def test_one_budget_for_both_tiers_and_disk_drops_leave_the_memory_counts_alone(self):
        idx = index("a", max_blocks=3)
        idx.apply(disk_stored("a", 0, chain(20, 21)))
        idx.apply(stored("a", 1, chain(10, 11, 12)))  # full at 11 and at 12: 20, then 21 go
        assert idx.counters().dropped == 2 and idx.blocks_held("a") == 3
        assert idx.holders(BlockHash(21)) == [] and idx.holders(BlockHash(10)) == ["a"]
        idx.apply(stored("a", 2, chain(13)))  # memory blocks go too: 10 is the least recent
        assert idx.counters().dropped == 3 and idx.blocks_held("a") == 3

    def test_a_rebuild_leaves_blocks_the_worker_never_held(self):
        idx = index("a", "b")
        idx.apply(stored("a", 0, chain(30)))
        idx.apply(stored("b", 0, chain(10)))
        idx.rebuild("b", chain(10))
        assert idx.counters().unknown_block_removals == 0 and idx.holders(BlockHash(30)) == ["a"]

    def test_nothing_to_note_and_a_silent_worker_are_no_errors(self):
        idx = index("a")
        idx.note_routed("ghost", chain(10), now=0, held_blocks=1)  # nothing past what is held
        idx.remove_worker("a")                                      # never sent a batch
        assert idx.workers() == []

    def test_two_removed_workers_both_stay_forgotten(self):
        idx = index("a", "b", "c", max_blocks=2)
        idx.apply(stored("a", 0, chain(10)))
        idx.apply(stored("b", 0, chain(10)))
        idx.apply(stored("c", 0, chain(10)))
        idx.remove_worker("a")
        idx.remove_worker("b")                       # a's slot must not come back
        assert idx.holders(BlockHash(10)) == ["c"]
        idx.apply(stored("c", 1, chain(20, 21)))     # full at 21: 10 goes
        assert idx.counters().dropped == 1 and idx.blocks_held("c") == 2
        assert idx.holders(BlockHash(10)) == []

    def test_a_match_keeps_what_it_looks_at_and_the_unused_go_first(self):
        idx = index("a", max_blocks=10)
        idx.apply(stored("a", 0, chain(10, 11, 12)))
        idx.apply(stored("a", 1, chain(20, 21, 22)))
        assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 3}  # 10, 11, 12 used again
        idx.apply(stored("a", 2, chain(30, 31, 32, 33)))                # full: 10 blocks
        idx.apply(stored("a", 3, chain(40, 41)))                        # 20, then 21 go
        assert idx.counters().dropped == 2
        assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 3}
        assert idx.match(chain(20, 21, 22), now=0).blocks == {}
        assert idx.holders(BlockHash(22)) == ["a"]

    def test_a_match_marks_only_the_blocks_up_to_its_deepest_hold(self):
        idx = index("a", "b", max_blocks=6)
        idx.apply(stored("a", 0, chain(10, 11)))
        idx.apply(stored("b", 0, chain(20, 21, 22, 23)))     # full
        idx.match(chain(10, 11, 20, 21), now=0)               # 10 and 11 used; 20 looked at, past a
        idx.apply(stored("a", 1, chain(30)))                  # the least recent goes: 20
        assert idx.holders(BlockHash(20)) == [] and idx.holders(BlockHash(10)) == ["a"]

    def test_a_removed_workers_slot_is_swept_before_it_is_given_again(self):
        workers = [f"w{i}" for i in range(32)]
        idx = index(*workers)
        idx.apply(stored("w5", 0, chain(10, 11)))
        idx.remove_worker("w5")
        budget = idx.max_blocks
        idx.add_worker("x")                         # no never-used slot left: w5's, swept
        assert idx.match(chain(10, 11), now=0).blocks == {} and idx.blocks_held("x") == 0
        assert len(idx) == 0 and idx.max_blocks == budget
        idx.add_worker("y")                         # the 33rd: a second word per tier
        assert (budget, idx.max_blocks) == (DEFAULT_INDEX_BYTES // 22, DEFAULT_INDEX_BYTES // 32)
        idx.apply(stored("y", 0, chain(10, 11)))
        idx.apply(stored("w31", 0, chain(10)))
        assert idx.match(chain(10, 11), now=0).blocks == {"y": 2, "w31": 1}
        assert idx.holders(BlockHash(10)) == ["w31", "y"]

    def test_widening_past_the_budget_drops_the_least_recent(self):
        idx = index(*[f"w{i}" for i in range(32)], max_blocks=10)
        idx.apply(stored("w0", 0, chain(*range(100, 110))))
        idx.add_worker("w32")                       # 32 bytes a block now: 220 // 32 = 6 fit
        assert idx.max_blocks == 6 and len(idx) == 6 and idx.counters().dropped == 4
        assert idx.blocks_held("w0") == 6 and idx.holders(BlockHash(104)) == ["w0"]
        idx.apply(stored("w32", 0, chain(104)))
        assert idx.holders(BlockHash(104)) == ["w0", "w32"]

    def test_a_batch_that_mixes_stores_and_removals_ends_as_each_blocks_last_event_says(self):
        idx = index("a")
        idx.apply(stored("a", 0, chain(10)))
        events = (BlockRemoved(BlockHash(10), "ns"), BlockStored(BlockHash(11), ROOT, 16, "ns"),
                  BlockRemoved(BlockHash(12), "ns"),                      # never held: unknown
                  BlockStored(BlockHash(10), ROOT, 16, "ns"), BlockRemoved(BlockHash(11), "ns"),
                  BlockStored(BlockHash(13), ROOT, 16, "ns"), BlockRemoved(BlockHash(13), "ns"),
                  BlockRemoved(BlockHash(13), "ns"))                      # gone already: unknown
        idx.apply(EventBatch("a", 1, events))
        assert idx.counters().unknown_block_removals == 2 and idx.blocks_held("a") == 1
        assert [idx.holders(BlockHash(b)) for b in (10, 11, 12, 13)] == [["a"], [], [], []]
        assert len(idx) == 1

    def test_blocks_moving_from_memory_to_disk_in_one_batch(self):
        idx = index("a")
        idx.apply(stored("a", 0, chain(10, 11)))
        moves = tuple(event for b in (10, 11) for event in (
            BlockRemoved(BlockHash(b), "ns"), BlockStored(BlockHash(b), ROOT, 16, "ns", Tier.DISK)))
        idx.apply(EventBatch("a", 1, moves))
        assert idx.match(chain(10, 11), now=0) == Match({"a": 2}, {"a": 2})
        assert idx.blocks_held("a") == 0 and idx.counters().unknown_block_removals == 0
