"""The trace tree with the real engine (a tiny forged model) and the real router: a hit, a
miss, a near miss, a request routed away from the worker that held its prefix, a TTL expiry.

The tiers in what the frontend observes: the request and lookup spans and the miss
attribution say which tier served, and the forecast's mirror of each store holds both tiers.

One real worker (a tiny forged model) with a memory tier of 6 blocks and a disk tier::

    A   70 tokens   miss: a0..a3 stored in memory
    B   70 tokens   miss: b0..b3 stored; memory is full, a3 and a2 go to disk
    A'  A[:64] + 40 new tokens: a0 a1 from memory, a2 a3 from disk, 2 new blocks computed;
                    promoting a2 a3 and storing a4 a5 pushes b0..b3 out to disk
    B   again       all 64 tokens of the store's blocks from disk, the rest but the last
                    token from B's kept cache
"""
import random
import pytest
import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.telemetry import attrs as A
from tests.support.traced_cluster import TracedCluster, Turn
from tests.support.telemetry_factories import in_memory
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from router.attribution import MissCause, ServedTier, served_from
from router.kv.events import Tier
from router.kv.key import hash_blocks
from workers.model.model_dir import open_model_dir


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


class TestTelemetryEngine:
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


BS = 16

def _leading(chain, blocks) -> int:
    """How many leading blocks of ``chain`` are in ``blocks`` (a tier's holdings)."""
    n = 0
    while n < len(chain) and chain[n] in blocks:
        n += 1
    return n

@pytest.fixture
def tiered(tmp_path):
    tel, exporter, _ = in_memory(tmp_path)
    model = tiny_model("llama")
    per_token = open_model_dir(model).kv_shape.bytes_per_token
    tc = TracedCluster(model, 1, tel, block_size=BS, ttl_s=300.0, clock=Clock(1000.0),
                       store_bytes=6 * BS * per_token, disk_dir=tmp_path / "cache",
                       disk_bytes=64 * BS * per_token)
    rng = random.Random(3)
    vocab = tc.engine().vocab_size
    a, b, tail = ([rng.randrange(vocab) for _ in range(n)] for n in (70, 70, 40))
    yield tc, exporter, tuple(a), tuple(b), tuple(a[:64] + tail)
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


class TestTierTelemetry:
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

    def test_the_forecast_mirror_keeps_both_tiers_as_the_store_does(self, tiered):
        tc, _, a, b, a2 = tiered
        for rid, prompt in (("a", a), ("b", b), ("a2", a2)):
            tc.run(Turn(rid, "acme", prompt, 4))
        ns = tc.engine().namespace("acme")
        held, holdings = tc.engine().holdings(), tc.observer.holdings
        memory = {h.block for h in held if h.tier == Tier.MEMORY}
        disk = {h.block for h in held if h.tier == Tier.DISK}
        for prompt, want in ((a2, (6, 0)), (b, (0, 4)), (a, (4, 0))):
            chain = hash_blocks(prompt, BS, ns)
            real = _leading(chain, memory)
            real = (real, _leading(chain[real:], disk))
            assert holdings.held_by_tier("w0", chain) == real == want
        per_token = tc.engine().kv_bytes_per_token
        assert holdings.capacity_by_tier() == (6 * BS, 64 * BS)
        assert tc.engine().disk_kv_bytes_per_token == per_token
        # B's blocks, on disk only, are read, not computed: the job forecast counts them as cached
        (usage,) = tc.forecast([Turn("b2", "acme", b, 4)])
        assert (usage.input_tokens, usage.cached_tokens, usage.written_tokens) == (70, 64, 0)
