"""Telemetry benchmarks: ``orchard bench telemetry`` and ``orchard bench forecast``.

``telemetry``: tracing overhead per request, on the production path. Two frontends
(``python -m cluster.api.frontend`` over in-process workers, each in a process of its own,
``cluster.bench.api.local_run``) serve the same model: one traced with the default exporter
(OTLP JSON lines, batched), one with ``exporter = "none"`` (tracing off; requests are still
attributed and priced, as in production). The same chat workload (conversations sharing a
system prompt, several turns each) goes to both as ``Generate`` calls, one request each in
turn, alternating which goes first, so both see the same cache states and background load.
Every span the path draws in production is drawn here (request, routing, lookup, prefill,
decode), by the code that draws them: ``cluster.api.work`` through
``cluster.telemetry.job_tracing`` and ``cluster.telemetry.observe``. The overhead is given as
the ratio of the two frontend processes' CPU time (engine work included on both sides: the
robust figure) and as wall-time ratios at the client.

``forecast``: job-level forecast error ``|forecast M - measured M|``.
``--demo FILE``: the batch runs through the real frontend over ``LocalBackend`` (gRPC, job
runner, router, engines); the forecast is the job's at submission, the measured ``M`` comes
from the traces, both read back by ``orchard report``'s code. ``--trace FILE``: a Mooncake
trace replayed through the simulator (``router.sim.forecast_replay``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

SYSTEM = ("You are orchard's support assistant. Answer questions about deliveries, storage, "
          "customs paperwork and invoices briefly and exactly, and ask for an order number "
          "when a question needs one. ") * 3


def _workload(conversations: int, turns: int, max_tokens: int) -> list:
    """Chat requests, turn 0 of every conversation first, then turn 1, ... (as a batch
    would arrive); each turn carries the conversation so far."""
    from cluster.api.client import chat_request

    return [chat_request(cid, history, max_tokens=max_tokens)
            for cid, history in _conversations(conversations, turns)]


def _conversations(conversations: int, turns: int) -> list[tuple[str, list[dict]]]:
    out = []
    for t in range(turns):
        for c in range(conversations):
            history = [{"role": "system", "content": SYSTEM}]
            for earlier in range(t + 1):
                order = 1000 + 7 * c + earlier
                history.append({"role": "user", "content": f"Conversation {c}, question "
                                                           f"{earlier}: where is order {order}?"})
                if earlier < t:
                    history.append({"role": "assistant",
                                    "content": f"Order {order} is at the Rotterdam depot."})
            out.append((f"c{c}-t{t}", history))
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _call(client, request) -> float:
    """Wall seconds of one ``Generate`` call, to its result."""
    started = time.perf_counter()
    for event in client.generate(request):
        if event.WhichOneof("event") == "result":
            if not event.result.ok:
                raise RuntimeError(f"request {request.custom_id} failed: "
                                   f"{event.result.error_message}")
            return time.perf_counter() - started
    raise RuntimeError(f"request {request.custom_id}: no result")


@contextlib.contextmanager
def _frontend(model_dir: Path, exporter: str, spans: list[int]):
    """A frontend process (``exporter``: "file" traced, "none" untraced), its client and pid;
    the spans it wrote are appended to ``spans`` once it has stopped."""
    from cluster.bench.api import _client, local_run

    with local_run(str(model_dir), exporter, after=lambda d: spans.append(_spans_written(d))
                   ) as run_dir, _client(run_dir) as client:
        pid = int(json.loads((run_dir / "frontend.json").read_text())["pid"])
        yield client, pid


def bench_overhead(model_dir: Path, conversations: int = 6, turns: int = 4,
                   max_tokens: int = 16, repeats: int = 3) -> dict:
    """Paired runs through two production frontends, tracing on and off; ``repeats`` passes
    on fresh frontends."""
    if min(conversations, turns, max_tokens, repeats) < 1 or conversations * turns < 2:
        raise ValueError("conversations, turns, max tokens and repeats must be positive, "
                         "with at least two requests")
    on_wall: list[float] = []
    off_wall: list[float] = []
    cpu = {"on": 0.0, "off": 0.0}
    spans: list[int] = []
    for _ in range(repeats):
        with _frontend(model_dir, "file", spans) as (on, on_pid), \
                _frontend(model_dir, "none", spans) as (off, off_pid):
            work = _workload(conversations, turns, max_tokens)
            _call(on, work[0])      # warm-up: MLX compiles kernels on first use
            _call(off, work[0])
            start = {"on": _cpu_s(on_pid), "off": _cpu_s(off_pid)}
            for i, request in enumerate(work[1:]):
                if i % 2 == 0:
                    on_wall.append(_call(on, request))
                    off_wall.append(_call(off, request))
                else:
                    off_wall.append(_call(off, request))
                    on_wall.append(_call(on, request))
            cpu["on"] += _cpu_s(on_pid) - start["on"]
            cpu["off"] += _cpu_s(off_pid) - start["off"]
    n = len(on_wall)
    return {"model": str(model_dir), "workers": 1, "requests": n, "repeats": repeats,
            "spans_written": sum(spans),
            "traced_s_per_request": statistics.fmean(on_wall),
            "untraced_s_per_request": statistics.fmean(off_wall),
            "overhead_wall": statistics.fmean(on_wall) / statistics.fmean(off_wall) - 1.0,
            "overhead_wall_median_pair": statistics.median(
                a / b for a, b in zip(on_wall, off_wall)) - 1.0,
            "traced_cpu_s_per_request": cpu["on"] / n,
            "untraced_cpu_s_per_request": cpu["off"] / n,
            "overhead_cpu": cpu["on"] / cpu["off"] - 1.0,
            "load_average": os.getloadavg()[0]}


def bench_tracing_work(model_dir: Path, conversations: int = 6, turns: int = 4,
                       max_tokens: int = 16, rounds: int = 5) -> dict:
    """The production request-tracing calls timed in place, tracing on against off.

    The workload runs once through an in-process backend (``LocalBackend``) for real
    outcomes; then, ``rounds`` times each, alternating, a fresh ``JobTracing`` built as the
    frontend builds it (``frontend_tracing``, exporter "file" or "none") gets every request's
    ``request(...)`` / ``done(...)``: the calls ``cluster.api.work`` makes around
    ``dispatch``. The traced side ends with a flush, so the exporter's work is counted
    (process CPU time covers its thread)."""
    from cluster.api.chat import ChatTokenizer

    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as tmp:
        tokenizer = ChatTokenizer(model_dir)
        try:
            prompts = [(cid, tuple(tokenizer.render(h)))
                       for cid, h in _conversations(conversations, turns)]
            model, captured = asyncio.run(_outcomes(model_dir, Path(tmp), prompts, max_tokens))
            spent = {"file": [0.0, 0.0], "none": [0.0, 0.0]}
            for r in range(rounds):
                for exporter in (("file", "none") if r % 2 == 0 else ("none", "file")):
                    wall, cpu = _trace_all(Path(tmp) / f"{exporter}-{r}", exporter, model,
                                           tokenizer, captured)
                    spent[exporter][0] += wall
                    spent[exporter][1] += cpu
            spans = sum(_spans_written(Path(tmp) / f"{e}-{r}")
                        for e in ("file", "none") for r in range(rounds))
        finally:
            tokenizer.close()
    n = rounds * len(captured)
    return {"tracing_requests": n, "tracing_spans": spans,
            "tracing_wall_s_per_request": (spent["file"][0] - spent["none"][0]) / n,
            "tracing_cpu_s_per_request": (spent["file"][1] - spent["none"][1]) / n}


async def _outcomes(model_dir: Path, tmp: Path, prompts, max_tokens: int):
    from cluster.backend.local import LocalBackend
    from router.kv.key import Namespace, hash_blocks
    from workers.messages import GenerateRequest, SamplingParams

    backend = LocalBackend(model_dir, workers=1)
    await backend.start()
    try:
        model = backend.model_info()
        ns = Namespace("default", model.model_id, model.revision)
        captured = []
        for cid, prompt in prompts:
            request = GenerateRequest(f"r-{cid}", ns, prompt, SamplingParams(max_tokens))
            hashes = hash_blocks(prompt, model.block_size, ns)
            captured.append((cid, request, hashes, await backend.generate(request, hashes)))
        return model, captured
    finally:
        await backend.close()


def _trace_all(run_dir: Path, exporter: str, model, tokenizer, captured) -> tuple[float, float]:
    """Wall and process CPU seconds of tracing every captured request once."""
    from cluster.config import load_config, write_default_config
    from cluster.telemetry.job_tracing import frontend_tracing

    run_dir.mkdir()
    write_default_config(run_dir, model_dir=model.model_dir)
    with (run_dir / "orchard.toml").open("a") as f:
        f.write(f'[telemetry]\nexporter = "{exporter}"\n')
    tracing = frontend_tracing(load_config(run_dir), model, 1, tokenizer.decode,
                               tokenizer.render)
    wall, cpu = time.perf_counter(), time.process_time()
    for cid, request, hashes, outcome in captured:
        with tracing.request("default", request.request_id, "", cid, request.sampling, (),
                             prompt=request.prompt) as trace:
            trace.done(request, hashes, outcome)
    tracing.observer.tel.flush()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tracing.observer.tel.shutdown()
    return wall, cpu


def _spans_written(run_dir: Path) -> int:
    from cluster.telemetry.otlp_json import read_spans

    traces = run_dir / "traces"
    return len(read_spans(traces).spans) if traces.exists() else 0


def _serve_and_submit(run_dir: Path, model_dir: Path, workers: int, batch_path: Path,
                      steps: Sequence[str] = ("job",)) -> list[str]:
    """Run the batch through a real frontend over LocalBackend once per ``"job"`` step, with
    ``"invalidate"`` steps (the default tenant's cache, through the admin API) between;
    returns the job ids."""
    from cluster.api.batchfile import parse_batch
    from cluster.api.client import Client
    from cluster.config import load_config, write_default_config
    from cluster.api.frontend import serve
    from cluster.backend.local import LocalBackend

    write_default_config(run_dir, model_dir=str(model_dir))
    config = load_config(run_dir)
    with open(batch_path) as lines:
        batch = parse_batch(lines, name=str(batch_path))
    box: dict = {}

    async def main() -> None:
        backend = LocalBackend.from_config(config, workers=workers)
        await backend.start()
        frontend = await serve(config, backend)
        try:
            def submit() -> None:
                with Client(frontend.address, config.key_for("default")) as client, \
                        Client(frontend.address, sorted(config.admin_keys)[0]) as admin:
                    for step in steps:
                        if step == "invalidate":
                            admin.invalidate("default")
                            continue
                        job = client.submit(batch.requests)
                        box.setdefault("jobs", []).append(
                            client.wait(job.job_id, poll_s=0.1, timeout_s=1800))
            await asyncio.to_thread(submit)
        finally:
            await frontend.stop()
            await backend.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    thread.join()
    jobs = box.get("jobs", [])
    if len(jobs) != list(steps).count("job"):
        raise RuntimeError("the demo batch did not finish; see the log above")
    if any(job.failed for job in jobs):
        raise RuntimeError(f"{sum(j.failed for j in jobs)} requests of the demo batch failed")
    return [job.job_id for job in jobs]


def bench_demo_forecast(batch_path: Path, model_dir: Path, workers: int = 2,
                        steps: Sequence[str] = ("job",)) -> dict:
    """Job forecast at submission against the measured M of the served demo batch, for the
    last job of ``steps`` (each job's figures under ``"jobs"``)."""
    from cluster.telemetry.otlp_json import read_spans
    from cluster.report.build import build_report

    with tempfile.TemporaryDirectory(prefix="orchard-demo-") as tmp:
        run_dir = Path(tmp)
        job_ids = _serve_and_submit(run_dir, model_dir, workers, batch_path, steps)
        spans = read_spans(run_dir / "traces").spans
        results = [_demo_job(build_report(spans, job=j), batch_path, workers, j)
                   for j in job_ids]
    return {**results[-1], "steps": list(steps), "jobs": results}


def _demo_job(report: dict, batch_path: Path, workers: int, job_id: str) -> dict:
    (job,) = report["jobs"]
    return {"batch": str(batch_path), "workers": workers, "job_id": job_id,
            "requests": job["requests"], "input_tokens": job["input_tokens"],
            "cached_tokens": job["cached_tokens"], "written_tokens": job["written_tokens"],
            "forecast_multiplier": job["forecast_multiplier"],
            "measured_multiplier": job["measured_multiplier"],
            "forecast_error": abs(job["forecast_error"]),
            "routing_time_forecast_multiplier": job["request_forecast_multiplier"],
            "miss_causes": job["miss_causes"]}


def bench_trace_forecast(trace_path: Path, workers: int, capacity_tokens: int,
                         block_size: int, window_s: float) -> dict:
    from router.sim.forecast_replay import forecast_replay
    from router.sim.simulator import SimConfig
    from router.sim.trace import load_trace

    config = SimConfig(workers=workers, capacity_tokens=capacity_tokens, block_size=block_size)
    result = forecast_replay(load_trace(trace_path), config, window_s=window_s).as_json()
    result.update(trace=str(trace_path), workers=workers, capacity_tokens=capacity_tokens,
                  block_size=block_size, window_s=window_s)
    return result


def _print(result: dict, as_json: bool, lines: list[str]) -> int:
    import json

    print(json.dumps(result, indent=2) if as_json else "\n".join(lines))
    return 0


def telemetry_command(args) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    model = Path(args.model) if args.model else ensure_default_model()
    r = bench_overhead(model, args.conversations, args.turns, args.max_tokens, args.repeats)
    r.update(bench_tracing_work(model, args.conversations, args.turns, args.max_tokens))
    r["tracing_share"] = r["tracing_cpu_s_per_request"] / r["untraced_s_per_request"]
    return _print(r, args.json, [
        f"model {r['model']}, {r['requests']} paired Generate requests ({r['repeats']} "
        f"passes), {r['spans_written']} spans written; load average {r['load_average']:.1f}",
        f"traced   {r['traced_s_per_request'] * 1e3:8.2f} ms/request, "
        f"{r['traced_cpu_s_per_request'] * 1e3:8.2f} ms CPU/request",
        f"untraced {r['untraced_s_per_request'] * 1e3:8.2f} ms/request, "
        f"{r['untraced_cpu_s_per_request'] * 1e3:8.2f} ms CPU/request",
        f"overhead CPU {r['overhead_cpu'] * 100:+.2f}%, wall "
        f"{r['overhead_wall'] * 100:+.2f}% (median pair "
        f"{r['overhead_wall_median_pair'] * 100:+.2f}%)",
        f"the tracing calls in place: {r['tracing_cpu_s_per_request'] * 1e3:.3f} ms CPU "
        f"({r['tracing_wall_s_per_request'] * 1e3:.3f} ms wall) per request = "
        f"{r['tracing_share'] * 100:.2f}% of an untraced request (target <= 3%)"])


def forecast_command(args) -> int:
    if (args.trace is None) == (args.demo is None):
        raise ValueError("give --demo FILE.jsonl (a batch) or --trace FILE (a Mooncake trace)")
    if args.demo is not None:
        import workers  # noqa: F401  (OpenBLAS before mlx)
        from workers.model.default_model import ensure_default_model

        steps = [s.strip() for s in args.steps.split(",") if s.strip()]
        if "job" not in steps or set(steps) - {"job", "invalidate"}:
            raise ValueError(f"--steps lists job and invalidate steps with at least one job, "
                             f"e.g. job,job,invalidate,job; got {args.steps!r}")
        r = bench_demo_forecast(Path(args.demo),
                                Path(args.model) if args.model else ensure_default_model(),
                                args.workers or 2, steps)
        return _print(r, args.json, [f"{r['batch']} on {r['workers']} workers, steps "
                                     f"{','.join(steps)}"] + [
            f"job {i + 1}: {j['requests']} requests, {j['cached_tokens']}/{j['input_tokens']} "
            f"input tokens cached; forecast M {j['forecast_multiplier']:.4f} (at submission), "
            f"measured M {j['measured_multiplier']:.4f}, |error| {j['forecast_error']:.4f} "
            f"(target <= 0.05)" for i, j in enumerate(r["jobs"])])
    r = bench_trace_forecast(Path(args.trace), args.workers or 8, args.capacity_tokens,
                             args.block_size, args.window)
    return _print(r, args.json, [
        f"{r['trace']}: {r['requests']} requests, {r['workers']} workers x "
        f"{r['capacity_tokens']} tokens, policy {r['policy']}, jobs of {r['window_s']:g} s",
        f"forecast M {r['forecast_multiplier']:.4f}, measured M {r['measured_multiplier']:.4f}, "
        f"|error| {r['forecast_error']:.4f} (target <= 0.05); worst window "
        f"{r['window_error_max']:.4f}",
        f"hit ratio forecast {r['forecast_hit_ratio']:.4f}, measured "
        f"{r['measured_hit_ratio']:.4f}"])


def add_parsers(sub) -> None:
    """``orchard bench telemetry`` and ``orchard bench forecast`` (called by bench.py)."""
    t = sub.add_parser("telemetry", help="tracing overhead per request, on and off, through "
                                         "two production frontends")
    t.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    t.add_argument("--conversations", type=int, default=6)
    t.add_argument("--turns", type=int, default=4)
    t.add_argument("--max-tokens", type=int, default=16)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=telemetry_command)
    f = sub.add_parser("forecast", help="job forecast M against measured M")
    f.add_argument("--demo", help="an OpenAI Batch JSONL file run through a local frontend")
    f.add_argument("--trace", help="a Mooncake trace replayed through the simulator")
    f.add_argument("--model", help="mlx-lm model directory for --demo (default: embedded)")
    f.add_argument("--workers", type=int, default=None, help="2 for --demo, 8 for --trace")
    f.add_argument("--capacity-tokens", type=int, default=1_000_000)
    f.add_argument("--block-size", type=int, default=512)
    f.add_argument("--window", type=float, default=600.0,
                   help="--trace: seconds of arrivals per job (600)")
    f.add_argument("--steps", default="job", metavar="STEPS",
                   help="for --demo: jobs and cache invalidations in order, e.g. "
                        "job,job,invalidate,job (default: job)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.set_defaults(func=forecast_command)
