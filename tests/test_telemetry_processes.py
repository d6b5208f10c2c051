"""Telemetry in the worker and router processes, without Ray: each sets up its own exporter
from the cluster's settings and draws its spans under the context the request carries."""
from __future__ import annotations

import asyncio
import json
import logging

from opentelemetry import trace

from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import read_spans
from cluster.backend.router_actor import TracedRouter
from cluster.telemetry.setup import (SERVICE_FRONTEND, TelemetrySettings, request_context,
                               setup_telemetry)
from cluster.backend.worker_actor import EngineWorker, WorkerDone
from router.kv.key import Namespace, hash_blocks
from tests.forged_models import tiny_model
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, SamplingParams

BLOCK = 16


def _resources(trace_dir, service: str) -> list[dict]:
    """The resource attributes of every export line in ``service``'s files."""
    out = []
    for path in trace_dir.glob(f"{service}-*.jsonl"):
        for line in path.read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                out.append({a["key"]: next(iter(a["value"].values()))
                            for a in rs["resource"]["attributes"]})
    return out


def test_worker_and_router_draw_their_spans_under_the_carried_context(tmp_path):
    settings = TelemetrySettings("orchard", tmp_path)
    frontend = setup_telemetry(TelemetrySettings(SERVICE_FRONTEND, tmp_path))

    async def scenario():
        router = TracedRouter(BLOCK, settings)
        assert await router.tracing()
        await router.add_worker("w3")
        worker = EngineWorker("w3", str(tiny_model()), EngineConfig(block_size=BLOCK),
                              telemetry=settings)
        hello = await worker.start()
        ns = Namespace("t", hello.model_id, hello.revision)
        prompt = tuple(range(30, 90))
        with frontend.tracer.start_as_current_span("chat tiny") as root:
            carried = request_context()
            decision = await router.route_and_start("r1", ns, hash_blocks(prompt, BLOCK, ns),
                                                    len(prompt), carried)
            done = await worker.run(GenerateRequest("r1", ns, prompt,
                                                    SamplingParams(max_tokens=3),
                                                    trace_context=carried))
        await router.finished("r1")
        # an untraced request (no context) draws no orphan routing span
        await router.route_and_start("r2", ns, hash_blocks(prompt, BLOCK, ns), len(prompt))
        await router.flush()
        await worker.close()
        return root, decision, done

    root, decision, done = asyncio.run(scenario())
    frontend.shutdown()
    assert isinstance(done, WorkerDone) and done.traced and decision.worker_id == "w3"

    spans = read_spans(tmp_path / "traces").spans
    by_name = {s.name: s for s in spans}
    assert len(spans) == 6 and len(by_name) == 6          # nothing drawn twice
    trace_id = format(root.get_span_context().trace_id, "032x")
    root_id = format(root.get_span_context().span_id, "016x")
    assert {s.trace_id for s in spans} == {trace_id}
    route, work = by_name["orchard.route"], by_name["orchard.worker.generate"]
    assert route.parent_span_id == root_id and route.service == "orchard-router"
    assert route.attributes[A.ROUTE_WORKER] == "w3"
    assert work.parent_span_id == root_id and work.service == "orchard-worker"
    for name in ("orchard.cache.lookup", "orchard.prefill", "orchard.decode"):
        assert by_name[name].parent_span_id == work.span_id
        assert by_name[name].service == "orchard-worker"
    assert by_name["orchard.cache.lookup"].attributes[A.CACHE_OUTCOME] == "miss"
    assert by_name["orchard.decode"].attributes[A.DECODE_TOKENS] == 3

    worker_resources = _resources(tmp_path / "traces", "orchard-worker")
    assert worker_resources and all(r[A.WORKER] == "w3" and r[A.NODE_ADDRESS] == "local"
                                    and r[A.HOST_NAME] for r in worker_resources)
    assert all(r[A.NODE_ID] == "local" for r in _resources(tmp_path / "traces", "orchard-router"))


def test_a_router_whose_telemetry_fails_logs_once_and_still_routes(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the run directory should be")
    settings = TelemetrySettings("orchard", blocked)

    async def scenario():
        router = TracedRouter(BLOCK, settings)
        await router.add_worker("w0")
        ns = Namespace("t", "m", "r")
        prompt = tuple(range(40))
        with trace.get_tracer("t").start_as_current_span("x"):
            decision = await router.route_and_start("r1", ns, hash_blocks(prompt, BLOCK, ns),
                                                    len(prompt), request_context())
        return await router.tracing(), decision

    with caplog.at_level(logging.ERROR, logger="orchard.telemetry"):
        tracing, decision = asyncio.run(scenario())
    assert not tracing and decision.worker_id == "w0"
    failures = [r for r in caplog.records if "telemetry setup" in r.getMessage()]
    assert len(failures) == 1 and "orchard-router" in failures[0].getMessage()


def test_a_worker_whose_telemetry_fails_logs_once_and_still_serves(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the run directory should be")

    async def scenario():
        worker = EngineWorker("w1", str(tiny_model()), EngineConfig(block_size=BLOCK),
                              telemetry=TelemetrySettings("orchard", blocked))
        hello = await worker.start()
        ns = Namespace("t", hello.model_id, hello.revision)
        carried = (("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),)
        done = await worker.run(GenerateRequest("r1", ns, tuple(range(30, 60)),
                                                SamplingParams(max_tokens=2),
                                                trace_context=carried))
        await worker.close()
        return done

    with caplog.at_level(logging.ERROR, logger="orchard.telemetry"):
        done = asyncio.run(scenario())
    assert len(done.result.output_tokens) == 2 and not done.traced   # the frontend draws them
    failures = [r for r in caplog.records if "telemetry setup" in r.getMessage()]
    assert len(failures) == 1 and "orchard-worker" in failures[0].getMessage()
