"""``orchard bench api``: the path overhead per request, model compute excluded.

For each request, sent one at a time so that nothing queues behind another::

    overhead = wall time at the client (call -> result received) - the worker's own time

where the worker's own time is ``worker_s`` on the result (the engine's stamps, request
received -> last token). What remains is the whole path around the model: gRPC both ways,
auth, validation, tokenization, block hashing, routing, the hand-off to the worker and back,
and, on the job path, the job store (an fsynced job insert, the result insert) and the result
stream. The paths measured:

- ``generate``: the ``Generate`` RPC (one request, streamed back);
- ``batch``: one job of ``--requests`` requests whose results are followed as they arrive;
  with the frontend running one request at a time, each request's overhead is the gap between
  its result and the previous one at the client, less its worker time (the first request's
  gap starts at submission, so the job's fsynced acceptance is counted once, as it is paid);
- ``job_single``: ``SubmitJob`` with a single request, then ``StreamResults(follow)`` until its
  result: the worst case, one job acceptance (fsync) and two RPCs per request;
- ``http_chat`` (and ``http_sdk_default`` with ``--sdk-default``): the same request through
  the OpenAI-compatible HTTP API and the ``openai`` SDK, and streamed TTFT over HTTP beside
  gRPC (``cluster.bench.http``).

By default a frontend over in-process workers (``python -m cluster.api.frontend``, no Ray) is
started as a separate process on the default model; ``--ray`` starts a 1-worker Ray cluster
(``orchard up --detach`` in a fresh run directory) and measures through it; ``--address`` and
``--api-key`` measure a running cluster instead. ``--steps`` also splits the overhead of
``generate`` and ``job_single`` into the steps of ``cluster.bench.path_steps``, from the
traces of the cluster it started.
"""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from cluster.api.client import Client, chat_request
from cluster.bench.path_steps import PathSteps, Sent, steps_of_run
from router.kv.stats import percentile

if TYPE_CHECKING:  # the HTTP side needs the openai SDK (a test dependency): imported on use
    import openai

    from cluster.bench.http import TtftFigures

TARGET_P50_MS = 5.0


@dataclass(frozen=True, slots=True)
class PathFigures:
    path: str
    requests: int
    overhead_p50_ms: float
    overhead_p99_ms: float
    overhead_mean_ms: float
    wall_p50_ms: float
    worker_p50_ms: float


def _figures(path: str, walls: list[float], workers: list[float]) -> PathFigures:
    overhead = [(w - k) * 1e3 for w, k in zip(walls, workers)]
    return PathFigures(path, len(walls), percentile(overhead, 0.5), percentile(overhead, 0.99),
                       statistics.fmean(overhead), percentile(walls, 0.5) * 1e3,
                       percentile(workers, 0.5) * 1e3)


def _request(i: int, prompt_words: int):
    # Distinct prompts so every request is routed and hashed like new traffic.
    text = f"request {i}: " + " ".join(f"word{j}" for j in range(prompt_words))
    return chat_request(f"bench-{i}", [{"role": "user", "content": text}], max_tokens=1)


def measure_generate(client: Client, n: int, prompt_words: int, offset: int = 0,
                     sent: list[Sent] | None = None) -> tuple[list[float], list[float]]:
    """``sent``: each request's ``Sent`` is appended to it."""
    walls, workers = [], []
    for i in range(offset, offset + n):
        start, start_ns = time.perf_counter(), time.time_ns()
        result, received, received_ns = None, 0.0, 0
        for event in client.generate(_request(i, prompt_words)):
            if event.WhichOneof("event") == "result":
                result, received, received_ns = event.result, time.perf_counter(), time.time_ns()
        walls.append(received - start)
        if result is None or not result.ok:
            raise RuntimeError(f"request {i} failed: {result}")
        workers.append(result.worker_s)
        if sent is not None:
            sent.append(Sent(result.request_id, start_ns, received_ns, result.worker_s))
    return walls, workers


def measure_batch(client: Client, n: int, prompt_words: int, offset: int = 0
                  ) -> tuple[list[float], list[float]]:
    """Gaps between consecutive results of one job (the first from submission)."""
    start = time.perf_counter()
    job = client.submit([_request(i, prompt_words) for i in range(offset, offset + n)])
    walls, workers, last = [], [], start
    for result in client.results(job.job_id, follow=True):
        now = time.perf_counter()
        if not result.ok:
            raise RuntimeError(f"request {result.custom_id} failed: {result.error_message}")
        walls.append(now - last)
        workers.append(result.worker_s)
        last = now
    if len(walls) != n:
        raise RuntimeError(f"job {job.job_id} returned {len(walls)} of {n} results")
    return walls, workers


def measure_job(client: Client, n: int, prompt_words: int, offset: int = 0,
                sent: list[Sent] | None = None) -> tuple[list[float], list[float]]:
    """``sent``: each request's ``Sent`` is appended to it."""
    walls, workers = [], []
    for i in range(offset, offset + n):
        start, start_ns = time.perf_counter(), time.time_ns()
        job = client.submit([_request(i, prompt_words)])
        (result,) = list(client.results(job.job_id, follow=True))
        walls.append(time.perf_counter() - start)
        if not result.ok:
            raise RuntimeError(f"request {i} failed: {result.error_message}")
        workers.append(result.worker_s)
        if sent is not None:
            sent.append(Sent(result.request_id, start_ns, time.time_ns(), result.worker_s))
    return walls, workers


@contextmanager
def _run_dir(model_dir: str | None, telemetry: str, max_concurrent: int = 1) -> Iterator[Path]:
    """A fresh run directory whose frontend runs ``max_concurrent`` requests at a time, the
    other limits out of the way."""
    from cluster.config import write_default_config

    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as tmp:
        run_dir = Path(tmp)
        write_default_config(run_dir, model_dir=model_dir or "", max_pending_per_tenant=100000,
                             max_pending_total=100000, max_concurrent=max_concurrent)
        with (run_dir / "orchard.toml").open("a") as f:
            f.write(f'[telemetry]\nexporter = "{telemetry}"\n')
        yield run_dir


def _client(run_dir: Path) -> Client:
    from cluster.config import load_config

    return Client.from_run_dir(run_dir, api_key=load_config(run_dir).key_for("default"))


def spawn_frontend(run_dir: Path) -> subprocess.Popen:
    """A frontend process over one in-process worker on ``run_dir`` (its log in
    ``frontend.log``), returned once it serves; a clear error if it exits or takes 300 s."""
    log = open(run_dir / "frontend.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "cluster.api.frontend", "--run-dir",
                             str(run_dir), "--workers", "1"], stdout=log, stderr=log,
                            cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 300
    while not (run_dir / "frontend.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the frontend did not start: "
                               + (run_dir / "frontend.log").read_text()[-2000:])
        time.sleep(0.1)
    return proc


@contextmanager
def local_run(model_dir: str | None, telemetry: str = "file", max_concurrent: int = 1,
              after: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A frontend subprocess over one in-process worker, serving a fresh run directory;
    ``after(run_dir)`` runs once the frontend has stopped (its files flushed), before the
    directory goes."""
    with _run_dir(model_dir, telemetry, max_concurrent) as run_dir:
        proc = spawn_frontend(run_dir)
        try:
            yield run_dir
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            if after is not None:
                after(run_dir)


@contextmanager
def local_frontend(model_dir: str | None, telemetry: str = "file", max_concurrent: int = 1
                   ) -> Iterator[Client]:
    """A client of ``local_run``'s frontend (a tenant key from its config)."""
    with local_run(model_dir, telemetry, max_concurrent) as run_dir, _client(run_dir) as client:
        yield client


@contextmanager
def ray_cluster(model_dir: str | None, telemetry: str = "file", max_concurrent: int = 1,
                after: Callable[[Path], None] | None = None) -> Iterator[Client]:
    """``orchard up --workers 1 --detach`` in a fresh run directory (an embedded Ray cluster on
    loopback) whose frontend runs ``max_concurrent`` requests at a time, stopped afterwards;
    ``after(run_dir)`` runs once it has stopped (its files flushed), before the directory
    goes."""
    from cluster.daemon import UpOptions, spawn_detached, stop_detached

    with _run_dir(model_dir, telemetry, max_concurrent) as run_dir:
        print("starting a 1-worker Ray cluster (orchard up --detach) ...", file=sys.stderr)
        spawn_detached(UpOptions(run_dir, workers=1))
        # SIGTERM (a timeout) still stops the cluster: it runs in a process of its own
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            with _client(run_dir) as client:
                yield client
        finally:
            stop_detached(run_dir)
        if after is not None:
            after(run_dir)


def run(client: Client, requests: int, warmup: int, prompt_words: int, batch: bool,
        http: openai.OpenAI | None = None, default_client: openai.OpenAI | None = None,
        sent: dict[str, list[Sent]] | None = None
        ) -> tuple[list[PathFigures], list[TtftFigures]]:
    """``sent``: filled with the ``Sent`` requests of ``generate`` and ``job_single``."""
    mine = {"generate": [], "job_single": []} if sent is not None else {}
    measure_generate(client, warmup, prompt_words, offset=0)
    measure_job(client, warmup, prompt_words, offset=warmup)
    base = 2 * warmup
    figures = [_figures("generate", *measure_generate(client, requests, prompt_words, base,
                                                      mine.get("generate")))]
    ttft: list[TtftFigures] = []
    if http is not None:
        from cluster.bench.http import measure_http_chat, measure_ttft

        model = http.models.list().data[0].id
        measure_http_chat(http, model, warmup, prompt_words, offset=0)
        figures.append(_figures("http_chat", *measure_http_chat(http, model, requests,
                                                                prompt_words, warmup)))
        if default_client is not None:  # the SDK as it comes, without TCP_NODELAY
            figures.append(_figures("http_sdk_default", *measure_http_chat(
                default_client, model, requests, prompt_words, warmup + requests)))
        ttft = measure_ttft(client, http, model, max(requests // 4, 10), prompt_words)
    if batch:  # needs a frontend running one request at a time (the local one does)
        base += requests
        figures.append(_figures("batch", *measure_batch(client, requests, prompt_words, base)))
    base += requests
    figures.append(_figures("job_single", *measure_job(client, requests, prompt_words, base,
                                                       mine.get("job_single"))))
    if sent is not None:
        sent.update(mine)
    return figures, ttft


def bench_api(args) -> int:
    if args.requests < 1 or args.warmup < 0 or args.prompt_words < 1:
        raise ValueError("--requests and --prompt-words must be >= 1, --warmup >= 0")
    if args.ray and args.address:
        raise ValueError("--ray starts a cluster of its own; --address measures a running one: "
                         "pass one of them")
    if bool(args.address) != bool(args.api_key):
        raise ValueError("--address and --api-key go together (a running cluster's frontend "
                         "and a tenant key)")
    if args.steps and (args.address or args.telemetry != "file"):
        raise ValueError("--steps reads the traces of the cluster the bench starts: not with "
                         "--address, and with --telemetry file")
    from cluster.bench.http import sdk

    sent: dict[str, list[Sent]] | None = {} if args.steps else None
    steps: list[PathSteps] = []

    def read_steps(run_dir: Path) -> None:
        if sent is not None:
            steps.extend(steps_of_run(run_dir, sent))

    if args.address:
        http = sdk(args.http_address, args.api_key) if args.http_address else None
        with Client(args.address, args.api_key) as client:
            figures, ttft = run(client, args.requests, args.warmup, args.prompt_words,
                                batch=False, http=http)
    else:
        import workers  # noqa: F401  (OpenBLAS before mlx, for forging the default model)
        from workers.model.default_model import ensure_default_model

        model_dir = args.model or str(ensure_default_model())
        if args.ray:
            with ray_cluster(model_dir, args.telemetry, after=read_steps) as client:
                figures, ttft = run(client, args.requests, args.warmup, args.prompt_words,
                                    batch=True, sent=sent)
        else:
            from cluster.config import load_config

            with local_run(model_dir, args.telemetry, after=read_steps) as run_dir:
                key = load_config(run_dir).key_for("default")
                address = json.loads((run_dir / "frontend.json").read_text())["http_address"]
                default = sdk(address, key, nodelay=False) if args.sdk_default else None
                with Client.from_run_dir(run_dir, api_key=key) as client:
                    figures, ttft = run(client, args.requests, args.warmup, args.prompt_words,
                                        batch=True, http=sdk(address, key),
                                        default_client=default, sent=sent)
    if args.json:
        print(json.dumps({"target_p50_ms": TARGET_P50_MS, "ray": bool(args.ray),
                          "paths": [asdict(f) for f in figures],
                          "ttft": [asdict(t) for t in ttft],
                          "steps": [asdict(s) for s in steps]}, indent=2))
        return 0
    print(f"path overhead per request (wall - worker time), {args.requests} sequential "
          f"requests, max_tokens=1, target p50 <= {TARGET_P50_MS:g} ms")
    print(f"{'path':<11} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'wall p50':>9} "
          f"{'worker p50':>11}")
    for f in figures:
        print(f"{f.path:<11} {f.overhead_p50_ms:>8.2f} {f.overhead_p99_ms:>8.2f} "
              f"{f.overhead_mean_ms:>8.2f} {f.wall_p50_ms:>9.2f} {f.worker_p50_ms:>11.2f}")
    if ttft:
        print(f"\nstreamed TTFT (call -> first text), max_tokens=8, {ttft[0].requests} "
              "requests each, alternating")
        for t in ttft:
            print(f"{t.path:<11} p50 {t.ttft_p50_ms:>8.2f} ms   p99 {t.ttft_p99_ms:>8.2f} ms")
    if steps:
        print("\noverhead by step, p50 ms (cluster.bench.path_steps)")
        print(f"{'path':<11} {'edge':>8} {'to_engine':>10} {'back':>8} {'requests':>9}")
        for s in steps:
            print(f"{s.path:<11} {s.edge_p50_ms:>8.2f} {s.to_engine_p50_ms:>10.2f} "
                  f"{s.back_p50_ms:>8.2f} {s.requests:>9}")
    return 0


def register_bench(sub) -> None:
    """Add ``api`` to the ``orchard bench`` subcommands."""
    p = sub.add_parser("api", help="path overhead per request (gRPC + router + job store)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--prompt-words", type=int, default=40)
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--address", help="measure a running frontend instead (host:port)")
    p.add_argument("--api-key", help="a tenant key of that frontend")
    p.add_argument("--ray", action="store_true",
                   help="measure through Ray: a 1-worker cluster (`orchard up`) started for it")
    p.add_argument("--http-address", help="and its HTTP API (http://host:port), to measure "
                   "HTTP beside gRPC")
    p.add_argument("--sdk-default", action="store_true",
                   help="also measure HTTP with the openai SDK's default client (no TCP_NODELAY)")
    p.add_argument("--telemetry", choices=("file", "none"), default="file",
                   help="the local frontend's trace exporter (default: file, as `orchard up`)")
    p.add_argument("--steps", action="store_true",
                   help="also split generate's and job_single's overhead into steps, from the "
                        "traces (cluster.bench.path_steps)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=bench_api)
