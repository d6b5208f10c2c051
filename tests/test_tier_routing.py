"""The router knows the tiers: a block on a worker's disk is held, but costs its load time."""
from __future__ import annotations

from router.events import BlockRemoved, BlockStored, EventBatch, Tier
from router.index import PrefixIndex
from router.key import Namespace, hash_blocks
from router.policy import DISK_TOKEN_COST, PolicyConfig
from router.router import Router

NS = Namespace("t", "m")
BS = 16
PROMPT = list(range(1, 16 * 4 + 5))  # 4 full blocks and a tail
H = hash_blocks(PROMPT, BS, NS)


def stored(h, i, tier=Tier.MEMORY):
    return BlockStored(h[i], h[i - 1] if i else NS.root(), BS, NS.label(), tier)


def spill_events() -> tuple:
    """w1 stores 4 blocks, then its memory evicts the last 3 to its disk."""
    events = [stored(H, i) for i in range(4)]
    for i in (3, 2, 1):
        events += [BlockRemoved(H[i], NS.label(), Tier.MEMORY), stored(H, i, Tier.DISK)]
    return tuple(events)


def test_a_block_moved_to_disk_stays_held_and_is_counted_as_disk():
    index = PrefixIndex()
    index.add_worker("w0")
    index.add_worker("w1")
    index.apply(EventBatch("w0", 0, tuple(stored(H, i) for i in range(4))))
    index.apply(EventBatch("w1", 0, spill_events()))
    found = index.match(H, now=0.0)
    assert found.blocks == {"w0": 4, "w1": 4}
    assert found.disk_blocks == {"w1": 3}
    index.apply(EventBatch("w1", 1, (BlockRemoved(H[3], NS.label(), Tier.DISK),)))
    found = index.match(H, now=0.0)
    assert (found.blocks, found.disk_blocks) == ({"w0": 4, "w1": 3}, {"w1": 2})
    assert index.counters().unknown_block_removals == 0


def test_rebuild_takes_both_tiers():
    index = PrefixIndex()
    index.add_worker("w0")
    index.rebuild("w0", H[:1], H[1:3])
    found = index.match(H, now=0.0)
    assert (found.blocks, found.disk_blocks) == ({"w0": 3}, {"w0": 2})


def test_the_policy_charges_disk_tokens_their_load_time():
    router = Router(block_size=BS, clock=lambda: 0.0)
    router.add_worker("w0")
    router.add_worker("w1")
    router.apply_events(EventBatch("w0", 0, tuple(stored(H, i) for i in range(4))))
    router.apply_events(EventBatch("w1", 0, spill_events()))
    decision = router.route(NS, H, len(PROMPT))
    assert decision.worker_id == "w0"
    scores = {c.worker_id: c.score for c in decision.candidates}
    assert scores == {"w0": 4.0, "w1": 4.0 + DISK_TOKEN_COST * 3 * BS}
    assert PolicyConfig().disk_token_cost == DISK_TOKEN_COST


def test_a_router_rebuilt_from_a_tiered_store_keeps_each_blocks_tier(tmp_path):
    """A store whose memory holds B and whose disk holds A: the holdings say so block by
    block, and a router rebuilt from them charges A's blocks as disk, as one fed by the
    store's events does."""
    from router.key import hash_blocks as hashes
    from test_disk_tier import A, B, NS as SNS, spilled_a
    from workers.runtime import Holdings

    store = spilled_a(tmp_path)
    a0, a1 = hashes(A, 4, SNS)
    b0, b1 = hashes(B, 4, SNS)
    held = Holdings.of(7, store.holdings())
    assert (held.seq, held.blocks, held.disk_blocks) == (7, (b0, b1), (a0, a1))

    # cache_weight 1: a score is the prefill ahead of the first token, disk loads included
    fed, rebuilt = (Router(4, PolicyConfig(cache_weight=1), clock=lambda: 0.0) for _ in "ab")
    for router in (fed, rebuilt):
        router.add_worker("w0")
        router.add_worker("w1")
    fed.apply_events(EventBatch("w1", 0, tuple(store.drain_events())))
    rebuilt.rebuild("w1", held.blocks, held.disk_blocks)
    for router in (fed, rebuilt):
        scores = {c.worker_id: c.score for c in router.route(SNS, [a0, a1], 9).candidates}
        assert scores == {"w0": 9.0, "w1": 1.0 + DISK_TOKEN_COST * 8}
        scores = {c.worker_id: c.score for c in router.route(SNS, [b0, b1], 9).candidates}
        assert scores == {"w0": 9.0, "w1": 1.0}
    store.close()


def test_a_restarted_worker_announces_its_whole_cache_on_disk(tmp_path):
    """After a restart every block is on disk only: the holdings have no memory blocks."""
    from router.key import hash_blocks as hashes
    from test_disk_tier import A, B, NS as SNS, spilled_a, tiered
    from workers.runtime import Holdings

    spilled_a(tmp_path).close()
    again = tiered(tmp_path / "w0")
    held = Holdings.of(0, again.holdings())
    assert held.blocks == ()
    assert sorted(held.disk_blocks) == sorted(hashes(A, 4, SNS) + hashes(B, 4, SNS))
    again.close()
