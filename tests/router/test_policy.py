"""router.policy.decide with exact scores: the load formula, the cap, affinity, the shared
prefix, the disk cost, tie order, the cold home's key and the cold-spill tolerance.

Block size 1 where the arithmetic is the point, so tokens and blocks are the same numbers.
Defaults: cache_weight 64 (a token only one worker holds is worth 63 extra), shared_weight 4
(3 extra), decode_weight_tokens 64, balance_weight 0.25, disk_token_cost 0.14.
"""
from __future__ import annotations

import re

import pytest

from router.kv.key import BlockHash
from router.pull_cost import LinkRate, PeerLinks, PullChoice
from router.policy import (Candidate, CandidateRows, NoWorkerAvailable, PolicyConfig, Reason, RouteQuery,
                           RoutingDecision, WorkerLoad, with_pull,
                           decide, rendezvous)

DEFAULT = PolicyConfig()


def idle(*ids: str) -> list[WorkerLoad]:
    return [WorkerLoad(w, 0, 0) for w in ids]


def chain(base: int, n: int) -> list[BlockHash]:
    return [BlockHash(base * 10 + i) for i in range(n)]


def scores(decision) -> dict[str, float]:
    return {c.worker_id: c.score for c in decision.candidates}


def test_config_rejects_negatives_by_name():
    for name in ("cache_weight", "cold_spill_tokens", "shared_weight", "decode_weight_tokens",
                 "balance_weight", "disk_token_cost"):
        with pytest.raises(ValueError, match=re.escape(f"PolicyConfig.{name} must be >= 0, got -1")):
            PolicyConfig(**{name: -1})
    with pytest.raises(ValueError, match=re.escape(
            "PolicyConfig.balance_half_life_s must be > 0 seconds, got 0")):
        PolicyConfig(balance_half_life_s=0)
    assert PolicyConfig(balance_half_life_s=0.5).balance_half_life_s == 0.5


def test_no_worker_is_a_clear_error():
    with pytest.raises(NoWorkerAvailable, match="^" + re.escape(
            "no worker is accepting requests: add a worker or retry") + "$"):
        decide(DEFAULT, RouteQuery(chain(1, 1), 16, {}), [], block_size=16, seed=0)


def test_candidate_rows_read_as_candidates():
    rows = (("a", 16, 3, 1.5), ("b", 0, 0, 7.0))
    compact = CandidateRows(rows)
    assert tuple(compact) == (Candidate("a", 16, 3, 1.5), Candidate("b", 0, 0, 7.0))
    assert hash(compact) == hash(rows) and compact == tuple(compact)
    assert repr(compact) == repr(tuple(compact))


def test_rendezvous_winners_are_pinned():
    """Routers that restart, or run side by side, must place a cold prefix alike."""
    workers = ["w0", "w1", "w2", "w3"]
    assert rendezvous(BlockHash(12345), workers, 7, 2) == ["w0", "w3"]
    assert rendezvous(BlockHash(12345), workers, -3, 1) == ["w0"]
    assert rendezvous(BlockHash(2**100 + 5), workers, -3, 4) == ["w0", "w1", "w3", "w2"]


def test_load_is_queue_plus_decodes_plus_recent_prefill_above_the_least():
    loads = [WorkerLoad("a", 100, 2, recent_prefill_tokens=40.0),
             WorkerLoad("b", 0, 0, recent_prefill_tokens=8.0)]
    q = RouteQuery(chain(1, 4), 64, {})
    d = decide(DEFAULT, q, loads, block_size=16, seed=0)
    assert [c.load_tokens for c in d.candidates] == [100 + 128 + 8, 0]  # 0.25 x (40 - 8)
    d = decide(DEFAULT, q, loads, block_size=16, seed=0, recent_scale=2.0)
    assert [c.load_tokens for c in d.candidates] == [100 + 128 + 16, 0]


def test_matched_tokens_stop_one_short_of_the_prompt():
    d = decide(DEFAULT, RouteQuery(chain(1, 2), 32, {"a": 2}), idle("a"), block_size=16, seed=0)
    assert d.expected_cached_tokens == 31 and d.reason is Reason.PREFIX_MATCH
    # alone, all 31 are its own: 32 - 31 - 63 x 31
    assert scores(d) == {"a": 32 - 31 - 63 * 31}
    d = decide(DEFAULT, RouteQuery(chain(1, 1), 1, {"a": 1}), idle("a"), block_size=16, seed=0)
    assert d.expected_cached_tokens == 0


def test_affinity_is_what_exceeds_the_second_best_match():
    d = decide(DEFAULT, RouteQuery(chain(1, 10), 10, {"a": 5, "b": 4}), idle("a", "b"),
               block_size=1, seed=0)
    assert scores(d) == {"a": 10 - 5 - 63 * 1, "b": 10 - 4}
    assert (d.worker_id, d.reason) == ("a", Reason.PREFIX_MATCH)


def test_a_held_shared_prefix_counts_only_beyond_the_second_best():
    q = RouteQuery(chain(1, 20), 20, {"a": 6, "b": 5}, shared_blocks=8, shared_stored_on=("a",))
    d = decide(DEFAULT, q, idle("a", "b"), block_size=1, seed=0)
    assert scores(d) == {"a": 20 - 6 - 3 * 1, "b": 20 - 5}   # held 6 - 5 = 1
    q = RouteQuery(chain(1, 20), 20, {"a": 12, "b": 5}, shared_blocks=8, shared_stored_on=("a",))
    d = decide(DEFAULT, q, idle("a", "b"), block_size=1, seed=0)
    # affinity 12 - 8 = 4; of the shared 8, held beyond the second best: 8 - 5 = 3
    assert scores(d) == {"a": 20 - 12 - 63 * 4 - 3 * 3, "b": 20 - 5}


def test_disk_only_tokens_cost_their_load_time():
    q = RouteQuery(chain(1, 6), 100, {"a": 3}, disk_blocks={"a": 2})
    d = decide(DEFAULT, q, idle("a", "b"), block_size=16, seed=0)
    assert scores(d) == {"a": pytest.approx(100 - 48 - 63 * 48 + 0.14 * 32), "b": 100}


def test_equal_scores_go_to_the_worker_that_matched_more():
    config = PolicyConfig(cache_weight=1)
    loads = [WorkerLoad("a", 10, 0), WorkerLoad("b", 5, 0), WorkerLoad("c", 0, 0)]
    d = decide(config, RouteQuery(chain(1, 100), 100, {"a": 10, "b": 5}), loads,
               block_size=1, seed=0)
    assert set(scores(d).values()) == {100}
    assert (d.worker_id, d.reason) == ("a", Reason.PREFIX_MATCH)


def test_a_cold_prompt_is_homed_by_its_first_unshared_block():
    hashes = chain(1001, 3)
    ids = ["w0", "w1", "w2"]
    home = rendezvous(hashes[2], ids, 0, 2)[0]
    assert home != rendezvous(hashes[1], ids, 0, 2)[0]  # so the key's index shows
    d = decide(DEFAULT, RouteQuery(hashes, 48, {}, shared_blocks=2), idle(*ids),
               block_size=16, seed=0)
    assert (d.worker_id, d.reason) == (home, Reason.COLD_HASH)
    # a prompt all shared (up to its last token): the last block is the key
    d = decide(DEFAULT, RouteQuery(hashes[:2], 33, {}, shared_blocks=2), idle(*ids),
               block_size=16, seed=0)
    assert d.worker_id == rendezvous(hashes[1], ids, 0, 2)[0]


def test_a_cold_home_keeps_the_prompt_up_to_its_own_new_prefill_of_extra_load():
    hashes = chain(1001, 3)
    first, second = rendezvous(hashes[2], ["w0", "w1", "w2"], 0, 2)
    other = ({"w0", "w1", "w2"} - {first, second}).pop()
    q = RouteQuery(hashes, 48, {}, shared_blocks=2)  # tolerance: 48 - 32 = 16 tokens

    def routed(extra: int):
        loads = [WorkerLoad(w, 0 if w == other else extra, 0) for w in ("w0", "w1", "w2")]
        d = decide(DEFAULT, q, loads, block_size=16, seed=0)
        return d.worker_id, d.reason

    assert routed(16) == (first, Reason.COLD_HASH)
    assert routed(17) == (other, Reason.COLD_SPILL)


class TestSessionTieBreak:
    """Step 5: a session's worker breaks ties only, never beating a longer cached match."""

    def test_equal_scores_and_matches_go_to_the_session_worker(self):
        query = RouteQuery(chain(3, 8), 8, {"a": 4, "b": 4, "c": 6})
        loads = [WorkerLoad("a", 2, 0), WorkerLoad("b", 2, 0), WorkerLoad("c", 500, 0)]
        without = decide(DEFAULT, query, loads, block_size=1, seed=0)
        assert (without.worker_id, scores(without)["a"], scores(without)["b"]) == ("a", 6.0, 6.0)
        with_key = decide(DEFAULT, RouteQuery(chain(3, 8), 8, {"a": 4, "b": 4, "c": 6},
                                              session_worker="b"), loads, block_size=1, seed=0)
        assert (with_key.worker_id, with_key.reason) == ("b", Reason.LOAD_SPILL)

    def test_a_longer_match_elsewhere_wins_over_the_session_worker(self):
        query = RouteQuery(chain(4, 8), 8, {"a": 6, "b": 2}, session_worker="b")
        decision = decide(DEFAULT, query, idle("a", "b"), block_size=1, seed=0)
        assert (decision.worker_id, decision.reason) == ("a", Reason.PREFIX_MATCH)

    def test_a_cold_prompt_goes_to_the_session_worker_not_its_hash_home(self):
        ids = ("a", "b", "c", "d")
        hashes = chain(5, 8)
        home = decide(DEFAULT, RouteQuery(hashes, 8, {}), idle(*ids), block_size=1, seed=0)
        other = next(w for w in ids if w != home.worker_id)
        sticky = decide(DEFAULT, RouteQuery(hashes, 8, {}, session_worker=other), idle(*ids),
                        block_size=1, seed=0)
        assert (sticky.worker_id, sticky.reason) == (other, Reason.COLD_HASH)

    def test_a_cold_session_worker_still_spills_past_the_tolerance(self):
        query = RouteQuery(chain(6, 8), 8, {}, session_worker="a")
        loads = [WorkerLoad("a", 100, 0), WorkerLoad("b", 0, 0)]
        decision = decide(DEFAULT, query, loads, block_size=1, seed=0)
        assert (decision.worker_id, decision.reason) == ("b", Reason.COLD_SPILL)

    def test_a_session_worker_that_is_not_a_candidate_changes_nothing(self):
        hashes = chain(7, 8)
        plain = decide(DEFAULT, RouteQuery(hashes, 8, {}), idle("a", "b"), block_size=1, seed=0)
        gone = decide(DEFAULT, RouteQuery(hashes, 8, {}, session_worker="z"), idle("a", "b"),
                      block_size=1, seed=0)
        assert gone.worker_id == plain.worker_id


class TestAPullInTheDecision:
    """``with_pull`` on a decision, exactly: a busy holder's whole prompt pulled to an idle
    worker, and a receiver whose running decodes weigh more than the holder's queue left be."""

    BS = 16
    PROMPT = 160  # ten full blocks, all held by w0
    LINKS = PeerLinks(1000, LinkRate(1e9, 0.001))

    def decision(self) -> RoutingDecision:
        candidates = (Candidate("w0", 160, 10_000, 10_000.0), Candidate("w1", 0, 0, 160.0))
        return RoutingDecision("w0", Reason.PREFIX_MATCH, 159, self.PROMPT, candidates)

    def test_the_prompt_is_pulled_and_one_token_is_left_to_compute(self):
        decision = self.decision()
        loads = [WorkerLoad("w0", 10_000, 0), WorkerLoad("w1", 0, 2)]
        pulled = with_pull(PolicyConfig(), decision, loads, self.LINKS, {}, self.BS)
        assert pulled == RoutingDecision(
            "w1", Reason.LOAD_SPILL, 159, 160, decision.candidates,
            PullChoice("w0", 10, 160, pytest.approx(0.001 + 160 * 1000 / 1e9)))

    def test_running_decodes_count_in_the_receivers_queue(self):
        decision = self.decision()
        loads = [WorkerLoad("w0", 10_000, 0), WorkerLoad("w1", 0, 200)]  # 200 x 64 > 10,000
        assert with_pull(PolicyConfig(), decision, loads, self.LINKS, {}, self.BS) is decision
