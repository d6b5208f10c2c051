"""The ledger's "reuse" eviction variant: reused blocks outlive blocks used once; leaves first."""
import pytest

from router.kv.key import BlockHash
from router.kv.ledger import BlockLedger
from tests.conftest import Clock

ROOT = BlockHash(999)


def ledger(policy: str, clock: Clock, blocks: int = 2) -> BlockLedger:
    return BlockLedger(capacity_bytes=blocks, ttl_s=1e9, clock=clock, bytes_per_token=1,
                       policy=policy)


def play(policy: str) -> BlockLedger:
    clock = Clock()
    led = ledger(policy, clock)
    for t, block in enumerate((1, 2, 3)):  # 1 is evicted at t=2: horizon becomes 2 s
        clock.now = float(t)
        led.insert([BlockHash(block)], 1, "ns", ROOT)
    clock.now = 3.0
    assert led.match([BlockHash(2)]) == 1  # 2 is reused: priority 3 + 2 x 1
    clock.now = 4.0
    led.insert([BlockHash(4)], 1, "ns", ROOT)  # evicts 3 under both policies
    clock.now = 5.0
    led.insert([BlockHash(5)], 1, "ns", ROOT)
    return led


def test_reuse_keeps_the_reused_block_that_lru_evicts():
    lru, reuse = play("lru"), play("reuse")
    assert sorted(h for h in (1, 2, 3, 4, 5) if BlockHash(h) in lru) == [4, 5]
    assert sorted(h for h in (1, 2, 3, 4, 5) if BlockHash(h) in reuse) == [2, 5]


def test_reuse_evicts_leaves_before_their_parents():
    clock = Clock()
    led = ledger("reuse", clock, blocks=3)
    chain = [BlockHash(10), BlockHash(11), BlockHash(12)]
    led.insert(chain, 1, "ns", ROOT)
    clock.now = 1.0
    led.match(chain[:2])
    clock.now = 2.0
    assert led.insert([BlockHash(20)], 1, "ns", ROOT) == [BlockHash(20)]
    assert [h for h in chain if h in led] == chain[:2]  # the leaf went, never a parent
    assert led.stats().evictions == 1


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="lru, reuse"):
        ledger("lfu", Clock())


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_random_workload_keeps_capacity_and_the_prefix_property(policy):
    import random

    rng = random.Random(11)
    clock = Clock()
    led = BlockLedger(capacity_bytes=40, ttl_s=50.0, clock=clock, bytes_per_token=1,
                      policy=policy)
    chains = [[BlockHash(1000 * c + i) for i in range(1, 9)] for c in range(12)]
    parent_of = {}
    for chain in chains:
        for parent, block in zip([ROOT] + chain[:-1], chain):
            parent_of[block] = parent
    for step in range(3000):
        clock.now += rng.choice((0.1, 0.5, 2.0))
        chain = rng.choice(chains)[: rng.randint(1, 8)]
        if rng.random() < 0.5:
            led.match(chain)
        else:
            led.insert(chain, 2, "ns", ROOT)
        held = [b for b in parent_of if b in led]
        assert led.used_bytes <= 40
        assert all(parent_of[b] == ROOT or parent_of[b] in led for b in held), step
    stats = led.stats()
    assert stats.evictions > 0 and stats.hit_blocks > 0
    clock.now += 100.0  # past the TTL: everything expires, whatever the policy
    led.expire()
    assert len(led) == 0
