"""The trace tree with the real engine (a tiny forged model) and the real router: a hit, a
miss, a near miss, a request routed away from the worker that held its prefix, a TTL expiry."""
import random

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.telemetry import attrs as A
from tests.support.traced_cluster import TracedCluster, Turn
from telemetry_factories import in_memory
from tests.conftest import Clock
from tests.forged_models import tiny_model


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


def test_miss_then_hit(cluster):
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


def test_near_miss_shows_where_and_what(cluster):
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


def test_routed_away_from_the_holder(cluster):
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


def test_ttl_expiry(cluster):
    tc, exporter, clock, prompt = cluster
    tc.run(Turn("a", "acme", prompt, 4))
    clock.now += 301.0
    tc.run(Turn("b", "acme", prompt, 4))
    expired, _ = trace_of(exporter, "b")
    assert expired["request"][A.MISS_CAUSE] == "ttl_expired"
    assert expired["lookup"][A.CACHE_OUTCOME] == "miss"
    assert expired["lookup"][A.CACHE_TTL_S] == 300.0


def test_tenant_boundary(cluster):
    tc, exporter, clock, prompt = cluster
    tc.run(Turn("a", "beta", prompt, 4))
    tc.run(Turn("b", "acme", prompt, 4))
    other, _ = trace_of(exporter, "b")
    assert other["request"][A.MISS_CAUSE] == "tenant_boundary"
    assert other["request"][A.GEN_AI_CACHE_READ] == 0
