"""Telemetry in the worker process, without Ray: it sets up its own exporter from the cluster's
settings and draws its spans under the context the request carries (the frontend draws the
request and routing spans in its own)."""
from __future__ import annotations

import asyncio
import json
import logging

from cluster.telemetry import attrs as A
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import (SERVICE_FRONTEND, TelemetrySettings, request_context,
                               setup_telemetry)
from cluster.backend.worker_actor import EngineWorker, WorkerDone
from router.kv.key import Namespace
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


def test_the_worker_draws_its_spans_under_the_carried_context(tmp_path):
    settings = TelemetrySettings("orchard", tmp_path)
    frontend = setup_telemetry(TelemetrySettings(SERVICE_FRONTEND, tmp_path))

    async def scenario():
        worker = EngineWorker("w3", str(tiny_model()), EngineConfig(block_size=BLOCK),
                              telemetry=settings)
        hello = await worker.start()
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
        prompt = tuple(range(30, 90))
        with frontend.tracer.start_as_current_span("chat tiny") as root:
            carried = request_context()
            done = await worker.run(GenerateRequest("r1", ns, prompt,
                                                    SamplingParams(max_tokens=3),
                                                    trace_context=carried))
        # an untraced request (no context) draws no orphan trace
        await worker.run(GenerateRequest("r2", ns, prompt, SamplingParams(max_tokens=3)))
        await worker.close()
        return root, done

    root, done = asyncio.run(scenario())
    frontend.shutdown()
    assert isinstance(done, WorkerDone) and done.traced

    spans = read_spans(tmp_path / "traces").spans
    by_name = {s.name: s for s in spans}
    assert len(spans) == 5 and len(by_name) == 5          # nothing drawn twice
    trace_id = format(root.get_span_context().trace_id, "032x")
    root_id = format(root.get_span_context().span_id, "016x")
    assert {s.trace_id for s in spans} == {trace_id}
    work = by_name["orchard.worker.generate"]
    assert work.parent_span_id == root_id and work.service == "orchard-worker"
    for name in ("orchard.cache.lookup", "orchard.prefill", "orchard.decode"):
        assert by_name[name].parent_span_id == work.span_id
        assert by_name[name].service == "orchard-worker"
    assert by_name["orchard.cache.lookup"].attributes[A.CACHE_OUTCOME] == "miss"
    assert by_name["orchard.decode"].attributes[A.DECODE_TOKENS] == 3

    worker_resources = _resources(tmp_path / "traces", "orchard-worker")
    assert worker_resources and all(r[A.WORKER] == "w3" and r[A.NODE_ADDRESS] == "local"
                                    and r[A.NODE_ID] == "local" and r[A.HOST_NAME]
                                    for r in worker_resources)


def test_a_worker_whose_telemetry_fails_logs_once_and_still_serves(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the run directory should be")

    async def scenario():
        worker = EngineWorker("w1", str(tiny_model()), EngineConfig(block_size=BLOCK),
                              telemetry=TelemetrySettings("orchard", blocked))
        hello = await worker.start()
        ns = Namespace("t", hello.model.model_id, hello.model.revision)
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
