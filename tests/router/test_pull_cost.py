"""Pulls in the routing decision (``router.pull_cost``, ``router.policy.with_pull``): a pull
chosen when it beats waiting at a busy holder, recompute or waiting when the link is too
slow, each pair's link as its receiver reported it, a holder serving a pull no source of
another, exact predicted times."""
from __future__ import annotations

import pytest

from router.kv.events import EventBatch, LinkMeasure, WorkerRates
from router.kv.key import Namespace, hash_blocks
from router.kv.ledger import BlockLedger
from router.policy import Reason, RoutingDecision
from router.pull_cost import (HOLDER_SLOWDOWN_BOUND, MAX_PULLS_PER_SOURCE, PULL_TPOT_COST,
                               LinkRate, PeerLinks, PullChoice, Row, best_pull, observed)
from router.router import Router
from tests.conftest import Clock

NS = Namespace("acme", "tiny")
BS = 16
PROMPT = list(range(10 * BS + 5))   # 10 full blocks and 5 tokens
BYTES_PER_TOKEN = 1000


def _router(link: LinkRate | None, *workers: str) -> Router:
    links = None if link is None else PeerLinks(BYTES_PER_TOKEN, link)
    router = Router(BS, clock=Clock(), seed=7, links=links)
    for w in workers:
        router.add_worker(w)
    return router


def _hold(router: Router, worker: str, tokens, rates: WorkerRates | None = None) -> None:
    ledger = BlockLedger(10**9, 3600, lambda: 0.0, bytes_per_token=1)
    ledger.insert(hash_blocks(tokens, BS, NS), BS, NS.label(), NS.root())
    router.apply_events(EventBatch(worker, 1, tuple(ledger.drain_events()), rates))


def _busy(router: Router, worker: str, tokens: int) -> None:
    router.started(f"queued-{worker}", RoutingDecision(worker, Reason.PREFIX_MATCH, 0, tokens,
                                                       ()))


def _route(router: Router):
    return router.route(NS, hash_blocks(PROMPT, BS, NS), len(PROMPT))


def test_a_busy_holders_prefix_is_pulled_to_an_idle_worker():
    router = _router(LinkRate(1e6, 0.01), "a", "b")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    decision = _route(router)
    # on a: 5000 queued + 5 to prefill = 5005 (its balance term is no wait);
    # on b: 5 + (0.01 + 160 x 1000 / 1e6) x 6000 = 1025
    assert (decision.worker_id, decision.reason) == ("b", Reason.LOAD_SPILL)
    assert decision.pull == PullChoice("a", 10, 160, pytest.approx(0.17))
    assert decision.expected_cached_tokens == 160


def test_a_link_too_slow_leaves_the_request_at_its_holder():
    router = _router(LinkRate(1e5, 0.01), "a", "b")   # 1.61 s: 9660 tokens of prefill on b
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    decision = _route(router)
    assert (decision.worker_id, decision.pull) == ("a", None)


def test_recompute_wins_over_a_slow_pull_when_the_holder_is_swamped():
    router = _router(LinkRate(1e5, 0.01), "a", "b")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 50_000)
    decision = _route(router)
    assert (decision.worker_id, decision.pull, decision.expected_cached_tokens) == ("b", None, 0)


def test_an_idle_holder_keeps_its_request_whatever_it_prefilled_lately():
    router = _router(LinkRate(1e9, 0.002), "a", "b")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    router.finished("queued-a")   # its queue is empty again; its recent prefill stays
    decision = _route(router)
    assert (decision.worker_id, decision.reason, decision.pull) == ("a", Reason.PREFIX_MATCH,
                                                                    None)


def test_without_links_the_router_never_plans_a_pull():
    router = _router(None, "a", "b")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    assert _route(router).pull is None


def test_a_measured_link_and_prefill_rate_replace_the_defaults():
    router = _router(LinkRate(1e6, 0.01), "a", "b")
    _hold(router, "a", PROMPT)
    _hold(router, "b", [], WorkerRates(1, None, 60_000.0))   # b prefills 10x faster
    _busy(router, "a", 5000)
    # on b: 5 + 0.17 x 60000 = 10205 > 5005 on a: the pull no longer wins
    decision = _route(router)
    assert (decision.worker_id, decision.pull) == ("a", None)


def test_a_workers_reported_links_are_its_pairs_rates():
    router = _router(LinkRate(1e6, 0.01), "a", "b")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    # b measured its link from a at 1e8 bytes/s and 1 ms: 0.001 + 0.0016 s for 160 tokens
    router.apply_events(EventBatch("b", 1, (), None, (LinkMeasure("a", 1e8, 0.001),
                                                      LinkMeasure("gone", 1e9, 0.0))))
    assert router.links.links() == {("a", "b"): LinkRate(1e8, 0.001)}   # "gone": no worker
    assert router.links.rate("b", "a") == LinkRate(1e6, 0.01)   # each direction its own
    assert _route(router).pull == PullChoice("a", 10, 160, pytest.approx(0.0026))
    router.remove_worker("a")
    assert router.links.links() == {}


def test_links_follow_their_pulls_bandwidth_and_fixed_cost():
    start = LinkRate(1e6, 0.01)
    large = observed(start, 1 << 20, 1.01)    # large: bandwidth 1 MiB in 1.0 s
    assert (large.bytes_s, large.fixed_s) == (pytest.approx(0.7e6 + 0.3 * (1 << 20)), 0.01)
    small = observed(start, 1000, 0.02)       # small: fixed 0.02 - 0.001 s
    assert (small.bytes_s, small.fixed_s) == (1e6, pytest.approx(0.7 * 0.01 + 0.3 * 0.019))
    assert observed(start, 2 << 20, 0.015).bytes_s == pytest.approx(   # faster than its fixed
        0.7e6 + 0.3 * (2 << 20) / 0.0075)                                # cost: half its time
    assert observed(start, 0, 0.5) == observed(start, 1000, 0.0) == start   # nothing learnt


def test_the_source_is_the_longest_match_then_the_less_loaded():
    links = PeerLinks(BYTES_PER_TOKEN, LinkRate(1e9, 0.0))
    rows = [Row("a", 160, 9000), Row("b", 160, 8000), Row("c", 0, 0)]
    worker, pull = best_pull(rows, "b", 165, BS, links, {})
    assert (worker, pull.source, pull.blocks, pull.tokens) == ("c", "b", 10, 160)
    assert pull.predicted_s == pytest.approx(160 * 1000 / 1e9)
    assert best_pull([Row("a", 160, 0), Row("b", 150, 0)], "a", 165, BS, links, {}) is None


def test_a_link_refuses_impossible_rates():
    with pytest.raises(ValueError, match="bytes_s > 0"):
        LinkRate(0, 0.1)
    with pytest.raises(ValueError, match="bytes_per_token must be positive"):
        PeerLinks(0)


def test_the_bound_on_a_holders_slowdown_allows_one_pull_at_a_time():
    # floor((1.10 - 1) / 0.085): a second pull would slow its decodes by 1.17
    assert (PULL_TPOT_COST, HOLDER_SLOWDOWN_BOUND, MAX_PULLS_PER_SOURCE) == (0.085, 1.10, 1)


def test_a_holder_serving_a_pull_is_no_source_until_that_request_prefills():
    router = _router(LinkRate(1e8, 0.001), "a", "b", "c")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    first = _route(router)
    # 0.001 + 160 x 1000 / 1e8 = 0.0026 s
    assert (first.worker_id, first.pull) == ("b", PullChoice("a", 10, 160,
                                                             pytest.approx(0.0026)))
    router.started("r1", first)
    assert router.pulls_served() == {"a": 1}
    _busy(router, "b", 5000)   # b now holds the prefix (routed there) behind a queue too
    # a and b match 160 each; a's queue is the shorter (5000 against 5005), but a serves a
    # pull already: the source is b. On c: 5 + 0.0026 x 6000 = 20.6, against 165 recomputed
    second = _route(router)
    assert (second.worker_id, second.pull) == ("c", PullChoice("b", 10, 160,
                                                               pytest.approx(0.0026)))
    router.prefilled("r1")
    assert router.pulls_served() == {}   # its pull is over: a may serve another


def test_no_pull_is_planned_when_every_holder_serves_one_already():
    router = _router(LinkRate(1e6, 0.01), "a", "b", "c")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    router.started("r1", RoutingDecision("c", Reason.LOAD_SPILL, 160, len(PROMPT), (),
                                         PullChoice("a", 10, 160, 0.17)))
    decision = _route(router)
    assert (decision.worker_id, decision.pull) == ("a", None)   # waits at its holder
    router.finished("r1")                                        # ended before its first token
    assert _route(router).pull == PullChoice("a", 10, 160, pytest.approx(0.17))


def test_a_receiver_that_leaves_frees_its_sources_pull():
    router = _router(LinkRate(1e6, 0.01), "a", "b")
    _hold(router, "a", PROMPT)
    _busy(router, "a", 5000)
    router.started("r1", _route(router))
    assert router.pulls_served() == {"a": 1}
    router.remove_worker("b")
    assert router.pulls_served() == {}
    router.finished("r1")   # its ticket went with b
    assert router.unknown_tickets == 1
    assert best_pull([Row("a", 160, 0, pulls_served=1), Row("b", 0, 0)], "a", 165, BS,
                     PeerLinks(BYTES_PER_TOKEN), {}) is None
