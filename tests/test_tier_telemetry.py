"""The tiers in what the frontend observes: the request and lookup spans and the miss
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
from tests.support.traced_cluster import TracedCluster, Turn
from cluster.telemetry import attrs as A
from router.attribution import MissCause, ServedTier, served_from
from router.kv.events import Tier
from router.kv.key import hash_blocks
from telemetry_factories import in_memory
from tests.conftest import Clock
from tests.forged_models import tiny_model
from workers.model.model_dir import open_model_dir

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


def test_spans_and_attribution_name_the_tier_that_served(tiered):
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


def test_the_forecast_mirror_keeps_both_tiers_as_the_store_does(tiered):
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


def test_served_from_names_the_tiers_and_refuses_impossible_counts():
    assert [served_from(c, d) for c, d in ((0, 0), (64, 0), (64, 64), (64, 16))] == [
        ServedTier.NONE, ServedTier.MEMORY, ServedTier.DISK, ServedTier.BOTH]
    with pytest.raises(ValueError, match="disk_tokens must be within"):
        served_from(16, 32)
