"""``router.sim.peers``: the peers' routers as the simulator replays them, each on a small
hand-made case with exact answers: SGLang's prefix hash and its bounded load, Dynamo's active
blocks, the two SGLang cache-aware routers' fallbacks, Ray Serve's prefix affinity; ties by
the seed."""
from __future__ import annotations

from router.kv.key import BlockHash
from router.sim.base import SimRequest
from router.sim.peers import (DynamoKv, PrefixHash, RayPrefixAffinity, SglangGatewayCacheAware,
                              SglangRouterCacheAware)

BS = 512


def request(rid: int, blocks: list[int], tail: int = 10) -> SimRequest:
    return SimRequest(rid, len(blocks) * BS + tail, 10, tuple(BlockHash(b) for b in blocks))


def _sglang_pair(cls):
    policy = cls(["w0", "w1"], BS, seed=0)
    a = request(0, list(range(1, 11)))  # 10 blocks: a big tree on its worker
    x = policy.choose(a, 0.0)
    policy.started(a, x, 0.0)
    policy.finished(0)
    y = "w1" if x == "w0" else "w0"
    b = request(1, [500])                  # cold; then left running on y
    policy.choose(b, 1.0)
    policy.started(b, y, 1.0)
    return policy, x, y


def _owner(policy, block):
    return next(w for w, tree in policy.trees.items() if BlockHash(block) in tree)


class TestPrefixHash:
    def test_prefix_hash_keeps_its_ring_worker_until_it_exceeds_the_load_bound(self):
        policy = PrefixHash([f"w{i}" for i in range(4)], BS, seed=0)
        home = policy.choose(request(0, [7, 8]), 0.0)
        assert policy.choose(request(1, [7, 9]), 0.0) == home  # same first block, same worker
        for rid in range(2, 4):
            policy.started(request(rid, [100 + rid]), home, 0.0)
        # 2 in flight, all on home: bound (2 + 1) / 4 x 1.25 = 0.94 is exceeded
        others = [w for w in policy.workers if w != home]
        assert policy.choose(request(4, [7, 10]), 0.0) in others
        for w in others:
            policy.started(request(10 + int(w[1:]), [200 + int(w[1:])]), w, 0.0)
        # 5 in flight, 2 on home: bound (5 + 1) / 4 x 1.25 = 1.875 is still exceeded, and every
        # other worker (1 each) is within it
        assert policy.choose(request(5, [7, 11]), 0.0) in others
        policy.finished(2)
        # 4 in flight, 1 on home: bound 1.5625: home again
        assert policy.choose(request(6, [7, 12]), 0.0) == home


class TestDynamoKv:
    def test_dynamo_counts_a_block_shared_by_active_requests_once(self):
        policy = DynamoKv(["w0", "w1"], BS, seed=0)
        a = request(0, list(range(1, 9)))        # 8 blocks + tail, active on w0
        b = request(1, list(range(50, 56)))      # 6 blocks + tail, active on w1
        policy.started(a, "w0", 0.0)
        policy.started(b, "w1", 0.0)
        policy.prefilled(0)
        policy.prefilled(1)
        assert (policy.active_blocks("w0"), policy.active_blocks("w1")) == (9, 7)
        # c continues a: on w0 its 8 blocks are already active (decode blocks 9 + 1 new tail),
        # on w1 all 9 are new (7 + 9); prefill is the same on both (no events: nothing cached)
        assert policy.choose(request(2, list(range(1, 9)), tail=20), 1.0) == "w0"
        policy.started(request(2, list(range(1, 9)), tail=20), "w0", 1.0)
        assert policy.active_blocks("w0") == 10
        policy.finished(0)
        assert policy.active_blocks("w0") == 9  # c still holds the shared 8 blocks and its own tail
        policy.finished(2)
        assert policy.active_blocks("w0") == 0


class TestSglangCacheAware:
    def test_sglang_gateway_falls_back_to_the_least_loaded_and_the_old_router_to_the_smallest_tree(self):
        gateway, x, y = _sglang_pair(SglangGatewayCacheAware)
        assert gateway.choose(request(2, [900]), 2.0) == x   # x is idle (y runs b)
        router, x, y = _sglang_pair(SglangRouterCacheAware)
        assert router.choose(request(2, [900]), 2.0) == y    # y's tree (1 block) is the smallest
        # a match above 30% of the prompt still wins in both
        assert gateway.choose(request(3, list(range(1, 11))), 3.0) == _owner(gateway, 1)

    def test_ties_break_by_the_seed_not_always_to_the_first_worker(self):
        def first_picks(seed):
            policy = SglangGatewayCacheAware([f"w{i}" for i in range(8)], BS, seed)
            return [policy.choose(request(i, [1000 + i]), 0.0) for i in range(6)]

        assert first_picks(1) == first_picks(1)
        picks = {tuple(first_picks(s)) for s in range(4)}
        assert len(picks) > 1 and any(p[0] != "w0" for p in picks)


class TestRayPrefixAffinity:
    def test_a_tenth_of_the_input_matched_keeps_the_owner_even_when_busy(self):
        policy = RayPrefixAffinity(["w0", "w1"], BS, seed=0)
        first = request(0, [1, 2, 3])
        home = policy.choose(first, 0.0)
        policy.started(first, home, 0.0)
        assert policy.size == {home: 3, _other(home): 0}
        # one block of 512 matched out of 512 x 20 + 10 tokens: under a tenth
        assert policy.choose(request(1, [1] + list(range(50, 69))), 0.0) == _other(home)
        # two blocks of 2 x 512 + 10: the busy owner still
        assert policy.choose(request(2, [1, 2]), 0.0) == home
        assert policy.owners[BlockHash(1)] == {"w0", "w1"}

    def test_a_cold_request_goes_to_the_smallest_tree_and_grows_it(self):
        policy = RayPrefixAffinity(["w0", "w1"], BS, seed=0)
        home = policy.choose(request(0, [1, 2, 3]), 0.0)
        assert policy.choose(request(1, [900]), 0.0) == _other(home)
        assert policy.size == {home: 3, _other(home): 1}
        assert policy.choose(request(2, [901]), 0.0) == _other(home)   # 2 blocks against 3
        assert policy.size[_other(home)] == 2

    def test_among_trees_of_one_size_the_fewest_in_flight_wins(self):
        policy = RayPrefixAffinity(["w0", "w1"], BS, seed=0)
        busy = policy.choose(request(0, [1]), 0.0)
        policy.started(request(0, [1]), busy, 0.0)
        assert policy.choose(request(1, [2]), 0.0) == _other(busy)     # the smaller tree
        assert policy.size == {"w0": 1, "w1": 1}
        assert policy.choose(request(2, [3]), 0.0) == _other(busy)     # idle against busy


def _other(worker: str) -> str:
    return "w1" if worker == "w0" else "w0"
