"""``orchard bench batch``: an OpenAI-size batch accepted, stored and dispatched.

    orchard bench batch --requests 50000 [--window 20] [--json]

A file of ``--requests`` short chats (one of eight system prompts and a question of its own,
about 880 bytes a line: 44 MB for 50,000) is written to a temp dir, and a frontend over one
in-process worker (``python -m cluster.api.frontend``, the default model, telemetry off) is
started. The worker's prefix store is capped at 32 MB (the eight system prompts fit): it lives
in the frontend's process here, so its growth counts in the frontend's memory figure, which a
cluster under ``orchard up`` (workers in their own processes) would not include. Measured:

- ``accept_s``: ``Client.submit_file`` (the file streamed in 1 MB chunks) until the job id,
  and ``accept_cpu_s``, the frontend's CPU time meanwhile (what a busy machine stretches);
- ``peak_growth_mb``: the frontend's resident memory, sampled every 20 ms, at its highest
  during acceptance and the dispatch window, less what it held just before the submission;
- ``store_bytes_per_request``: the job store's files (database and log) after acceptance,
  less before, over the requests;
- ``dispatch_per_s``: results recorded per second over ``--window`` seconds once every job
  has a result (its forecast made, its dispatch under way), for the one big job, then (after
  cancelling it) for the same requests submitted as jobs of 1,000 (``split_dispatch_per_s``);
  with the share of prompt tokens read from the worker's prefix store in each case.

Requests ask for one token, so dispatch (store reads, templating and tokenization, routing,
the result write) is what the rate measures rather than decoding.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.api.client import Client
from cluster.bench.api import spawn_frontend

SYSTEMS = [f"You are assistant number {k} of a fruit-logistics company. " * 6 for k in range(8)]
SPLIT = 1000
STORE_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class BatchFigures:
    requests: int
    file_mb: float
    accept_s: float
    accept_cpu_s: float          # the frontend's CPU time during acceptance (all threads)
    peak_growth_mb: float
    store_bytes_per_request: float
    dispatch_per_s: float
    split_dispatch_per_s: float
    cached_share: float          # of the prompt tokens of the results so far, one job
    split_cached_share: float    # ... jobs of 1,000
    window_s: float


def write_file(path: Path, n: int, start: int = 0) -> Path:
    with path.open("w") as f:
        for i in range(start, start + n):
            question = f"Question {i}: where is order {i * 7919 % 100000}? " + "Please check. " * 21
            body = {"model": "default", "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                                 {"role": "user", "content": question}]}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")
    return path


def cpu_s(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class PeakMemory:
    """The highest resident memory of ``pid``, sampled on a thread."""

    def __init__(self, pid: int, every_s: float = 0.02):
        self.peak = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(pid, every_s), daemon=True)
        self._thread.start()

    def _sample(self, pid: int, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak = max(self.peak, rss_mb(pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def store_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.glob("jobs.sqlite3*"))


def done_counts(client: Client, job_ids: list[str]) -> list[int]:
    return [client.job(j).done for j in job_ids]


def dispatch_rate(client: Client, job_ids: list[str], window_s: float) -> tuple[float, float]:
    """Results per second over ``window_s``, once every job has a result (its forecast made,
    its dispatch under way), and the share of prompt tokens read from the cache then."""
    while not all(done_counts(client, job_ids)):
        time.sleep(0.5)
    start, t0 = sum(done_counts(client, job_ids)), time.monotonic()
    time.sleep(window_s)
    rate = (sum(done_counts(client, job_ids)) - start) / (time.monotonic() - t0)
    prompt = cached = 0
    for job_id in job_ids:
        for result in client.results(job_id):
            prompt += result.usage.prompt_tokens
            cached += result.usage.cached_tokens
    return rate, cached / prompt if prompt else 0.0


def start_frontend(run_dir: Path, model_dir: str) -> subprocess.Popen:
    from cluster.config import write_default_config

    write_default_config(run_dir, model_dir=model_dir, max_concurrent=8)
    with (run_dir / "orchard.toml").open("a") as f:
        f.write('[telemetry]\nexporter = "none"\n')
    text = (run_dir / "orchard.toml").read_text()
    capped = re.sub(r"(?m)^capacity_bytes = \d+", f"capacity_bytes = {STORE_BYTES}", text)
    if capped == text:
        raise RuntimeError("the default config has no [cache] capacity_bytes line to cap")
    (run_dir / "orchard.toml").write_text(capped)
    return spawn_frontend(run_dir)


def bench_batch(requests: int, window_s: float, model_dir: str, log=print) -> BatchFigures:
    from cluster.config import load_config

    with tempfile.TemporaryDirectory(prefix="orchard-bench-batch-") as tmp:
        tmp_dir = Path(tmp)
        run_dir = tmp_dir / "run"
        path = write_file(tmp_dir / "batch.jsonl", requests)
        proc = start_frontend(run_dir, model_dir)
        try:
            key = load_config(run_dir).key_for("default")
            with Client.from_run_dir(run_dir, api_key=key) as client:
                time.sleep(1.0)  # let the frontend settle before the baseline
                base_rss, base_store = rss_mb(proc.pid), store_bytes(run_dir)
                peak = PeakMemory(proc.pid)
                t0, cpu0 = time.perf_counter(), cpu_s(proc.pid)
                job = client.submit_file(path)
                accept_s, accept_cpu_s = time.perf_counter() - t0, cpu_s(proc.pid) - cpu0
                per_request = (store_bytes(run_dir) - base_store) / requests
                log(f"accepted {requests} requests in {accept_s:.2f} s; measuring dispatch")
                rate, cached = dispatch_rate(client, [job.job_id], window_s)
                growth = peak.stop() - base_rss
                if not client.job(job.job_id).finished:  # a fast machine may have finished it
                    client.cancel(job.job_id)
                split_ids = []
                for start in range(0, requests, SPLIT):
                    part = write_file(tmp_dir / "part.jsonl", min(SPLIT, requests - start), start)
                    split_ids.append(client.submit_file(part).job_id)
                log(f"submitted {len(split_ids)} jobs of {SPLIT}; measuring dispatch")
                split_rate, split_cached = dispatch_rate(client, split_ids, window_s)
                for job_id in split_ids:
                    if not client.job(job_id).finished:
                        client.cancel(job_id)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        return BatchFigures(requests, path.stat().st_size / 1e6, accept_s, accept_cpu_s, growth, per_request,
                            rate, split_rate, cached, split_cached, window_s)


def run_bench(args) -> int:
    if args.requests < 1 or args.window <= 0:
        raise ValueError("--requests must be >= 1 and --window > 0")
    from workers.model.default_model import ensure_default_model

    model_dir = args.model or str(ensure_default_model())
    figures = bench_batch(args.requests, args.window, model_dir,
                          log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(asdict(figures), indent=2))
        return 0
    print(f"file                    {figures.requests} requests, {figures.file_mb:.1f} MB")
    print(f"acceptance              {figures.accept_s:.2f} s (target <= 5 s), "
          f"{figures.accept_cpu_s:.2f} s of the frontend's CPU")
    print(f"frontend peak growth    {figures.peak_growth_mb:.0f} MB (target <= 100 MB)")
    print(f"job store per request   {figures.store_bytes_per_request:.0f} bytes")
    print(f"dispatch, one job       {figures.dispatch_per_s:.1f} requests/s "
          f"(over {figures.window_s:g} s), {figures.cached_share:.0%} of prompt tokens cached")
    print(f"dispatch, jobs of {SPLIT}  {figures.split_dispatch_per_s:.1f} requests/s, "
          f"{figures.split_cached_share:.0%} cached")
    return 0


def register_bench(sub) -> None:
    p = sub.add_parser("batch", help="an OpenAI-size batch: acceptance time, frontend memory, "
                       "job store size, dispatch rate")
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--window", type=float, default=20.0, help="seconds of dispatch measured")
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_bench)
