"""The simulator's policies by name (``router.sim.policies``): orchard's ``Router`` on the
simulated clock, round robin and power of two; the peers' baselines are
``tests/router/sim/test_peers.py``'s, their figures on traces ``test_simulator.py``'s."""
from __future__ import annotations

import pytest

from router.kv.events import EventBatch
from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import BlockLedger
from router.policy import Reason
from router.sim.peers import DynamoKv, PrefixHash
from router.sim.policies import (POLICY_NAMES, OrchardPolicy, PowerOfTwo, RoundRobin,
                                 make_policy)
from router.sim.base import SimRequest

BS = 4
TRACE = Namespace("trace", "trace")  # the namespace the simulated router keys its blocks in
WORKERS = ["w0", "w1", "w2"]


def _request(rid: int, tokens: list[int]) -> SimRequest:
    return SimRequest(rid, len(tokens), 4, tuple(hash_blocks(tokens, BS, TRACE)))


class TestPoliciesByName:
    def test_every_name_and_orchard_first(self):
        assert POLICY_NAMES == ("orchard", "round_robin", "power_of_two",
                                "sglang_gateway_cache_aware", "sglang_router_cache_aware",
                                "dynamo_kv", "ray_prefix_affinity", "prefix_hash")

    @pytest.mark.parametrize("name, kind", [("orchard", OrchardPolicy), ("round_robin", RoundRobin),
                                            ("power_of_two", PowerOfTwo),
                                            ("dynamo_kv", DynamoKv), ("prefix_hash", PrefixHash)])
    def test_a_name_makes_its_policy_over_the_workers(self, name, kind):
        policy = make_policy(name, WORKERS, BS, seed=1)
        assert type(policy) is kind and policy.workers == WORKERS and policy.name == name

    def test_an_unknown_name_lists_the_choices(self):
        with pytest.raises(ValueError) as refused:
            make_policy("fastest", WORKERS, BS, seed=1)
        assert str(refused.value) == (
            "unknown policy 'fastest': choose from orchard, round_robin, power_of_two, "
            "sglang_gateway_cache_aware, sglang_router_cache_aware, dynamo_kv, "
            "ray_prefix_affinity, prefix_hash")


class TestTheSimpleBaselines:
    def test_round_robin_takes_the_workers_in_turn(self):
        policy = RoundRobin(WORKERS, BS, seed=1)
        assert [policy.choose(_request(i, [i]), 0.0) for i in range(4)] == [
            "w0", "w1", "w2", "w0"]

    def test_power_of_two_sends_to_the_one_with_fewer_in_flight(self):
        policy = PowerOfTwo(["w0", "w1"], BS, seed=1)
        policy.in_flight.update(w0=3, w1=0)
        assert {policy.choose(_request(i, [i]), 0.0) for i in range(20)} == {"w1"}
        policy.in_flight.update(w0=0, w1=3)
        assert {policy.choose(_request(i, [i]), 0.0) for i in range(20)} == {"w0"}

    def test_power_of_two_over_one_worker_sends_to_it(self):
        assert PowerOfTwo(["w0"], BS, seed=1).choose(_request(0, [1]), 0.0) == "w0"


class TestOrchardOnTheSimulatedClock:
    def _holding(self, worker: str, tokens: list[int]) -> EventBatch:
        ledger = BlockLedger(10**9, 3600, lambda: 0.0, bytes_per_token=1)
        ledger.insert(hash_blocks(tokens, BS, TRACE), BS, TRACE.label(), TRACE.root())
        return EventBatch(worker, 1, tuple(ledger.drain_events()))

    def test_a_worker_holding_the_prefix_gets_it_and_the_reason_is_counted(self):
        policy = OrchardPolicy(WORKERS, BS, seed=1)
        prompt = list(range(1, 17))  # four blocks
        policy.on_events(self._holding("w2", prompt))
        request = _request(7, prompt + [99])
        assert policy.choose(request, 5.0) == "w2"
        assert policy.planned_pull() is None  # no links: no pull is ever planned
        policy.started(request, "w2", 5.0)
        assert policy.reasons == {Reason.PREFIX_MATCH.value: 1}
        assert policy.index_dropped() == 0

    def test_started_must_follow_choose_for_the_same_worker(self):
        policy = OrchardPolicy(WORKERS, BS, seed=1)
        request = _request(1, list(range(8)))
        with pytest.raises(RuntimeError, match=r"started\(\) must follow choose\(\) for the "
                                               r"same request"):
            policy.started(request, "w0", 0.0)
        chosen = policy.choose(request, 0.0)
        other = next(w for w in WORKERS if w != chosen)
        with pytest.raises(RuntimeError, match="must follow choose"):
            policy.started(request, other, 0.0)
        policy.started(request, chosen, 0.0)
        with pytest.raises(RuntimeError, match="must follow choose"):
            policy.started(request, chosen, 0.0)  # one start per choice
