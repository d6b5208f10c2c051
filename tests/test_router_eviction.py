"""The ledger's "reuse" eviction variant: reused blocks outlive blocks used once; leaves first."""
import pytest

from router.key import BlockHash
from router.ledger import BlockLedger

ROOT = BlockHash(999)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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
