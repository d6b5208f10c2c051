"""Router: decisions as data, load accounting, churn, restart rebuild, errors."""
import pytest

from router.kv.events import EventBatch, decode_batch, encode_batch
from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import BlockLedger
from router.policy import (NoWorkerAvailable, PolicyConfig, Reason, RouteQuery, WorkerLoad,
                           decide, rendezvous)
from router.router import Router
from tests.conftest import Clock

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


def test_a_held_prefix_wins_and_the_decision_is_data():
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


def test_event_batches_decoded_from_msgpack_are_applied():
    router, _ = make_router("a", "b")
    ledger = BlockLedger(10**9, 3600, lambda: 0.0, bytes_per_token=1)
    ledger.insert(hash_blocks(prompt(2, 3), BS, NS), BS, NS.label(), NS.root())
    encoded = encode_batch(EventBatch("a", 0, tuple(ledger.drain_events())))
    router.apply_events(decode_batch(encoded))
    assert route(router, prompt(2, 3)).worker_id == "a"


def test_an_overloaded_home_spills_to_the_cheapest_worker():
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


def test_recent_work_steers_cold_prompts_to_the_less_worked_worker():
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


def test_a_burst_on_a_new_prefix_lands_together_before_any_event():
    router, _ = make_router(*[f"w{i}" for i in range(6)], cold_spill_tokens=10**6)
    first = route(router, prompt(5, 8))
    assert first.reason is Reason.COLD_HASH
    router.started("r0", first)
    siblings = [route(router, prompt(5, 8)[: 8 * BS] + [1, 2, 3]) for _ in range(3)]
    assert {d.worker_id for d in siblings} == {first.worker_id}
    assert all(d.reason is Reason.PREFIX_MATCH for d in siblings)


def test_new_conversations_on_a_known_shared_prefix_spread_by_load():
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


def test_a_cold_prompt_takes_the_less_busy_of_its_two_hash_homes():
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


def test_cold_placement_is_deterministic_per_seed_and_spreads():
    homes = set()
    for conv in range(40):
        a, _ = make_router("a", "b", "c", "d")
        b, _ = make_router("a", "b", "c", "d")
        da, db = route(a, prompt(conv, 2)), route(b, prompt(conv, 2))
        assert da.worker_id == db.worker_id and da.reason is Reason.COLD_HASH
        homes.add(da.worker_id)
    assert homes == {"a", "b", "c", "d"}


def test_load_accounting_follows_a_request_through_its_life():
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


def test_no_workers_or_all_draining_is_a_clear_error():
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


def test_removed_worker_is_forgotten_and_its_tickets_dropped():
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


def test_a_restarted_router_rebuilds_from_the_workers_holdings():
    router, _ = make_router("a", "b")
    ledger = store_on(router, "b", prompt(3, 5))
    fresh, clock = make_router("a", "b")
    assert route(fresh, prompt(3, 5)).expected_cached_tokens == 0
    clock.now = 60.0  # that decision's pending entry has expired
    fresh.rebuild("b", [h.block for h in ledger.holdings()])
    decision = route(fresh, prompt(3, 5))
    assert decision.worker_id == "b" and decision.expected_cached_tokens == 5 * BS


def test_short_prompts_and_bad_input():
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


def test_candidates_read_as_records_compare_and_pickle():
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


def test_a_known_shared_prefix_stored_on_one_worker_is_weighted_there():
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


def test_the_index_names_a_blocks_holders_by_events_not_by_routing():
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
