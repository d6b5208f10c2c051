"""``orchard bench spans``: what drawing its spans costs the frontend's routing and the workers.

On the Ray path the frontend routes each request in its own process and draws its routing
span there, and the worker actor draws its four spans (worker, lookup, prefill, decode) on its
engine thread. This benchmark times those calls in place, with the default exporter (OTLP
JSON lines, batched) writing into a temporary run directory:

- worker: ``cluster.telemetry.spans.record_engine`` for a real finished request of the
  embedded model, ``calls`` times;
- routing: ``router.router.Router.route`` + ``started`` (+ ``finished``) for a 500-token
  prompt over ``workers`` workers, ``calls`` times untraced and ``calls`` times traced (the
  routing span, ``cluster.telemetry.spans.record_routing``, under a carried context).

CPU time is the process's (the export thread included) up to the exporter's flush, so
``*_cpu_s`` is the whole cost per call; wall time is what the caller waits.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cluster.telemetry.setup import TelemetrySettings

CONTEXT = (("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),)


def _timed(run, flush) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall = time.perf_counter() - wall
    flush()
    return wall, time.process_time() - cpu


def _worker_spans(model_dir: Path, run_dir: Path, calls: int) -> tuple[float, float]:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from cluster.telemetry import spans
    from cluster.telemetry.setup import setup_telemetry
    from router.kv.key import Namespace
    from workers.engine.engine import Engine, EngineConfig
    from workers.messages import GenerateRequest, SamplingParams

    tel = setup_telemetry(TelemetrySettings("orchard-worker", run_dir))
    engine = Engine.open(model_dir, EngineConfig(block_size=16))
    ns = Namespace("bench", engine.model_id, engine.revision)
    request = GenerateRequest("r0", ns, tuple(range(30, 130)), SamplingParams(max_tokens=4),
                              trace_context=CONTEXT)
    engine.submit(request)
    finished = []
    while engine.busy:
        finished.extend(engine.step().finished)

    def decode(ids):
        return engine.tokenizer.decode(list(ids))

    def run():
        for _ in range(calls):
            spans.record_engine(tel, request, finished[0], decode)
    try:
        return _timed(run, tel.flush)
    finally:
        tel.shutdown()


def _router(run_dir: Path, calls: int, workers: int) -> dict[str, tuple[float, float]]:
    from cluster.telemetry import spans
    from cluster.telemetry.setup import SERVICE_FRONTEND, setup_telemetry
    from router.kv.key import Namespace, hash_blocks
    from router.router import Router

    tel = setup_telemetry(TelemetrySettings(SERVICE_FRONTEND, run_dir))
    router = Router(16)
    for i in range(workers):
        router.add_worker(f"w{i}")
    ns = Namespace("bench", "model", "rev")
    hashes = hash_blocks(tuple(range(30, 530)), 16, ns)
    out = {}
    try:
        for name, traced in (("untraced", False), ("traced", True)):
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(calls):
                start_ns = time.time_ns()
                decision = router.route(ns, hashes, 500)
                router.started(f"{name}-{i}", decision)
                if traced:
                    spans.record_routing(tel, decision, start_ns, time.time_ns(), CONTEXT)
                router.finished(f"{name}-{i}")
            wall = time.perf_counter() - wall
            tel.flush()
            out[name] = (wall, time.process_time() - cpu)
    finally:
        tel.shutdown()
    return out


def bench_spans(model_dir: Path, calls: int = 2000, workers: int = 4) -> dict:
    if calls < 1 or workers < 1:
        raise ValueError("--calls and --workers must be positive")
    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as run_dir:
        worker = _worker_spans(model_dir, Path(run_dir), calls)
        router = _router(Path(run_dir), calls, workers)
    per = {k: (w / calls, c / calls) for k, (w, c) in router.items()}
    return {"model": str(model_dir), "calls": calls, "workers": workers,
            "worker_spans_wall_s": worker[0] / calls, "worker_spans_cpu_s": worker[1] / calls,
            "route_untraced_wall_s": per["untraced"][0],
            "route_untraced_cpu_s": per["untraced"][1],
            "route_traced_wall_s": per["traced"][0], "route_traced_cpu_s": per["traced"][1]}


def spans_command(args: argparse.Namespace) -> int:
    from workers.model.default_model import ensure_default_model

    r = bench_spans(Path(args.model) if args.model else ensure_default_model(), args.calls,
                    args.workers)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    us = 1e6
    print(f"{r['calls']} calls each; router over {r['workers']} workers\n"
          f"worker spans (record_engine)  {r['worker_spans_wall_s'] * us:7.0f} us wall, "
          f"{r['worker_spans_cpu_s'] * us:7.0f} us CPU with export\n"
          f"route + started, untraced     {r['route_untraced_wall_s'] * us:7.0f} us wall, "
          f"{r['route_untraced_cpu_s'] * us:7.0f} us CPU\n"
          f"route + started, traced       {r['route_traced_wall_s'] * us:7.0f} us wall, "
          f"{r['route_traced_cpu_s'] * us:7.0f} us CPU with export")
    return 0


def register_bench(sub) -> None:
    s = sub.add_parser("spans", help="span cost of the frontend's routing and the workers")
    s.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    s.add_argument("--calls", type=int, default=2000)
    s.add_argument("--workers", type=int, default=4, help="workers the router chooses among")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=spans_command)
