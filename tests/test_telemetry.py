"""The trace tree of a request, from typed engine and router data, with the SDK's in-memory
exporter: a hit, a miss, a near miss, a request routed away from its prefix, a TTL expiry."""
import logging

import pytest

from cluster.telemetry import spans
from cluster.telemetry import attrs as A
from cluster.telemetry.observe import RequestObserver, ServedCache
from cluster.telemetry.metrics import StoreGauges
from cluster.telemetry.setup import Telemetry, context_of, extract_metadata, inject_metadata
from router.cost import PriceTable
from router.kv.key import Namespace, hash_blocks
from router.policy import Reason
from telemetry_factories import T0, decision, in_memory, result
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams
from tests.conftest import Clock

BS = 4
NS = Namespace("acme", "tiny")
SYSTEM = tuple(range(100, 116))  # four blocks


@pytest.fixture
def setup(tmp_path):
    tel, exporter, reader = in_memory(tmp_path)
    clock = Clock()
    observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BS, 300.0, 10_000),
                               clock=clock)
    return tel, exporter, reader, observer, clock


def run(observer, tel, rid, prompt, dec, res, decode=None):
    """What the frontend and the worker do for one request, with the engine's answer given."""
    info = spans.RequestInfo(rid, NS.tenant, NS.model, job_id="job-1", conversation_id="c1")
    with observer.request(info) as span:
        request = GenerateRequest(rid, NS, tuple(prompt), SamplingParams(4),
                                  trace_context=observer.context())
        if dec is not None:
            observer.routed(dec, T0, T0 + 1000)
        spans.record_engine(tel, request, res, decode)          # the worker process's part
        return observer.finish(span, request, hash_blocks(prompt, BS, NS), res, dec)


def tree(exporter, rid):
    """The spans of the trace whose request span has ``rid``: name -> span."""
    finished = exporter.get_finished_spans()
    root = next(s for s in finished if s.attributes.get(A.REQUEST_ID) == rid
                and s.attributes[A.SPAN_KIND] == "request")
    mine = [s for s in finished if s.context.trace_id == root.context.trace_id]
    by_name = {s.name: s for s in mine}
    assert len(by_name) == len(mine) == 6, [s.name for s in mine]
    return root, by_name


def assert_shape(root, by_name):
    route, worker = by_name["orchard.route"], by_name["orchard.worker.generate"]
    assert root.parent is None and root.name == "chat tiny"
    assert route.parent.span_id == root.context.span_id
    assert worker.parent.span_id == root.context.span_id
    for name in ("orchard.cache.lookup", "orchard.prefill", "orchard.decode"):
        assert by_name[name].parent.span_id == worker.context.span_id
    lookup, prefill = by_name["orchard.cache.lookup"], by_name["orchard.prefill"]
    assert lookup.start_time == T0 + 1_000_000 and lookup.end_time == T0 + 2_000_000
    assert prefill.end_time == by_name["orchard.decode"].start_time


def test_miss_then_hit(setup):
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


def test_near_miss_carries_the_divergence(setup):
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


def test_routed_away_from_the_holder(setup):
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


def test_ttl_expiry(setup):
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


def test_metrics_per_worker_and_tenant(setup):
    tel, exporter, reader, observer, clock = setup
    prompt = SYSTEM + (5,)
    run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
        result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
    run(observer, tel, "r2", prompt, decision("w0", Reason.PREFIX_MATCH, 16, 17, {"w0": 16}),
        result("r2", 17, 16, 0, "w0", LookupOutcome.HIT))
    tel.instruments.watch_store("w0", lambda: StoreGauges(bytes=4096, evictions=3, expirations=2))
    tel.instruments.watch_queue(lambda: {"acme": 7})
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    points[(m.name, tuple(sorted(p.attributes.items())))] = p
    key = (("tenant", "acme"), ("worker", "w0"))
    assert points[("orchard.cache.cached_tokens", key)].value == 16
    assert points[("orchard.cache.input_tokens", key)].value == 34
    assert points[("orchard.cache.hit_ratio", key)].value == pytest.approx(16 / 34)
    assert points[("gen_ai.server.time_to_first_token", key)].count == 2
    assert points[("orchard.store.bytes", (("worker", "w0"),))].value == 4096
    assert points[("orchard.store.evictions", (("worker", "w0"),))].value == 3
    assert points[("orchard.store.expirations", (("worker", "w0"),))].value == 2
    assert points[("orchard.queue.depth", (("tenant", "acme"),))].value == 7


def test_context_round_trips_through_metadata(setup):
    tel, exporter, *_ = setup
    with tel.tracer.start_as_current_span("client") as client:
        metadata = inject_metadata()
    assert metadata[0][0] == "traceparent"
    ctx = extract_metadata([("TraceParent", metadata[0][1]), ("authorization", "k")])
    with tel.tracer.start_as_current_span("server", context=ctx) as server:
        pass
    assert server.context.trace_id == client.context.trace_id
    assert server.parent.span_id == client.context.span_id
    assert extract_metadata([("authorization", "k")]) is None
    assert context_of(()) is None


def test_a_tracing_failure_is_logged_once_and_never_fails_the_request(setup, caplog):
    tel, exporter, _, observer, clock = setup

    class Broken:
        def start_span(self, *a, **k):
            raise RuntimeError("exporter on fire")

    tel.tracer = Broken()
    prompt = SYSTEM + (5,)
    with caplog.at_level(logging.ERROR, logger="orchard.telemetry"):
        for rid in ("r1", "r2"):
            observed = run(observer, tel, rid, prompt,
                           decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
                           result(rid, 17, 0, 16, "w0", LookupOutcome.MISS))
    assert observed.cost is not None          # the cost is still computed
    messages = [r.getMessage() for r in caplog.records]
    assert sum("record_engine" in m for m in messages) == 1
    assert exporter.get_finished_spans() == ()


def test_disabled_telemetry_records_nothing_and_runs():
    tel = Telemetry.disabled()
    observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BS, 300.0, 1000))
    prompt = SYSTEM + (5,)
    observed = run(observer, tel, "r1", prompt, None,
                   result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
    assert observed.miss.cause.value == "first_sight"


def test_a_failed_request_is_an_error_span_and_counted_by_the_report(setup):
    from cluster.telemetry.job_tracing import JobTracing
    from cluster.telemetry.otlp_json import SpanRecord
    from cluster.report.build import build_report
    from cluster.jobs.store import PendingRequest

    tel, exporter, _, observer, clock = setup
    tracing = JobTracing(observer)
    pending = PendingRequest("job-9", 0, "conv1-turn-0", SYSTEM, SamplingParams(4))
    with tracing.request("acme", pending.request_id, pending.job_id, pending.custom_id,
                         pending.sampling) as trace:
        trace.failed("UNAVAILABLE", "no worker could take the request")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert span.attributes[A.ERROR_TYPE] == "UNAVAILABLE"
    assert span.attributes[A.GEN_AI_CONVERSATION] == "conv1" and span.attributes[A.TURN] == 0
    record = SpanRecord(format(span.context.trace_id, "032x"), format(span.context.span_id, "016x"),
                        "", span.name, span.start_time, span.end_time, dict(span.attributes),
                        (), (), "svc")
    report = build_report([record], job="job-9")
    assert report["jobs"][0]["failed_requests"] == 1 and report["jobs"][0]["requests"] == 0


def test_job_forecast_uses_held_blocks_and_the_realised_share(setup):
    tel, exporter, _, observer, clock = setup
    prompt = SYSTEM + (5,)
    chain = hash_blocks(prompt, BS, NS)
    fresh_plans, held = observer.plan_job([chain], [17], [1], 1, 0.1)
    assert held == {} and observer.forecast_job(fresh_plans, held)[0].cached_tokens == 0
    run(observer, tel, "r1", prompt, decision("w1", Reason.COLD_HASH, 0, 17, {"w1": 0}),
        result("r1", 17, 0, 16, "w1", LookupOutcome.MISS))
    clock.now = 5.0
    plans, held = observer.plan_job([chain], [17], [1], 1, 0.1)
    assert set(held) == set(chain) and all(0 < left <= 300 for left in held.values())
    assert observer.realisation() == 1.0
    assert observer.forecast_job(plans, held)[0].cached_tokens == 16
    # The next one went elsewhere and read nothing: routing realised none of the model's reuse.
    run(observer, tel, "r2", prompt, decision("w0", Reason.LOAD_SPILL, 0, 17, {"w0": 0, "w1": 16}),
        result("r2", 17, 0, 16, "w0", LookupOutcome.MISS))
    assert observer.realisation() == 0.0
    assert observer.forecast_job(plans, held)[0].cached_tokens == 0


@pytest.mark.parametrize("custom_id, expected", [
    ("conv00-turn01", ("conv00", 1)), ("c1-turn-3", ("c1", 3)), ("c2_turn2", ("c2", 2)),
    ("chat-7-t4", ("chat-7", 4)), ("support:12", ("support", 12)),
    ("request-17", ("", 0)), ("", ("", 0))])
def test_conversation_and_turn_from_custom_ids(custom_id, expected):
    from cluster.telemetry.job_tracing import conversation_of

    assert conversation_of(custom_id) == expected
