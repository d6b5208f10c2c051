"""A process's telemetry (``cluster.telemetry.setup``): its settings, checked and narrowed
from the cluster config; W3C trace context through gRPC metadata; a tracing failure logged
once and never failing a request; telemetry switched off.

Telemetry in the worker process, without Ray: it sets up its own exporter from the cluster's
settings and draws its spans under the context the request carries (the frontend draws the
request and routing spans in its own).

One trace per request across processes, on a real ``RayBackend`` (slow): the frontend draws
the request span and the routing span (routing runs in the frontend's process), the worker
actor its lookup / prefill / decode spans, each process into its own JSON-lines file under
RUN_DIR/traces/, and ``orchard report`` reads them back as one run.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter

import pytest

from cluster.backend.ray_backend import RayBackend
from cluster.backend.worker_actor import EngineWorker, WorkerDone
from cluster.report.build import build_report, request_rows
from cluster.telemetry import attrs as A
from cluster.telemetry.job_tracing import JobTracing
from cluster.telemetry.observe import RequestObserver, ServedCache
from cluster.telemetry.otlp_json import read_spans
from cluster.telemetry.setup import (SERVICE_FRONTEND, Telemetry, TelemetrySettings,
                                     context_of, extract_metadata, inject_metadata,
                                     request_context, setup_telemetry)
from router.cost import PriceTable, load_price_table
from router.kv.key import Namespace, hash_blocks
from router.policy import Reason
from tests.support.thread_loop import Loop, shared_prompt
from tests.support.forged_models import tiny_model
from tests.support.request_traces import BS, SYSTEM, observed, run
from tests.support.telemetry_factories import decision, result
from workers.engine.engine import EngineConfig
from workers.messages import GenerateRequest, LookupOutcome, SamplingParams


@pytest.fixture
def setup(tmp_path):
    return observed(tmp_path)


class TestSettings:
    def test_settings_refuse_bad_config(self, tmp_path):
        with pytest.raises(ValueError, match="exporter must be"):
            TelemetrySettings("s", tmp_path, exporter="jaeger")
        with pytest.raises(ValueError, match="exporter must be"):
            TelemetrySettings("s", tmp_path, exporter="file,none")
        with pytest.raises(ValueError, match="metrics must be"):
            TelemetrySettings("s", tmp_path, metrics="prometheus")
        with pytest.raises(ValueError, match="needs an endpoint"):
            TelemetrySettings("s", tmp_path, metrics="otlp")
        with pytest.raises(ValueError, match="needs an endpoint"):
            TelemetrySettings("s", tmp_path, exporter="otlp")
        with pytest.raises(ValueError, match="protocol"):
            TelemetrySettings("s", tmp_path, exporter="otlp", endpoint="x", protocol="udp")

    def test_telemetry_settings_come_from_the_cluster_config(self, tmp_path):
        from cluster.config import load_config
        from cluster.telemetry.setup import settings_from_config

        prices = tmp_path / "prices.toml"
        prices.write_text('version = "v2"\n[default]\ncache_read = 0.05\n')
        (tmp_path / "orchard.toml").write_text(
            '[[tenants]]\nname = "acme"\napi_keys = ["k"]\n'
            f'[telemetry]\nexporter = "otlp"\nendpoint = "127.0.0.1:4317"\nprotocol = "grpc"\n'
            f'prices = "{prices}"\n')
        config = load_config(tmp_path)
        settings = settings_from_config(config, "orchard-frontend")
        assert (settings.exporter, settings.endpoint, settings.protocol) == ("otlp", "127.0.0.1:4317",
                                                                            "grpc")
        assert settings.run_dir == tmp_path and settings.service == "orchard-frontend"
        (tmp_path / "orchard.toml").write_text('[telemetry]\nexporter = "otlp"\nprotocol = "udp"\n'
                                               'endpoint = "x"\n')
        with pytest.raises(ValueError, match="protocol"):
            settings_from_config(load_config(tmp_path), "orchard-frontend")


class TestTraceContext:
    def test_context_round_trips_through_metadata(self, setup):
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


class TestAFailingOrDisabledTelemetry:
    def test_a_tracing_failure_is_logged_once_and_never_fails_the_request(self, setup, caplog):
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

    def test_disabled_telemetry_records_nothing_and_runs(self):
        tel = Telemetry.disabled()
        observer = RequestObserver(tel, PriceTable(), ServedCache("tiny", BS, 300.0, 1000))
        prompt = SYSTEM + (5,)
        observed = run(observer, tel, "r1", prompt, None,
                       result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        assert observed.miss.cause.value == "first_sight"


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


class TestAWorkerProcess:
    def test_the_worker_draws_its_spans_under_the_carried_context(self, tmp_path):
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

    def test_a_worker_whose_telemetry_fails_logs_once_and_still_serves(self, tmp_path, caplog):
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


WORKER_SPANS = ("orchard.worker.generate", "orchard.cache.lookup", "orchard.prefill",
                "orchard.decode")


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """A traced run: three requests of job j1 through two Ray workers; the backend and the
    frontend's telemetry closed (everything flushed) before the test reads the files."""
    pytest.importorskip("ray")
    run_dir = tmp_path_factory.mktemp("run")
    loop = Loop()
    backend = RayBackend(tiny_model(), workers=2, engine=EngineConfig(block_size=BLOCK),
                         telemetry=TelemetrySettings("orchard", run_dir))
    try:
        loop.run(backend.start(), timeout_s=300)
        info = backend.model_info()
        tel = setup_telemetry(TelemetrySettings(SERVICE_FRONTEND, run_dir))
        cache = ServedCache(info.model_id, BLOCK, 300.0, 1_000_000)
        tracing = JobTracing(RequestObserver(tel, load_price_table(None), cache))
        ns = Namespace("t", info.model_id, info.revision)

        async def one(rid: str, prompt: tuple[int, ...]):
            hashes = hash_blocks(prompt, BLOCK, ns)
            sampling = SamplingParams(max_tokens=3)
            with tracing.request("t", rid, "j1", rid, sampling) as trace:
                request = GenerateRequest(rid, ns, prompt, sampling,
                                          trace_context=trace.context)
                outcome = await backend.generate(request, hashes)
                trace.done(request, hashes, outcome)
            return outcome

        outcomes = {"r0": loop.run(one("r0", shared_prompt(1)))}
        # r0's result carried the worker's block events to the frontend's router: r1, r2 go home
        for rid, seed in (("r1", 2), ("r2", 3)):
            outcomes[rid] = loop.run(one(rid, shared_prompt(seed)))
        loop.run(tracing.aclose())
    finally:
        loop.run(backend.close())
        loop.close()
    return run_dir, outcomes


@pytest.mark.slow
class TestEachProcessOnRay:
    def test_each_request_is_one_trace_joined_across_processes(self, ray_run):
        run_dir, outcomes = ray_run
        files = sorted(p.name for p in (run_dir / "traces").glob("*.jsonl"))
        by_service = Counter(service for name in files
                             for service in ("orchard-frontend", "orchard-router", "orchard-worker")
                             if name.startswith(service + "-"))
        assert by_service["orchard-frontend"] == 1 and by_service["orchard-router"] == 0
        assert 1 <= by_service["orchard-worker"] <= 2      # a file per worker process
        assert not any(name.endswith(f"-{os.getpid()}.jsonl") for name in files
                       if not name.startswith("orchard-frontend"))

        read = read_spans(run_dir / "traces")
        assert read.bad_lines == 0
        roots = {s.attributes[A.REQUEST_ID]: s for s in read.spans
                 if s.attributes.get(A.SPAN_KIND) == "request"}
        assert set(roots) == set(outcomes)
        assert len({r.trace_id for r in roots.values()}) == 3
        for rid, outcome in outcomes.items():
            assert outcome.worker_traced
            root = roots[rid]
            in_trace = {s.name: s for s in read.spans if s.trace_id == root.trace_id}
            names = Counter(s.name for s in read.spans if s.trace_id == root.trace_id)
            assert set(names.values()) == {1}, f"{rid}: a span drawn twice: {names}"
            assert root.service == "orchard-frontend" and root.parent_span_id == ""
            route = in_trace["orchard.route"]
            assert route.service == "orchard-frontend" and route.parent_span_id == root.span_id
            assert route.attributes[A.ROUTE_WORKER] == outcome.worker_id
            work = in_trace["orchard.worker.generate"]
            assert work.service == "orchard-worker" and work.parent_span_id == root.span_id
            assert work.attributes[A.WORKER] == outcome.worker_id
            for name in WORKER_SPANS[1:]:
                assert in_trace[name].service == "orchard-worker"
                assert in_trace[name].parent_span_id == work.span_id
            assert in_trace["orchard.cache.lookup"].attributes[A.CACHE_MATCHED] == \
                outcome.result.cached_tokens

    def test_the_report_reads_the_whole_run(self, ray_run):
        run_dir, outcomes = ray_run
        spans = read_spans(run_dir / "traces").spans
        rows = {r.request_id: r for r in request_rows(spans)}
        assert set(rows) == set(outcomes)
        for rid, outcome in outcomes.items():
            assert rows[rid].lookup[A.CACHE_MATCHED] == outcome.result.cached_tokens
            assert rows[rid].worker == outcome.worker_id
        assert outcomes["r1"].result.cached_tokens == 96   # the shared system prefix, reused
        job = build_report(spans)["jobs"][0]
        results = [o.result for o in outcomes.values()]
        assert job["job_id"] == "j1" and job["requests"] == 3
        assert job["input_tokens"] == sum(r.input_tokens for r in results)
        assert job["cached_tokens"] == sum(r.cached_tokens for r in results)
        assert job["measured_multiplier"] is not None and job["forecast_multiplier"] is not None

    def test_each_process_names_itself_in_its_resource(self, ray_run):
        run_dir, outcomes = ray_run
        resources = {}
        for path in (run_dir / "traces").glob("*.jsonl"):
            for line in path.read_text().splitlines():
                for rs in json.loads(line)["resourceSpans"]:
                    attrs = {a["key"]: next(iter(a["value"].values()))
                             for a in rs["resource"]["attributes"]}
                    resources.setdefault(attrs["service.name"], []).append(attrs)
        assert set(resources) == {"orchard-frontend", "orchard-worker"}   # no router process
        workers = {r[A.WORKER] for r in resources["orchard-worker"]}
        assert {o.worker_id for o in outcomes.values()} <= workers
        for attrs in resources["orchard-worker"]:
            assert attrs[A.NODE_ADDRESS] and attrs[A.NODE_ID] and attrs[A.HOST_NAME]
