"""PrefixIndex: events in, per-worker matched depth out; pending, churn, bounds, rebuild."""
from router.kv.events import BlockRemoved, BlockStored, EventBatch
from router.index import PrefixIndex
from router.kv.key import BlockHash

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


def test_match_reports_each_workers_leading_blocks():
    idx = index("a", "b", "c")
    idx.apply(stored("a", 0, chain(10, 11, 12, 13)))
    idx.apply(stored("b", 0, chain(10, 11)))
    idx.apply(stored("c", 0, chain(20, 21)))
    assert idx.match(chain(10, 11, 12, 13, 14), now=0).blocks == {"a": 4, "b": 2}
    assert idx.match(chain(10, 11, 99), now=0).blocks == {"a": 2, "b": 2}
    assert idx.match(chain(99, 10), now=0).blocks == {}
    assert idx.match([], now=0).blocks == {}


def test_bisection_agrees_with_a_linear_walk_on_long_chains():
    idx = index(*[f"w{i}" for i in range(8)])
    long = chain(*range(100, 400))
    for i in range(8):
        idx.apply(stored(f"w{i}", 0, long[: 37 * i + 1]))
    got = idx.match(long, now=0).blocks
    assert got == {f"w{i}": 37 * i + 1 for i in range(8)}


def test_removed_events_shrink_what_a_worker_holds():
    idx = index("a")
    idx.apply(stored("a", 0, chain(10, 11, 12)))
    idx.apply(removed("a", 1, chain(12)))
    assert idx.match(chain(10, 11, 12), now=0).blocks == {"a": 2}
    assert idx.blocks_held("a") == 2


def test_pending_entries_steer_siblings_then_expire_or_get_confirmed():
    idx = index("a", "b", pending_ttl_s=5.0)
    idx.note_routed("b", chain(30, 31), now=0.0)
    assert idx.match(chain(30, 31, 32), now=1.0).blocks == {"b": 2}
    assert idx.match(chain(30, 31), now=5.0).blocks == {}  # expired, never confirmed
    assert idx.counters().pending_expired == 2
    idx.note_routed("a", chain(40), now=10.0)
    idx.apply(stored("a", 0, chain(40)))  # confirmed: now held, no longer pending
    assert idx.match(chain(40), now=100.0).blocks == {"a": 1}
    assert idx.counters().pending_expired == 2


def test_pending_covers_a_bounded_window_past_what_is_held():
    idx = index("a", pending_blocks=2)
    idx.apply(stored("a", 0, chain(1, 2)))
    idx.note_routed("a", chain(1, 2, 3, 4, 5, 6), now=0.0, held_blocks=2)
    assert idx.match(chain(1, 2, 3, 4, 5, 6), now=0.0).blocks == {"a": 4}


def test_removing_a_worker_forgets_its_blocks_at_once():
    idx = index("a", "b")
    idx.apply(stored("a", 0, chain(10, 11)))
    idx.apply(stored("b", 0, chain(10)))
    idx.note_routed("a", chain(10, 11, 12), now=0.0)
    idx.remove_worker("a")
    assert idx.match(chain(10, 11, 12), now=0.0).blocks == {"b": 1}
    idx.add_worker("a")  # back under the same name: starts empty
    assert idx.match(chain(10, 11), now=0.0).blocks == {"b": 1}
    assert idx.blocks_held("a") == 0


def test_unknown_workers_and_never_stored_removals_are_counted_not_raised():
    idx = index("a")
    idx.apply(stored("ghost", 0, chain(10, 11)))
    idx.apply(removed("a", 0, chain(77)))
    counters = idx.counters()
    assert counters.unknown_worker_events == 2
    assert counters.unknown_block_removals == 1
    assert len(idx) == 0


def test_a_sequence_gap_marks_the_worker_stale_until_rebuilt():
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


def test_memory_is_bounded_by_dropping_the_least_recently_used_entries():
    idx = index("a", max_blocks=100)
    for seq in range(30):
        idx.apply(stored("a", seq, chain(*range(10 * seq + 1000, 10 * seq + 1010))))
    assert len(idx) <= 100
    assert idx.counters().dropped == 300 - len(idx)
    assert idx.blocks_held("a") == len(idx)
    newest = chain(*range(1290, 1300))
    assert idx.match(newest, now=0).blocks == {"a": 10}


def test_a_replayed_or_out_of_order_batch_is_a_gap():
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
