"""Every miss or partial hit gets one cause, from typed request data and an injected clock."""
import pytest

from router.attribution import (Attribution, MissAttributor, MissCause, RequestSeen, ServedTier,
                                served_from)
from router.kv.key import Namespace

BS = 4
ACME, BETA = Namespace("acme", "m"), Namespace("beta", "m")
SYSTEM = list(range(100, 112))           # three full blocks


def seen(prompt, worker="w0", cached=0, written=None, ns=ACME, **kw):
    if written is None:  # every full block past the cached ones is stored
        written = len(prompt) // BS * BS - -(-cached // BS) * BS
    return RequestSeen(ns, tuple(prompt), worker, cached, written, **kw)


@pytest.fixture
def attr():
    return MissAttributor(block_size=BS, ttl_s=300)


def test_first_sight_then_hit(attr):
    prompt = SYSTEM + [1, 2]
    assert attr.observe(seen(prompt), 0.0) == Attribution(MissCause.FIRST_SIGHT, 14)
    assert attr.observe(seen(prompt, cached=12), 1.0) is None


def test_fully_cached_block_multiple_is_a_hit(attr):
    attr.observe(seen(SYSTEM), 0.0)
    assert attr.observe(seen(SYSTEM, cached=11, written=0), 1.0) is None


def test_shorter_than_one_block(attr):
    assert attr.observe(seen([1, 2, 3]), 0.0) == Attribution(MissCause.SHORTER_THAN_BLOCK, 3)
    # Exactly one block may reuse all but its last token, so it is not "shorter".
    assert attr.observe(seen([7, 8, 9, 10]), 0.0).cause is MissCause.FIRST_SIGHT


def test_ttl_expired_versus_evicted(attr):
    prompt = SYSTEM + [1]
    attr.observe(seen(prompt), 0.0)
    assert attr.observe(seen(prompt), 299.0).cause is MissCause.EVICTED
    assert attr.observe(seen(prompt), 599.0 + 0.5).cause is MissCause.TTL_EXPIRED


def test_invalidated(attr):
    prompt = SYSTEM + [1]
    attr.observe(seen(prompt), 0.0)
    attr.invalidated("beta", 5.0)              # another tenant's blocks: not ours
    assert attr.observe(seen(prompt), 10.0).cause is MissCause.EVICTED
    attr.invalidated("acme", 15.0)
    assert attr.observe(seen(prompt), 20.0).cause is MissCause.INVALIDATED


def test_routed_elsewhere_names_the_holder(attr):
    prompt = SYSTEM + [1]
    attr.observe(seen(prompt, worker="w1"), 0.0)
    got = attr.observe(seen(prompt, worker="w0"), 1.0)
    assert got == Attribution(MissCause.ROUTED_ELSEWHERE, 13, holder="w1")


def test_routed_elsewhere_from_the_routers_candidates(attr):
    prompt = SYSTEM + [1]
    got = attr.observe(seen(prompt, worker="w0", candidate_matches={"w0": 0, "w2": 8}), 0.0)
    assert got == Attribution(MissCause.ROUTED_ELSEWHERE, 13, holder="w2")
    # The router's candidates say nobody else held it: history alone does not override them.
    attr2 = MissAttributor(BS, 300)
    attr2.observe(seen(prompt, worker="w1"), 0.0)
    got = attr2.observe(seen(prompt, worker="w0", candidate_matches={"w0": 0, "w1": 0}), 1.0)
    assert got == Attribution(MissCause.EVICTED, 13)   # w1 no longer held it


def test_tenant_boundary(attr):
    prompt = SYSTEM + [1]
    attr.observe(seen(prompt, ns=BETA), 0.0)
    assert attr.observe(seen(prompt, ns=ACME), 1.0).cause is MissCause.TENANT_BOUNDARY


def test_near_miss_after_a_shared_run(attr):
    attr.observe(seen(SYSTEM + [1, 2, 3, 4, 5]), 0.0)
    drifted = SYSTEM[:8] + [999] + SYSTEM[9:] + [1, 2, 3, 4, 5]   # a token changed in block 2
    got = attr.observe(seen(drifted, cached=8), 1.0)
    assert got == Attribution(MissCause.NEAR_MISS, 9, served=ServedTier.MEMORY)
    # The engine's own near-miss verdict is taken as well.
    other = MissAttributor(BS, 300)
    assert other.observe(seen(SYSTEM + [1], engine_near_miss=True), 0.0).cause is MissCause.NEAR_MISS


def test_block_hashes_must_match_the_prompt(attr):
    with pytest.raises(ValueError, match="full blocks"):
        attr.observe(seen(SYSTEM, block_hashes=(1, 2)), 0.0)


def test_memory_is_bounded():
    attr = MissAttributor(BS, 300, max_blocks=8)
    for i in range(50):
        attr.observe(seen([i * 1000 + t for t in range(17)]), float(i))
    assert len(attr._used) <= 8


def _concurrent_batch(order):
    """Three requests sharing SYSTEM with their own tails, all sent at t=0 to w0 and w1 and
    computed at once; ``order`` is the order they finish in."""
    attr = MissAttributor(block_size=BS, ttl_s=300)
    prompts = {"a": SYSTEM + [1, 2, 3, 4, 9], "b": SYSTEM + [5, 6, 7, 8, 9, 9, 9, 9, 9],
               "c": SYSTEM + [1, 2, 3, 5, 9]}
    workers = {"a": "w0", "b": "w1", "c": "w0"}
    causes = {}
    for i, name in enumerate(order):
        got = attr.observe(seen(prompts[name], worker=workers[name], sent=0.0), 1.0 + i)
        causes[name] = (got.cause, got.tokens)
    return causes, attr


def test_concurrent_causes_do_not_depend_on_finishing_order():
    first, _ = _concurrent_batch("abc")
    for order in ("acb", "bac", "bca", "cab", "cba"):
        assert _concurrent_batch(order)[0] == first
    # None of them could read what the others stored while they were in flight.
    assert first == {"a": (MissCause.FIRST_SIGHT, 17), "b": (MissCause.FIRST_SIGHT, 21),
                     "c": (MissCause.FIRST_SIGHT, 17)}


def test_a_later_request_sees_what_the_concurrent_ones_stored():
    _, attr = _concurrent_batch("abc")
    # Sent after they finished: c's tail block diverges from a's (same parent): near miss.
    later = seen(SYSTEM + [1, 2, 3, 6, 7], worker="w0", cached=12, sent=10.0)
    assert attr.observe(later, 11.0) == Attribution(MissCause.NEAR_MISS, 5,
                                                    served=ServedTier.MEMORY)


def test_timing_dependent_causes_are_named():
    from router.attribution import TIMING_DEPENDENT
    assert TIMING_DEPENDENT == {MissCause.NEAR_MISS, MissCause.FIRST_SIGHT}


def test_a_partial_hit_names_the_tier_its_cached_tokens_came_from(attr):
    attr.observe(seen(SYSTEM), 0.0)
    longer = SYSTEM + [1, 2, 3, 4, 5]  # 12 cached: 4 from memory, 8 read back from disk
    got = attr.observe(seen(longer, cached=12, disk_tokens=8), 1.0)
    assert got == Attribution(MissCause.FIRST_SIGHT, 5, served=ServedTier.BOTH, disk_tokens=8)
    assert attr.observe(seen(longer, cached=16, disk_tokens=16), 2.0) is None  # a hit
    with pytest.raises(ValueError, match="disk_tokens must be within"):
        attr.observe(seen(longer, cached=4, disk_tokens=8), 3.0)


def test_a_prefix_pulled_from_a_peer_is_its_own_outcome(attr):
    prompt = SYSTEM + [1, 2]
    attr.observe(seen(prompt, worker="w0"), 0.0)
    pulled = attr.observe(seen(prompt, worker="w1", cached=12, written=0, pulled_tokens=12,
                               pulled_from="w0"), 1.0)
    assert pulled == Attribution(MissCause.PULLED_FROM_PEER, 2, "w0", ServedTier.MEMORY, 0, 12)
    # a pull that brought part of it: still pulled_from_peer, the rest computed
    partial = attr.observe(seen(SYSTEM + [5], worker="w2", cached=4, pulled_tokens=4,
                                pulled_from="w0"), 2.0)
    assert (partial.cause, partial.tokens, partial.pulled_tokens) == (
        MissCause.PULLED_FROM_PEER, 9, 4)


class TestServedFrom:
    def test_served_from_names_the_tiers_and_refuses_impossible_counts(self):
        assert [served_from(c, d) for c, d in ((0, 0), (64, 0), (64, 64), (64, 16))] == [
            ServedTier.NONE, ServedTier.MEMORY, ServedTier.DISK, ServedTier.BOTH]
        with pytest.raises(ValueError, match="disk_tokens must be within"):
            served_from(16, 32)
