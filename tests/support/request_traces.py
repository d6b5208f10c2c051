"""One request observed as the frontend observes it, from typed engine and router data.

``observed`` builds in-memory telemetry and a ``RequestObserver`` over a test ``Clock``;
``run`` does for one request what the frontend and the worker do (request span, routing
span, the worker's spans, the outcome), with the engine's answer given as a
``GenerateResult`` (``tests.support.telemetry_factories.result``); ``tree`` finds the six
spans of one request's trace. ``traced`` and ``run_genai`` do the same through
``JobTracing``, as the job runner does, for a model with a chat template. ``emit_one`` draws
one request span with a child and one request's metrics, then flushes: what the exporter
tests send. ``tiered_cluster`` is a real one-worker cluster with a memory tier of 6 blocks
and a disk tier, and three prompts that move blocks between them.
"""
from __future__ import annotations

import random

from cluster.api.chat import ChatTokenizer
from cluster.telemetry import attrs as A
from cluster.telemetry import spans
from cluster.telemetry.job_tracing import JobTracing, chat_opening
from cluster.telemetry.metrics import RequestUsage
from cluster.telemetry.observe import RequestObserver, ServedCache
from router.cost import PriceTable
from router.kv.key import Namespace, hash_blocks
from tests.conftest import Clock
from tests.support.forged_models import tiny_model
from tests.support.telemetry_factories import T0, in_memory, result
from tests.support.traced_cluster import TracedCluster
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams
from workers.model.model_dir import open_model_dir

BS = 4

NS = Namespace("acme", "tiny")

SYSTEM = tuple(range(100, 116))  # four blocks


def observed(tmp_path):
    """(telemetry, span exporter, metric reader, observer, clock), all in memory."""
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


def traced(tmp_path):
    """``JobTracing`` over in-memory telemetry, for the forged llama model's chat template."""
    tel, exporter, reader = in_memory(tmp_path)
    tracing = JobTracing(RequestObserver(tel, PriceTable(),
                                         ServedCache("SmolLM2-135M-Instruct", BS, 300.0, 10_000)))
    tracing.chat_opening = chat_opening(ChatTokenizer(tiny_model("llama")).render)
    return tracing, tel, exporter, reader


class _Outcome:
    """What the job runner hands ``RequestTrace.done``: spans drawn elsewhere already."""

    def __init__(self, res):
        self.result, self.decision, self.attempts = res, None, 1
        self.worker_traced, self.pulled = True, None


def run_genai(tracing, rid, prompt, operation=""):
    """One request of job-1 through ``tracing``: a miss writing its full blocks, 3 outputs."""
    ns = Namespace("acme", "default")
    with tracing.request("acme", rid, "job-1", rid, SamplingParams(4), None, operation,
                         prompt) as trace:
        request = GenerateRequest(rid, ns, tuple(prompt), SamplingParams(4),
                                  trace_context=trace.context)
        trace.done(request, hash_blocks(prompt, BS, ns),
                   _Outcome(result(rid, len(prompt), 0, len(prompt) // BS * BS, "w0",
                                   LookupOutcome.MISS, outputs=3)))


USAGE = RequestUsage("w0", "acme", "hit", "chat", "tiny", 10, 8, 0, 3, 0.01, 0.001)


def emit_one(tel):
    """A request span ("chat tiny") with a child span, and one request's metrics, flushed."""
    tel.instruments.record_request(USAGE)
    with spans.request_span(tel, spans.RequestInfo("r1", "acme", "tiny", job_id="j1")) as span:
        with tel.tracer.start_as_current_span("child"):
            pass
    tel.flush()
    return span


TIER_BS = 16


def tiered_cluster(tmp_path):
    """(cluster, span exporter, A, B, A'): one real worker, a memory tier of 6 blocks, a disk
    tier of 64; A and B are 70 tokens, A' is A's first 64 tokens then 40 new ones. Close the
    cluster after the test."""
    tel, exporter, _ = in_memory(tmp_path)
    model = tiny_model("llama")
    per_token = open_model_dir(model).kv_shape.bytes_per_token
    tc = TracedCluster(model, 1, tel, block_size=TIER_BS, ttl_s=300.0, clock=Clock(1000.0),
                       store_bytes=6 * TIER_BS * per_token, disk_dir=tmp_path / "cache",
                       disk_bytes=64 * TIER_BS * per_token)
    rng = random.Random(3)
    vocab = tc.engine().vocab_size
    a, b, tail = ([rng.randrange(vocab) for _ in range(n)] for n in (70, 70, 40))
    return tc, exporter, tuple(a), tuple(b), tuple(a[:64] + tail)
