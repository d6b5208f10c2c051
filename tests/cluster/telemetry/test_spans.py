"""The spans of a request (``cluster.telemetry.spans``): the trace tree, its shape and what
each span says.

From typed engine and router data: a hit, a miss, a near miss (the decoded divergence), a
request routed away from its prefix, a prefix pulled from a peer, a TTL expiry. With the real
engine (a tiny forged model) and the real router: the same, and a tenant boundary. With a
memory and a disk tier: the request and lookup spans name the tier that served. Then the
helpers one at a time: a disconnect, a job's span, the prompt's block hashes.
"""
import dataclasses
import random

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.telemetry import attrs as A
from cluster.telemetry import spans
from router.attribution import MissCause, ServedTier
from router.kv.key import hash_blocks
from router.policy import Reason
from router.pull_cost import PullChoice
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.request_traces import (BS, NS, SYSTEM, assert_shape, observed, run,
                                          tiered_cluster, tree)
from tests.support.telemetry_factories import T0, decision, in_memory, result
from tests.support.traced_cluster import TracedCluster, Turn
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams


@pytest.fixture
def setup(tmp_path):
    return observed(tmp_path)


class TestTheRequestTrace:
    def test_miss_then_hit(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (1, 2)
        # 18 prompt tokens: 4 full blocks after prefill, then a block of 2 prompt + 2 output.
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 18, {"w0": 0, "w1": 0}),
            result("r1", 18, 0, 20, "w0", LookupOutcome.MISS))
        clock.now = 10.0
        run(observer, tel, "r2", prompt, decision("w0", Reason.PREFIX_MATCH, 16, 18, {"w0": 16, "w1": 0}),
            result("r2", 18, 16, 0, "w0", LookupOutcome.HIT, age=10.0))
        root, by_name = tree(exporter, "r1")
        assert_shape(root, by_name)
        a = root.attributes
        assert a[A.GEN_AI_INPUT_TOKENS] == 18 and a[A.GEN_AI_CACHE_READ] == 0
        assert a[A.GEN_AI_CACHE_WRITE] == a[A.GEN_AI_CACHE_CREATION] == 18
        assert a[A.MISS_CAUSE] == "first_sight" and a[A.CACHE_OUTCOME] == "miss"
        assert a[A.COST_MEASURED_M] == pytest.approx(1.25)
        assert a[A.COST_FORECAST_ERROR] == pytest.approx(0.0)
        assert by_name["orchard.cache.lookup"].attributes[A.CACHE_OUTCOME] == "miss"
        route = by_name["orchard.route"]
        assert route.attributes[A.ROUTE_REASON] == "cold_hash"
        assert [e.attributes[A.CANDIDATE_WORKER] for e in route.events] == ["w0", "w1"]

        root, by_name = tree(exporter, "r2")
        assert_shape(root, by_name)
        assert A.MISS_CAUSE not in root.attributes
        assert root.attributes[A.COST_MEASURED_M] == pytest.approx((2 + 0.1 * 16) / 18)
        lookup = by_name["orchard.cache.lookup"].attributes
        assert lookup[A.CACHE_OUTCOME] == "hit" and lookup[A.CACHE_ENTRY_AGE_S] == 10.0
        assert by_name["orchard.prefill"].attributes[A.PREFILL_TOKENS] == 2

    def test_drafted_and_accepted_tokens_on_the_request_and_decode_spans(self, setup):
        tel, exporter, _, observer, _ = setup
        res = dataclasses.replace(result("r1", 18, 0, 16, "w0", LookupOutcome.MISS, outputs=9),
                                  drafted_tokens=7, accepted_tokens=5)
        run(observer, tel, "r1", SYSTEM + (1, 2),
            decision("w0", Reason.COLD_HASH, 0, 18, {"w0": 0}), res)
        root, by_name = tree(exporter, "r1")
        for attrs in (root.attributes, by_name["orchard.decode"].attributes):
            assert (attrs[A.SPEC_DRAFTED], attrs[A.SPEC_ACCEPTED]) == (7, 5)
        assert A.SPEC_DRAFTED == "orchard.spec.drafted_tokens"
        assert A.SPEC_ACCEPTED == "orchard.spec.accepted_tokens"

    def test_near_miss_carries_the_divergence(self, setup):
        tel, exporter, _, observer, clock = setup
        run(observer, tel, "r1", SYSTEM + (1,), decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        drifted = SYSTEM[:10] + (7,) + SYSTEM[11:] + (1,)
        decode = lambda ids: " ".join(f"t{i}" for i in ids)
        run(observer, tel, "r2", drifted, decision("w0", Reason.PREFIX_MATCH, 8, 17, {"w0": 8}),
            result("r2", 17, 8, 8, "w0", LookupOutcome.NEAR_MISS, common=10, next_prompt=7,
                   next_stored=110), decode)
        root, by_name = tree(exporter, "r2")
        assert root.attributes[A.MISS_CAUSE] == "near_miss"
        lookup = by_name["orchard.cache.lookup"].attributes
        assert lookup[A.CACHE_LINE] == "common=10 of 17"
        assert (lookup[A.CACHE_NEXT_PROMPT_TOKEN], lookup[A.CACHE_NEXT_STORED_TOKEN]) == (7, 110)
        assert lookup[A.DIVERGENCE_BEFORE].endswith("t108 t109")
        assert lookup[A.DIVERGENCE_PROMPT].startswith("t7 t111")
        assert lookup[A.DIVERGENCE_STORED] == "t110"

    def test_routed_away_from_the_holder(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w1", Reason.COLD_HASH, 0, 17, {"w1": 0}),
            result("r1", 17, 0, 16, "w1", LookupOutcome.MISS))
        run(observer, tel, "r2", prompt,
            decision("w0", Reason.LOAD_SPILL, 0, 17, {"w0": 0, "w1": 16}),
            result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
        root, by_name = tree(exporter, "r2")
        assert root.attributes[A.MISS_CAUSE] == "routed_elsewhere"
        assert root.attributes[A.MISS_HOLDER] == "w1"
        assert by_name["orchard.route"].attributes[A.ROUTE_REASON] == "load_spill"
        matched = {e.attributes[A.CANDIDATE_WORKER]: e.attributes[A.CANDIDATE_MATCHED]
                   for e in by_name["orchard.route"].events}
        assert matched == {"w0": 0, "w1": 16}

    def test_a_pulled_prefix_in_the_routing_span_and_the_miss_cause(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        planned = dataclasses.replace(
            decision("w1", Reason.LOAD_SPILL, 16, 17, {"w0": 16, "w1": 0}),
            pull=PullChoice("w0", 4, 16, 0.25))
        res = result("r2", 17, 16, 0, "w1", LookupOutcome.HIT)
        info = spans.RequestInfo("r2", NS.tenant, NS.model, job_id="job-1")
        with observer.request(info) as span:
            request = GenerateRequest("r2", NS, prompt, SamplingParams(4),
                                      trace_context=observer.context())
            observer.routed(planned, T0, T0 + 1000)
            spans.record_engine(tel, request, res)
            observer.finish(span, request, hash_blocks(prompt, BS, NS), res, planned, 1,
                            spans.PulledPrefix("w0", 32, "block 1: corrupted in transit"))
        root, by_name = tree(exporter, "r2")
        route = by_name["orchard.route"].attributes
        assert (route[A.ROUTE_PULL_FROM], route[A.ROUTE_PULL_TOKENS],
                route[A.ROUTE_PULL_PREDICTED_S]) == ("w0", 16, 0.25)
        assert root.attributes[A.MISS_CAUSE] == "pulled_from_peer"
        assert root.attributes[A.MISS_HOLDER] == "w0"
        assert root.attributes[A.CACHE_PULLED_TOKENS] == 16   # of 32 pulled, 16 read
        assert root.attributes[A.PULL_REFUSED] == "block 1: corrupted in transit"
        assert root.attributes[A.GEN_AI_CACHE_READ] == 16   # priced as cache reads
        first_root, first = tree(exporter, "r1")
        assert A.ROUTE_PULL_FROM not in first["orchard.route"].attributes
        assert first_root.attributes[A.CACHE_PULLED_TOKENS] == 0
        assert A.PULL_REFUSED not in first_root.attributes

    def test_ttl_expiry(self, setup):
        tel, exporter, _, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        clock.now = 301.0
        run(observer, tel, "r2", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
        root, by_name = tree(exporter, "r2")
        assert root.attributes[A.MISS_CAUSE] == "ttl_expired"
        assert by_name["orchard.cache.lookup"].attributes[A.CACHE_TTL_S] == 300.0


@pytest.fixture
def cluster(tmp_path):
    tel, exporter, _ = in_memory(tmp_path)
    clock = Clock(1000.0)
    tc = TracedCluster(tiny_model("llama"), 2, tel, block_size=16, ttl_s=300.0, clock=clock)
    rng = random.Random(7)
    prompt = tuple(rng.randrange(tc.engine().vocab_size) for _ in range(70))
    return tc, exporter, clock, prompt


def trace_of(exporter, request_id):
    finished = exporter.get_finished_spans()
    root = next(s for s in finished if s.attributes.get(A.REQUEST_ID) == request_id
                and s.attributes[A.SPAN_KIND] == "request")
    mine = {s.attributes[A.SPAN_KIND]: s for s in finished
            if s.context.trace_id == root.context.trace_id}
    assert sorted(mine) == ["decode", "lookup", "prefill", "request", "route", "worker"]
    assert mine["route"].parent.span_id == root.context.span_id
    assert mine["worker"].parent.span_id == root.context.span_id
    for kind in ("lookup", "prefill", "decode"):
        assert mine[kind].parent.span_id == mine["worker"].context.span_id
    assert mine["lookup"].end_time <= mine["prefill"].end_time <= mine["decode"].end_time
    return {k: dict(v.attributes) for k, v in mine.items()}, mine["route"]


class TestTheTraceOfARealEngine:
    def test_miss_then_hit(self, cluster):
        tc, exporter, clock, prompt = cluster
        tc.run(Turn("a", "acme", prompt, 4))
        tc.run(Turn("b", "acme", prompt, 4))
        miss, _ = trace_of(exporter, "a")
        assert miss["request"][A.MISS_CAUSE] == "first_sight"
        assert miss["lookup"][A.CACHE_OUTCOME] == "miss"
        assert miss["request"][A.GEN_AI_CACHE_WRITE] == 64 and miss["request"][A.GEN_AI_CACHE_READ] == 0
        hit, route = trace_of(exporter, "b")
        assert A.MISS_CAUSE not in hit["request"]
        assert hit["lookup"][A.CACHE_OUTCOME] == "hit" and hit["lookup"][A.CACHE_MATCHED] == 64
        # past the store's 4 blocks, a's kept cache gives the prompt but its last token
        assert hit["lookup"][A.CACHE_KEPT_TOKENS] == 5
        assert hit["request"][A.GEN_AI_INPUT_TOKENS] == 70
        assert hit["request"][A.GEN_AI_CACHE_READ] == 69
        assert hit["prefill"][A.PREFILL_TOKENS] == 1
        assert hit["request"][A.COST_MEASURED_M] == pytest.approx((1 + 0.1 * 69) / 70)
        # the router forecast the store's blocks only: 64 cached, 6 computed
        assert hit["request"][A.COST_FORECAST_ERROR] == pytest.approx(
            (6 + 0.1 * 64) / 70 - (1 + 0.1 * 69) / 70)
        assert route.attributes[A.ROUTE_REASON] == "prefix_match"
        assert route.attributes[A.ROUTE_EXPECTED_CACHED] == 64
        assert {e.attributes[A.CANDIDATE_WORKER] for e in route.events} == {"w0", "w1"}

    def test_near_miss_shows_where_and_what(self, cluster):
        tc, exporter, clock, prompt = cluster
        tc.run(Turn("a", "acme", prompt, 4))
        drifted = prompt[:40] + ((prompt[40] + 1) % tc.engine().vocab_size,) + prompt[41:]
        tc.run(Turn("b", "acme", drifted, 4))
        near, _ = trace_of(exporter, "b")
        assert near["request"][A.MISS_CAUSE] == "near_miss"
        lookup = near["lookup"]
        assert lookup[A.CACHE_OUTCOME] == "near_miss"
        assert lookup[A.CACHE_LINE] == "common=40 of 70"
        assert lookup[A.CACHE_NEXT_PROMPT_TOKEN] == drifted[40]
        assert lookup[A.CACHE_NEXT_STORED_TOKEN] == prompt[40]
        decode = tc.engine().tokenizer.decode
        assert lookup[A.DIVERGENCE_BEFORE] == decode(list(prompt[16:40]))
        assert lookup[A.DIVERGENCE_STORED] == decode([prompt[40]])

    def test_routed_away_from_the_holder(self, cluster):
        tc, exporter, clock, prompt = cluster
        first = tc.run(Turn("a", "acme", prompt, 4)).result.worker_id
        tc.router.drain_worker(first)       # the holder takes no new requests
        again = tc.run(Turn("b", "acme", prompt, 4)).result.worker_id
        assert again != first
        away, route = trace_of(exporter, "b")
        assert away["request"][A.MISS_CAUSE] == "routed_elsewhere"
        assert away["request"][A.MISS_HOLDER] == first
        assert away["request"][A.WORKER] == again
        assert route.attributes[A.ROUTE_WORKER] == again

    def test_ttl_expiry(self, cluster):
        tc, exporter, clock, prompt = cluster
        tc.run(Turn("a", "acme", prompt, 4))
        clock.now += 301.0
        tc.run(Turn("b", "acme", prompt, 4))
        expired, _ = trace_of(exporter, "b")
        assert expired["request"][A.MISS_CAUSE] == "ttl_expired"
        assert expired["lookup"][A.CACHE_OUTCOME] == "miss"
        assert expired["lookup"][A.CACHE_TTL_S] == 300.0

    def test_tenant_boundary(self, cluster):
        tc, exporter, clock, prompt = cluster
        tc.run(Turn("a", "beta", prompt, 4))
        tc.run(Turn("b", "acme", prompt, 4))
        other, _ = trace_of(exporter, "b")
        assert other["request"][A.MISS_CAUSE] == "tenant_boundary"
        assert other["request"][A.GEN_AI_CACHE_READ] == 0


@pytest.fixture
def tiered(tmp_path):
    tc, exporter, a, b, a2 = tiered_cluster(tmp_path)
    yield tc, exporter, a, b, a2
    tc.close()


def request_span(exporter, request_id: str) -> dict:
    spans = [s for s in exporter.get_finished_spans() if s.attributes.get(A.REQUEST_ID) == request_id]
    root = next(s for s in spans if s.attributes[A.SPAN_KIND] == "request")
    lookup = next(s for s in exporter.get_finished_spans()
                  if s.context.trace_id == root.context.trace_id
                  and s.attributes[A.SPAN_KIND] == "lookup")
    return {"request": dict(root.attributes), "lookup": dict(lookup.attributes)}


def tiers_of(attrs: dict) -> tuple:
    return attrs[A.CACHE_TIER], attrs[A.CACHE_MEMORY_TOKENS], attrs[A.CACHE_DISK_TOKENS]


class TestTheTierThatServed:
    def test_spans_and_attribution_name_the_tier_that_served(self, tiered):
        tc, exporter, a, b, a2 = tiered
        first = tc.run(Turn("a", "acme", a, 4))
        tc.run(Turn("b", "acme", b, 4))
        partial = tc.run(Turn("a2", "acme", a2, 4))
        again = tc.run(Turn("b-again", "acme", b, 4))

        assert (first.observed.served, first.observed.miss.served) == (ServedTier.NONE,) * 2
        assert tiers_of(request_span(exporter, "a")["request"]) == ("none", 0, 0)

        # A': 32 tokens from memory, 32 from disk, 40 computed; first sight of the new blocks
        assert (partial.result.cached_tokens, partial.result.lookup.disk_tokens) == (64, 32)
        miss = partial.observed.miss
        assert (miss.cause, miss.tokens, miss.served, miss.disk_tokens) == (
            MissCause.FIRST_SIGHT, 40, ServedTier.BOTH, 32)
        seen = request_span(exporter, "a2")
        assert tiers_of(seen["request"]) == tiers_of(seen["lookup"]) == ("memory+disk", 32, 32)
        assert seen["request"][A.MISS_SERVED] == "memory+disk"

        # B again: a hit, every block the store matched read back from disk; past them, B's kept
        # cache (memory) gives the prompt but its last token
        assert again.observed.miss is None and again.observed.served is ServedTier.BOTH
        seen = request_span(exporter, "b-again")
        assert tiers_of(seen["lookup"]) == ("disk", 0, 64) and seen["lookup"][A.CACHE_KEPT_TOKENS] == 5
        assert tiers_of(seen["request"]) == ("memory+disk", 5, 64)
        assert seen["request"][A.GEN_AI_CACHE_READ] == 69 and A.MISS_SERVED not in seen["request"]
