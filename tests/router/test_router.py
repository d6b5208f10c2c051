"""Router: decisions as data, load accounting, churn, restart rebuild, errors.

The router knows the tiers: a block on a worker's disk is held, but costs its load time,
from the read bandwidth and prefill rate the worker measured (the default until it has).
"""
from __future__ import annotations

import pytest
from router.kv.events import EventBatch, decode_batch, encode_batch
from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import BlockLedger
from router.policy import (NoWorkerAvailable, PolicyConfig, Reason, RouteQuery, WorkerLoad,
                           decide, rendezvous)
from router.router import Router
from tests.conftest import Clock
import msgpack
from router.kv.events import (BlockRemoved, BlockStored, EventBatch, Tier, WorkerRates, decode_batch,
                           encode_batch)
from router.index import PrefixIndex
from router.policy import DISK_TOKEN_COST, PolicyConfig, disk_token_cost


NS = Namespace("acme", "tiny")

BS = 16

def prompt(conv: int, blocks: int, tail: int = 5) -> list[int]:
    return [conv * 1000 + i for i in range(blocks * BS + tail)]

def make_router(*workers: str, **config) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router(BS, PolicyConfig(**config), clock=clock, seed=7)
    for w in workers:
        router.add_worker(w)
    return router, clock

def store_on(router: Router, worker: str, tokens: list[int], seq: int = 0) -> BlockLedger:
    ledger = BlockLedger(10**9, 3600, lambda: 0.0, bytes_per_token=1)
    ledger.insert(hash_blocks(tokens, BS, NS), BS, NS.label(), NS.root())
    router.apply_events(EventBatch(worker, seq, tuple(ledger.drain_events())))
    return ledger

def route(router: Router, tokens: list[int]):
    return router.route(NS, hash_blocks(tokens, BS, NS), len(tokens))


class TestBehaviour:
    def test_a_held_prefix_wins_and_the_decision_is_data(self):
        router, _ = make_router("a", "b", "c")
        store_on(router, "b", prompt(1, 4))
        decision = route(router, prompt(1, 6))
        assert decision.worker_id == "b"
        assert decision.reason is Reason.PREFIX_MATCH
        assert decision.expected_cached_tokens == 4 * BS
        assert decision.prompt_tokens == 6 * BS + 5
        by_worker = {c.worker_id: c for c in decision.candidates}
        assert set(by_worker) == {"a", "b", "c"}
        assert by_worker["b"].matched_tokens == 64 and by_worker["a"].matched_tokens == 0
        assert by_worker["b"].score < by_worker["a"].score

    def test_event_batches_decoded_from_msgpack_are_applied(self):
        router, _ = make_router("a", "b")
        ledger = BlockLedger(10**9, 3600, lambda: 0.0, bytes_per_token=1)
        ledger.insert(hash_blocks(prompt(2, 3), BS, NS), BS, NS.label(), NS.root())
        encoded = encode_batch(EventBatch("a", 0, tuple(ledger.drain_events())))
        router.apply_events(decode_batch(encoded))
        assert route(router, prompt(2, 3)).worker_id == "a"

    def test_an_overloaded_home_spills_to_the_cheapest_worker(self):
        router, _ = make_router("a", "b", cache_weight=2.0, balance_weight=0.0,
                                decode_weight_tokens=0)
        store_on(router, "a", prompt(1, 4))
        # Only a holds the prefix: its 64 matched tokens count double (cache_weight 2), so a
        # scores queue + 85 - 64 - 64 against b's 85. The first request queues 21 uncached tokens
        # on a, the next ones 5 each (their 5th block is pending there, 80 matched: a scores
        # queue - 75): a wins until its queue passes 160 tokens, after 29 requests.
        reasons = []
        for i in range(40):
            decision = route(router, prompt(1, 5))
            reasons.append((decision.reason, decision.worker_id))
            if decision.reason is Reason.LOAD_SPILL:
                break
            router.started(f"r{i}", decision)
        assert reasons[:29] == [(Reason.PREFIX_MATCH, "a")] * 29
        assert reasons[-1] == (Reason.LOAD_SPILL, "b") and len(reasons) == 30

    def test_recent_work_steers_cold_prompts_to_the_less_worked_worker(self):
        router, clock = make_router("a", "b", balance_weight=1.0, cold_spill_tokens=0)
        for i in range(4):
            decision = route(router, prompt(100 + i, 3))
            router.started(f"r{i}", decision)
            router.finished(f"r{i}")  # done: only the recent-work memory remains
        status = {s.worker_id: s for s in router.workers()}
        assert status["a"].queued_prefill_tokens == status["b"].queued_prefill_tokens == 0
        worked = {d: 0 for d in "ab"}
        for i in range(20):
            d = route(router, prompt(300 + i, 3))
            router.started(f"s{i}", d)
            router.finished(f"s{i}")
            worked[d.worker_id] += 1
        assert abs(worked["a"] - worked["b"]) <= 2  # alternates instead of following the hash
        before = {s.worker_id: s.recent_prefill_tokens for s in router.workers()}
        assert sum(before.values()) == 24 * 53
        clock.now += 300.0  # one half-life later
        after = {s.worker_id: s.recent_prefill_tokens for s in router.workers()}
        assert after == pytest.approx({w: v / 2 for w, v in before.items()})

    def test_a_burst_on_a_new_prefix_lands_together_before_any_event(self):
        router, _ = make_router(*[f"w{i}" for i in range(6)], cold_spill_tokens=10**6)
        first = route(router, prompt(5, 8))
        assert first.reason is Reason.COLD_HASH
        router.started("r0", first)
        siblings = [route(router, prompt(5, 8)[: 8 * BS] + [1, 2, 3]) for _ in range(3)]
        assert {d.worker_id for d in siblings} == {first.worker_id}
        assert all(d.reason is Reason.PREFIX_MATCH for d in siblings)

    def test_new_conversations_on_a_known_shared_prefix_spread_by_load(self):
        # Every worker holds the system prompt S; each new conversation adds 3 blocks of its own.
        # Nobody will share those, so a busier hash home is left as soon as waiting there costs
        # more than the conversation's own prefill (53 tokens), not cold_spill_tokens (4096).
        workers = ("a", "b", "c", "d")
        router, _ = make_router(*workers, balance_weight=0.0)
        system = prompt(9, 4, tail=0)
        for seq, w in enumerate(workers):
            store_on(router, w, system, seq)
        placed = {w: 0 for w in workers}
        for conv in range(20):
            tokens = system + prompt(conv, 3)
            decision = route(router, tokens)
            assert decision.expected_cached_tokens == 4 * BS
            assert decision.reason in (Reason.COLD_HASH, Reason.COLD_SPILL)
            router.started(f"r{conv}", decision)
            placed[decision.worker_id] += 1
        assert max(placed.values()) - min(placed.values()) <= 2, placed  # by hash alone: 9 and 3

    def test_a_cold_prompt_takes_the_less_busy_of_its_two_hash_homes(self):
        workers = [f"w{i}" for i in range(6)]
        hashes = hash_blocks(prompt(4, 10), BS, NS)
        first, second = rendezvous(hashes[0], workers, 7, choices=2)
        assert rendezvous(hashes[0], workers, 7) == [first]

        def cold(queued: dict[str, int], elsewhere: int = 400):
            loads = [WorkerLoad(w, queued.get(w, elsewhere), 0) for w in workers]
            return decide(PolicyConfig(), RouteQuery(hashes, 10 * BS + 5, {}), loads,
                          block_size=BS, seed=7)

        assert cold({}, elsewhere=1000).worker_id == first  # a tie keeps the first
        decision = cold({first: 1000, second: 500})
        assert (decision.worker_id, decision.reason) == (second, Reason.COLD_HASH)
        # Waiting 100 tokens longer than elsewhere is within the prompt's own 165-token prefill;
        # 500 longer is not.
        decision = cold({first: 1000, second: 500}, elsewhere=0)
        assert (decision.worker_id, decision.reason) == (min(set(workers) - {first, second}),
                                                         Reason.COLD_SPILL)

    def test_cold_placement_is_deterministic_per_seed_and_spreads(self):
        homes = set()
        for conv in range(40):
            a, _ = make_router("a", "b", "c", "d")
            b, _ = make_router("a", "b", "c", "d")
            da, db = route(a, prompt(conv, 2)), route(b, prompt(conv, 2))
            assert da.worker_id == db.worker_id and da.reason is Reason.COLD_HASH
            homes.add(da.worker_id)
        assert homes == {"a", "b", "c", "d"}

    def test_load_accounting_follows_a_request_through_its_life(self):
        router, _ = make_router("a")
        decision = route(router, prompt(1, 2))
        router.started("r1", decision)
        status = router.workers()[0]
        assert (status.queued_prefill_tokens, status.running_decodes, status.in_flight) == (37, 0, 1)
        router.prefilled("r1")
        status = router.workers()[0]
        assert (status.queued_prefill_tokens, status.running_decodes) == (0, 1)
        router.finished("r1")
        status = router.workers()[0]
        assert (status.queued_prefill_tokens, status.running_decodes, status.in_flight) == (0, 0, 0)
        router.finished("never-started")
        assert router.unknown_tickets == 1
        with pytest.raises(ValueError, match="already started"):
            router.started("r2", decision)
            router.started("r2", decision)

    def test_no_workers_or_all_draining_is_a_clear_error(self):
        router, _ = make_router()
        with pytest.raises(NoWorkerAvailable, match="no workers"):
            route(router, prompt(1, 2))
        router.add_worker("a")
        router.add_worker("b")
        router.drain_worker("a")
        assert route(router, prompt(1, 2)).worker_id == "b"
        router.drain_worker("b")
        with pytest.raises(NoWorkerAvailable, match="draining"):
            route(router, prompt(1, 2))

    def test_removed_worker_is_forgotten_and_its_tickets_dropped(self):
        router, _ = make_router("a", "b")
        store_on(router, "a", prompt(1, 4))
        router.started("r1", route(router, prompt(1, 4)))
        router.remove_worker("a")
        decision = route(router, prompt(1, 4))
        assert decision.worker_id == "b" and decision.expected_cached_tokens == 0
        router.finished("r1")  # its worker is gone: ignored and counted
        assert router.unknown_tickets == 1
        with pytest.raises(ValueError, match="unknown worker 'a'"):
            router.drain_worker("a")

    def test_a_restarted_router_rebuilds_from_the_workers_holdings(self):
        router, _ = make_router("a", "b")
        ledger = store_on(router, "b", prompt(3, 5))
        fresh, clock = make_router("a", "b")
        assert route(fresh, prompt(3, 5)).expected_cached_tokens == 0
        clock.now = 60.0  # that decision's pending entry has expired
        fresh.rebuild("b", [h.block for h in ledger.holdings()])
        decision = route(fresh, prompt(3, 5))
        assert decision.worker_id == "b" and decision.expected_cached_tokens == 5 * BS

    def test_short_prompts_and_bad_input(self):
        router, _ = make_router("a", "b")
        assert route(router, [1, 2, 3]).reason is Reason.COLD_HASH  # shorter than a block
        with pytest.raises(ValueError, match="prompt_tokens"):
            router.route(NS, [], 0)
        with pytest.raises(ValueError, match="full blocks"):
            router.route(NS, hash_blocks(prompt(1, 3), BS, NS), 10)
        with pytest.raises(ValueError, match="cache_weight"):
            PolicyConfig(cache_weight=-1)
        with pytest.raises(ValueError, match="already in the index"):
            router.add_worker("a")

    def test_candidates_read_as_records_compare_and_pickle(self):
        import pickle

        from router.policy import Candidate

        router, _ = make_router("a", "b")
        store_on(router, "a", prompt(1, 2))
        decision = route(router, prompt(1, 3))
        records = tuple(decision.candidates)
        assert all(isinstance(c, Candidate) for c in records) and len(decision.candidates) == 2
        assert decision.candidates[0] == records[0] and decision.candidates[-1:] == records[-1:]
        assert decision.candidates == records
        again = pickle.loads(pickle.dumps(decision))
        assert again == decision and tuple(again.candidates) == records
        with pytest.raises(AttributeError):
            decision.candidates._rows = ()  # noqa: SLF001 - immutability is the point

    def test_a_known_shared_prefix_stored_on_one_worker_is_weighted_there(self):
        # S (8 blocks, 128 tokens) is a known shared prefix stored on "a" only; the prompt adds 53
        # tokens of its own. "a" has 300 tokens queued. Its score: 300 + 181 - 128 = 353 at
        # weight 1, 353 - 3 x 128 = -31 at weight 4; the others' 181.
        workers = ("a", "b", "c")
        hashes = hash_blocks(prompt(3, 11), BS, NS)
        loads = [WorkerLoad("a", 300, 0), WorkerLoad("b", 0, 0), WorkerLoad("c", 0, 0)]

        def choose(weight: float, stored_on: tuple[str, ...]):
            query = RouteQuery(hashes, 11 * BS + 5, {"a": 8}, shared_blocks=8,
                               shared_stored_on=stored_on)
            return decide(PolicyConfig(shared_weight=weight), query, loads, block_size=BS, seed=7)

        weighted = choose(4.0, ("a",))
        homes = rendezvous(hashes[8], list(workers), 7, choices=2)  # the first unshared block
        reason = Reason.COLD_HASH if "a" in homes else Reason.COLD_SPILL
        assert (weighted.worker_id, weighted.reason) == ("a", reason)
        assert {c.worker_id: c.score for c in weighted.candidates} == {"a": -31, "b": 181, "c": 181}
        assert choose(1.0, ("a",)).worker_id != "a"
        # routed there but not yet stored (no event): no weight, so a burst still spreads
        assert choose(4.0, ()).worker_id != "a"
        # held by two workers: nothing is only a's, no weight
        query = RouteQuery(hashes, 11 * BS + 5, {"a": 8, "b": 8}, shared_blocks=8,
                           shared_stored_on=("a", "b"))
        two = decide(PolicyConfig(), query, loads, block_size=BS, seed=7)
        assert two.worker_id == "b"

    def test_the_index_names_a_blocks_holders_by_events_not_by_routing(self):
        from router.index import PrefixIndex

        index = PrefixIndex()
        for w in ("a", "b"):
            index.add_worker(w)
        hashes = hash_blocks(prompt(2, 2), BS, NS)
        index.note_routed("b", hashes, now=0.0)
        assert index.holders(hashes[1]) == []
        ledger = BlockLedger(10**9, 3600, lambda: 0.0, bytes_per_token=1)
        ledger.insert(hashes, BS, NS.label(), NS.root())
        index.apply(EventBatch("a", 0, tuple(ledger.drain_events())))
        assert index.holders(hashes[1]) == ["a"]


NS_TIERROUTING = Namespace("t", "m")

PROMPT = list(range(1, 16 * 4 + 5))  # 4 full blocks and a tail

H = hash_blocks(PROMPT, BS, NS_TIERROUTING)

def stored(h, i, tier=Tier.MEMORY):
    return BlockStored(h[i], h[i - 1] if i else NS_TIERROUTING.root(), BS, NS_TIERROUTING.label(), tier)

def spill_events() -> tuple:
    """w1 stores 4 blocks, then its memory evicts the last 3 to its disk."""
    events = [stored(H, i) for i in range(4)]
    for i in (3, 2, 1):
        events += [BlockRemoved(H[i], NS_TIERROUTING.label(), Tier.MEMORY), stored(H, i, Tier.DISK)]
    return tuple(events)

# 4,096 bytes per token read at 1 GiB/s takes 1/2**18 s; at 2**14 prefill tokens/s that is
# 2**-4 = 0.0625 tokens of prefill (powers of two: every figure below is exact)
RATES = WorkerRates(4096, float(2**30), float(2**14))


class TestTierRouting:
    def test_a_block_moved_to_disk_stays_held_and_is_counted_as_disk(self):
        index = PrefixIndex()
        index.add_worker("w0")
        index.add_worker("w1")
        index.apply(EventBatch("w0", 0, tuple(stored(H, i) for i in range(4))))
        index.apply(EventBatch("w1", 0, spill_events()))
        found = index.match(H, now=0.0)
        assert found.blocks == {"w0": 4, "w1": 4}
        assert found.disk_blocks == {"w1": 3}
        index.apply(EventBatch("w1", 1, (BlockRemoved(H[3], NS_TIERROUTING.label(), Tier.DISK),)))
        found = index.match(H, now=0.0)
        assert (found.blocks, found.disk_blocks) == ({"w0": 4, "w1": 3}, {"w1": 2})
        assert index.counters().unknown_block_removals == 0

    def test_rebuild_takes_both_tiers(self):
        index = PrefixIndex()
        index.add_worker("w0")
        index.rebuild("w0", H[:1], H[1:3])
        found = index.match(H, now=0.0)
        assert (found.blocks, found.disk_blocks) == ({"w0": 3}, {"w0": 2})

    def test_the_policy_charges_disk_tokens_their_load_time(self):
        router = Router(block_size=BS, clock=lambda: 0.0)
        router.add_worker("w0")
        router.add_worker("w1")
        router.apply_events(EventBatch("w0", 0, tuple(stored(H, i) for i in range(4))))
        router.apply_events(EventBatch("w1", 0, spill_events()))
        decision = router.route(NS_TIERROUTING, H, len(PROMPT))
        assert decision.worker_id == "w0"
        scores = {c.worker_id: c.score for c in decision.candidates}
        assert scores == {"w0": 4.0, "w1": 4.0 + DISK_TOKEN_COST * 3 * BS}
        assert PolicyConfig().disk_token_cost == DISK_TOKEN_COST

    def test_a_router_rebuilt_from_a_tiered_store_keeps_each_blocks_tier(self, tmp_path):
        """A store whose memory holds B and whose disk holds A: the holdings say so block by
        block, and a router rebuilt from them charges A's blocks as disk, as one fed by the
        store's events does."""
        from router.kv.key import hash_blocks as hashes
        from tests.support.prefix_stores import A, B, NS as SNS, spilled_a
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

    def test_a_restarted_worker_announces_its_whole_cache_on_disk(self, tmp_path):
        """After a restart every block is on disk only: the holdings have no memory blocks."""
        from router.kv.key import hash_blocks as hashes
        from tests.support.prefix_stores import A, B, NS as SNS, spilled_a, tiered
        from workers.engine.runtime import Holdings

        spilled_a(tmp_path).close()
        again = tiered(tmp_path / "w0")
        held = Holdings.of(0, again.holdings())
        assert held.blocks == ()
        assert sorted(held.disk_blocks) == sorted(hashes(A, 4, SNS) + hashes(B, 4, SNS))
        again.close()

    def test_a_measured_disk_costs_its_load_time_in_that_workers_prefill_tokens(self):
        assert disk_token_cost(RATES) == 0.0625
        assert disk_token_cost(WorkerRates(4096, float(2**28), float(2**14))) == 0.25
        router = Router(block_size=BS, clock=lambda: 0.0)
        router.add_worker("w0")
        router.add_worker("w1")
        router.apply_events(EventBatch("w0", 0, tuple(stored(H, i) for i in range(4))))
        router.apply_events(EventBatch("w1", 0, spill_events(), RATES))
        scores = {c.worker_id: c.score for c in router.route(NS_TIERROUTING, H, len(PROMPT)).candidates}
        assert scores == {"w0": 4.0, "w1": 4.0 + 0.0625 * 3 * BS}  # 7.0
        costs = {s.worker_id: s.disk_token_cost for s in router.workers()}
        assert costs == {"w0": None, "w1": 0.0625}

    def test_until_a_worker_has_measured_both_rates_the_default_cost_stands(self):
        for rates in (WorkerRates(4096, None, float(2**14)), WorkerRates(4096, float(2**30), None),
                      None):
            router = Router(block_size=BS, clock=lambda: 0.0)
            router.add_worker("w1")
            router.apply_events(EventBatch("w1", 0, spill_events(), rates))
            (candidate,) = router.route(NS_TIERROUTING, H, len(PROMPT)).candidates
            assert candidate.score == 4.0 - 63.0 * 64 + DISK_TOKEN_COST * 3 * BS
            assert router.workers()[0].disk_token_cost is None

    def test_workers_with_the_same_disk_holdings_rank_by_their_read_bandwidth(self):
        slow, fast = WorkerRates(4096, float(2**28), float(2**14)), RATES  # 0.25 and 0.0625
        for w0_rates, w1_rates, winner in ((slow, fast, "w1"), (fast, slow, "w0")):
            router = Router(block_size=BS, clock=lambda: 0.0)
            router.add_worker("w0")
            router.add_worker("w1")
            router.apply_events(EventBatch("w0", 0, spill_events(), w0_rates))
            router.apply_events(EventBatch("w1", 0, spill_events(), w1_rates))
            decision = router.route(NS_TIERROUTING, H, len(PROMPT))
            scores = {c.worker_id: c.score for c in decision.candidates}
            cost = {"w0": disk_token_cost(w0_rates), "w1": disk_token_cost(w1_rates)}
            assert scores == {w: 4.0 + cost[w] * 3 * BS for w in ("w0", "w1")}  # 16.0 and 7.0
            assert sorted(scores.values()) == [7.0, 16.0]
            assert decision.worker_id == winner

    def test_rates_travel_in_the_encoded_batch(self):
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

    def test_bad_rates_are_refused(self):
        with pytest.raises(ValueError, match="disk_bytes_per_token must be positive"):
            WorkerRates(0, 1.0, 1.0)
        with pytest.raises(ValueError, match="prefill_tokens_s must be positive or None"):
            WorkerRates(4096, 1.0, 0.0)
        with pytest.raises(ValueError, match="disk_read_bytes_s must be positive or None"):
            WorkerRates(4096, float("nan"), 1.0)

    def test_a_real_engines_measured_rates_reach_the_in_process_router(self, tmp_path):
        """A worker restarted on its disk directory holds two prompts there. The first request
        is costed at the default (nothing measured yet); it reads its prefix from disk and
        prefills the rest, and the second request's disk hit is costed at exactly the rates the
        engine measured."""
        import asyncio

        from cluster.backend.local import LocalBackend
        from tests.support.forged_models import tiny_model
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


class TestSessions:
    """A session key follows the worker it was routed to last, as the policy's tie-break."""

    def test_cold_prompts_of_one_session_stay_on_its_first_worker(self):
        router, _ = make_router("w0", "w1", "w2", "w3")
        prompts = [prompt(conv, 2) for conv in range(40, 48)]  # each cold, each its own home
        homes = {route(router, p).worker_id for p in prompts}
        assert len(homes) > 1  # without a session they spread
        router, _ = make_router("w0", "w1", "w2", "w3")
        first = router.route(NS, hash_blocks(prompts[0], BS, NS), len(prompts[0]), "s1")
        placed = {router.route(NS, hash_blocks(p, BS, NS), len(p), "s1").worker_id
                  for p in prompts[1:]}
        assert placed == {first.worker_id}

    def test_a_session_is_the_namespace_own(self):
        other = Namespace("beta", "tiny")
        for conv in range(50, 58):  # whichever worker acme's s1 went to, beta's s1 is new
            router, _ = make_router("w0", "w1", "w2", "w3")
            a, b = prompt(conv, 2), prompt(conv + 100, 2)
            router.route(NS, hash_blocks(a, BS, NS), len(a), "s1")
            fresh, _ = make_router("w0", "w1", "w2", "w3")
            assert (router.route(other, hash_blocks(b, BS, other), len(b), "s1").worker_id
                    == fresh.route(other, hash_blocks(b, BS, other), len(b)).worker_id)

    def test_a_longer_match_elsewhere_beats_the_session(self):
        router, _ = make_router("w0", "w1")
        held = prompt(60, 4)
        store_on(router, "w1", held)
        cold = prompt(61, 2)
        assert router.route(NS, hash_blocks(cold, BS, NS), len(cold), "s2").worker_id
        sticky = router.route(NS, hash_blocks(held, BS, NS), len(held), "s2")
        assert (sticky.worker_id, sticky.reason) == ("w1", Reason.PREFIX_MATCH)
