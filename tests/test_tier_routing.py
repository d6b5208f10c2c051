"""The router knows the tiers: a block on a worker's disk is held, but costs its load time,
from the read bandwidth and prefill rate the worker measured (the default until it has)."""
from __future__ import annotations

import msgpack
import pytest

from router.kv.events import (BlockRemoved, BlockStored, EventBatch, Tier, WorkerRates, decode_batch,
                           encode_batch)
from router.index import PrefixIndex
from router.kv.key import Namespace, hash_blocks
from router.policy import DISK_TOKEN_COST, PolicyConfig, disk_token_cost
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
    from router.kv.key import hash_blocks as hashes
    from test_disk_tier import A, B, NS as SNS, spilled_a
    from workers.engine.runtime import Holdings

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
    from router.kv.key import hash_blocks as hashes
    from test_disk_tier import A, B, NS as SNS, spilled_a, tiered
    from workers.engine.runtime import Holdings

    spilled_a(tmp_path).close()
    again = tiered(tmp_path / "w0")
    held = Holdings.of(0, again.holdings())
    assert held.blocks == ()
    assert sorted(held.disk_blocks) == sorted(hashes(A, 4, SNS) + hashes(B, 4, SNS))
    again.close()


# 4,096 bytes per token read at 1 GiB/s takes 1/2**18 s; at 2**14 prefill tokens/s that is
# 2**-4 = 0.0625 tokens of prefill (powers of two: every figure below is exact)
RATES = WorkerRates(4096, float(2**30), float(2**14))


def test_a_measured_disk_costs_its_load_time_in_that_workers_prefill_tokens():
    assert disk_token_cost(RATES) == 0.0625
    assert disk_token_cost(WorkerRates(4096, float(2**28), float(2**14))) == 0.25
    router = Router(block_size=BS, clock=lambda: 0.0)
    router.add_worker("w0")
    router.add_worker("w1")
    router.apply_events(EventBatch("w0", 0, tuple(stored(H, i) for i in range(4))))
    router.apply_events(EventBatch("w1", 0, spill_events(), RATES))
    scores = {c.worker_id: c.score for c in router.route(NS, H, len(PROMPT)).candidates}
    assert scores == {"w0": 4.0, "w1": 4.0 + 0.0625 * 3 * BS}  # 7.0
    costs = {s.worker_id: s.disk_token_cost for s in router.workers()}
    assert costs == {"w0": None, "w1": 0.0625}


def test_until_a_worker_has_measured_both_rates_the_default_cost_stands():
    for rates in (WorkerRates(4096, None, float(2**14)), WorkerRates(4096, float(2**30), None),
                  None):
        router = Router(block_size=BS, clock=lambda: 0.0)
        router.add_worker("w1")
        router.apply_events(EventBatch("w1", 0, spill_events(), rates))
        (candidate,) = router.route(NS, H, len(PROMPT)).candidates
        assert candidate.score == 4.0 - 63.0 * 64 + DISK_TOKEN_COST * 3 * BS
        assert router.workers()[0].disk_token_cost is None


def test_workers_with_the_same_disk_holdings_rank_by_their_read_bandwidth():
    slow, fast = WorkerRates(4096, float(2**28), float(2**14)), RATES  # 0.25 and 0.0625
    for w0_rates, w1_rates, winner in ((slow, fast, "w1"), (fast, slow, "w0")):
        router = Router(block_size=BS, clock=lambda: 0.0)
        router.add_worker("w0")
        router.add_worker("w1")
        router.apply_events(EventBatch("w0", 0, spill_events(), w0_rates))
        router.apply_events(EventBatch("w1", 0, spill_events(), w1_rates))
        decision = router.route(NS, H, len(PROMPT))
        scores = {c.worker_id: c.score for c in decision.candidates}
        cost = {"w0": disk_token_cost(w0_rates), "w1": disk_token_cost(w1_rates)}
        assert scores == {w: 4.0 + cost[w] * 3 * BS for w in ("w0", "w1")}  # 16.0 and 7.0
        assert sorted(scores.values()) == [7.0, 16.0]
        assert decision.worker_id == winner


def test_rates_travel_in_the_encoded_batch():
    batch = EventBatch("w1", 3, spill_events(), RATES)
    assert decode_batch(encode_batch(batch)) == batch
    partial = EventBatch("w1", 4, (), WorkerRates(4096, None, 25.5))
    assert decode_batch(encode_batch(partial)) == partial
    assert decode_batch(encode_batch(EventBatch("w1", 5, ()))).rates is None
    # a batch from a worker that predates the rates decodes without them
    assert decode_batch(msgpack.packb(["w1", 6, []])) == EventBatch("w1", 6, ())
    with pytest.raises(ValueError, match="malformed event batch.*must be positive"):
        decode_batch(msgpack.packb(["w1", 7, [], [4096, -1.0, 25.0]]))
    router = Router(block_size=BS, clock=lambda: 0.0)
    router.add_worker("w1")
    router.apply_events(decode_batch(encode_batch(batch)))  # as the wire brings it
    assert router.workers()[0].disk_token_cost == 0.0625


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="disk_bytes_per_token must be positive"):
        WorkerRates(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="prefill_tokens_s must be positive or None"):
        WorkerRates(4096, 1.0, 0.0)
    with pytest.raises(ValueError, match="disk_read_bytes_s must be positive or None"):
        WorkerRates(4096, float("nan"), 1.0)


def test_a_real_engines_measured_rates_reach_the_in_process_router(tmp_path):
    """A worker restarted on its disk directory holds two prompts there. The first request
    is costed at the default (nothing measured yet); it reads its prefix from disk and
    prefills the rest, and the second request's disk hit is costed at exactly the rates the
    engine measured."""
    import asyncio

    from cluster.backend.local import LocalBackend
    from tests.forged_models import tiny_model
    from workers.engine.engine import EngineConfig
    from workers.messages import GenerateRequest, SamplingParams

    engine = EngineConfig(block_size=16, store_bytes=1 << 20, disk_bytes=1 << 22,
                          disk_dir=str(tmp_path / "cache"))
    prompts = {"p": tuple(range(40, 40 + 4 * 16 + 3)), "q": tuple(range(300, 300 + 4 * 16 + 3))}

    async def run(names):
        backend = LocalBackend(tiny_model(), workers=1, engine=engine)
        await backend.start()
        outcomes, rates = [], []
        try:
            info = backend.model_info()
            ns = Namespace("t", info.model_id, info.revision)
            (worker,) = await backend.workers()
            for name in names:
                request = GenerateRequest(name, ns, prompts[name], SamplingParams(max_tokens=2))
                outcomes.append(await backend.generate(request, hash_blocks(prompts[name], 16, ns)))
                rates.append(await backend.runtime.call(worker.worker_id, lambda e: e.rates()))
            return outcomes, rates, info
        finally:
            await backend.close()  # the memory tier is written to disk

    asyncio.run(run("pq"))
    (p, q), (rates, _), info = asyncio.run(run("pq"))
    assert (p.result.lookup.disk_tokens, q.result.lookup.disk_tokens) == (64, 64)
    assert rates.disk_bytes_per_token == info.disk_kv_bytes_per_token
    assert rates.disk_read_bytes_s > 0 and rates.prefill_tokens_s > 0
    # 67 prompt tokens, 64 matched and held here only (cache weight 64), all 64 on disk
    (before,) = p.decision.candidates
    assert before.score == 67 - 64 - 63.0 * 64 + DISK_TOKEN_COST * 64
    (after,) = q.decision.candidates
    assert after.score == 67 - 64 - 63.0 * 64 + disk_token_cost(rates) * 64
    assert disk_token_cost(rates) == (info.disk_kv_bytes_per_token / rates.disk_read_bytes_s
                                      * rates.prefill_tokens_s)
