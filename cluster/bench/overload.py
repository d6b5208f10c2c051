"""``orchard bench overload``: an interactive flood at twice what one worker serves, beside a
running batch job.

    orchard bench overload [--seconds 60] [--deadline 2.0] [--overload 2.0] [--json]

A frontend over one in-process worker (``python -m cluster.api.frontend``, the default model,
telemetry off) runs ``--concurrent`` requests at a time, with ``[limits] max_ttft_s`` set to
``--deadline``: the TTFT an interactive request must meet. Then:

1. **Calibrate**: ``--concurrent`` clients send interactive requests back to back for
   ``--calibrate`` seconds; what they are served a second is the worker's capacity.
2. **Batch job**: a job of ``--batch-requests`` chats is submitted and left running.
3. **Flood**: interactive requests arrive open loop (evenly spaced, each on its own thread,
   whatever the answers) at ``--overload`` times the capacity for ``--seconds``. Each is
   accepted (its first token came: its TTFT is timed at the client) or refused
   (``RESOURCE_EXHAUSTED``, with or without a ``retry-after``); the job's results are counted
   every 0.5 s meanwhile.

Figures (the names ``--json`` prints; the checks read them):

- ``interactive_deadline_met_share``: of the accepted interactive requests, the share whose
  TTFT at the client met the deadline (target >= 0.95);
- ``refused_share``: of the interactive requests sent, the share refused with a Retry-After;
- ``served_late``: accepted requests whose TTFT missed the deadline (what shedding exists to
  avoid: a request that is refused costs its client one round trip, one served late costs it
  the whole wait);
- ``batch_progress``: the job's results recorded during the flood (never 0: the job is slowed,
  never stopped), with ``batch_longest_gap_s``, the longest time without a new result.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.api.client import Client, OrchardError, chat_request
from cluster.bench.api import spawn_frontend
from router.kv.stats import percentile

SYSTEM = "You are the help desk of a fruit-logistics company; answer in one short sentence. "


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    seconds: float = 60.0       # the flood
    calibrate_s: float = 20.0   # closed-loop clients measuring the capacity
    deadline_s: float = 2.0     # the TTFT an interactive request must meet ([limits] max_ttft_s)
    overload: float = 2.0       # the flood's rate over the measured capacity
    concurrent: int = 4         # [limits] max_concurrent
    max_tokens: int = 16        # every request's output
    batch_requests: int = 5000  # the job beside the flood (cancelled after it)

    def check(self) -> None:
        if min(self.seconds, self.calibrate_s, self.deadline_s, self.overload) <= 0:
            raise ValueError("--seconds, --calibrate, --deadline and --overload must be > 0")
        if min(self.concurrent, self.max_tokens, self.batch_requests) < 1:
            raise ValueError("--concurrent, --max-tokens and --batch-requests must be >= 1")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One interactive request of the flood, as its client saw it."""

    ttft_s: float | None       # send to the first token; None: refused or failed before it
    code: str = ""             # the status of a refusal or failure ("": served whole)
    retry_after_s: int | None = None


@dataclass(frozen=True, slots=True)
class OverloadFigures:
    capacity_per_s: float      # interactive requests served a second, calibrated
    rate_per_s: float          # the flood's arrival rate
    deadline_s: float
    sent: int
    accepted: int
    served_late: int
    refused: int               # RESOURCE_EXHAUSTED with a Retry-After
    refused_without_retry_after: int
    failed: int                # any other status (or a stream that failed after its first token)
    interactive_deadline_met_share: float
    refused_share: float
    ttft_p50_s: float          # of the accepted requests (0.0: none)
    ttft_p99_s: float
    batch_progress: int        # the job's results during the flood
    batch_longest_gap_s: float
    seconds: float
    load_average: tuple[float, float, float]


def _request(i: int, max_tokens: int):
    return chat_request(f"q{i}", [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": f"Where is order {i}?"}],
                        max_tokens)


def one_request(client: Client, i: int, max_tokens: int) -> Outcome:
    """Send request ``i`` and read its whole stream (an early close would abort it on the
    worker and lighten the load); its TTFT is the first event's arrival."""
    start = time.perf_counter()
    ttft = None
    try:
        for _ in client.generate(_request(i, max_tokens), timeout_s=120.0):
            if ttft is None:
                ttft = time.perf_counter() - start
    except OrchardError as exc:
        return Outcome(ttft, exc.code, exc.retry_after_s)
    return Outcome(ttft) if ttft is not None else Outcome(None, "EMPTY")


def calibrate(client: Client, settings: OverloadSettings) -> float:
    """Interactive requests served a second by ``settings.concurrent`` clients back to back."""
    stop = time.perf_counter() + settings.calibrate_s
    served = [0] * settings.concurrent

    def loop(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            if one_request(client, 1_000_000 + i, settings.max_tokens).ttft_s is not None:
                served[k] += 1
            i += settings.concurrent

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(settings.concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(served) / (time.perf_counter() - start)


class JobProgress:
    """A job's results counted every ``every_s`` on a thread: how many, and the longest gap."""

    def __init__(self, client: Client, job_id: str, every_s: float = 0.5):
        self._samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(client, job_id, every_s),
                                        daemon=True)
        self._thread.start()

    def _sample(self, client: Client, job_id: str, every_s: float) -> None:
        while True:
            self._samples.append((time.perf_counter(), client.job(job_id).done))
            if self._stop.wait(every_s):
                return

    def stop(self) -> tuple[int, float]:
        """Results recorded while sampled, and the longest time without a new one."""
        self._stop.set()
        self._thread.join()
        progress = self._samples[-1][1] - self._samples[0][1]
        gap, last_change = 0.0, self._samples[0][0]
        for (t0, n0), (t1, n1) in zip(self._samples, self._samples[1:]):
            if n1 > n0:
                last_change = t1
            gap = max(gap, t1 - last_change)
        return progress, gap


def flood(client: Client, rate_per_s: float, settings: OverloadSettings) -> list[Outcome]:
    """Open loop: request i is sent at ``i / rate`` seconds, on a thread of its own."""
    n = max(1, int(rate_per_s * settings.seconds))
    with ThreadPoolExecutor(max_workers=min(512, n)) as pool:
        start = time.perf_counter()
        futures = []
        for i in range(n):
            pause = start + i / rate_per_s - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            futures.append(pool.submit(one_request, client, i, settings.max_tokens))
        return [f.result() for f in futures]


def figures_of(outcomes: list[Outcome], capacity: float, rate: float, progress: int,
               gap_s: float, settings: OverloadSettings) -> OverloadFigures:
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    late = sum(t > settings.deadline_s for t in ttfts)
    exhausted = [o for o in outcomes if o.ttft_s is None and o.code == "RESOURCE_EXHAUSTED"]
    with_retry = sum(o.retry_after_s is not None for o in exhausted)
    failed = sum(bool(o.code) and (o.ttft_s is not None or o.code != "RESOURCE_EXHAUSTED")
                 for o in outcomes)
    return OverloadFigures(
        capacity, rate, settings.deadline_s, len(outcomes), len(ttfts), late, with_retry,
        len(exhausted) - with_retry, failed,
        (len(ttfts) - late) / len(ttfts) if ttfts else 0.0,
        with_retry / len(outcomes) if outcomes else 0.0,
        percentile(ttfts, 0.5) if ttfts else 0.0, percentile(ttfts, 0.99) if ttfts else 0.0,
        progress, gap_s, settings.seconds, os.getloadavg())


def bench_overload(model_dir: str, settings: OverloadSettings, log=print) -> OverloadFigures:
    from cluster.config import load_config, write_default_config

    settings.check()
    with tempfile.TemporaryDirectory(prefix="orchard-bench-overload-") as tmp:
        run_dir = Path(tmp)
        write_default_config(run_dir, model_dir=model_dir, max_concurrent=settings.concurrent,
                             max_ttft_s=settings.deadline_s)
        with (run_dir / "orchard.toml").open("a") as f:
            f.write('[telemetry]\nexporter = "none"\n')
        proc = spawn_frontend(run_dir)
        try:
            key = load_config(run_dir).key_for("default")
            with Client.from_run_dir(run_dir, api_key=key) as client:
                one_request(client, -1, settings.max_tokens)  # warm: the model's first pass
                capacity = calibrate(client, settings)
                if capacity <= 0:
                    raise RuntimeError("no interactive request was served while calibrating")
                rate = settings.overload * capacity
                log(f"capacity {capacity:.2f} requests/s; flooding at {rate:.2f}/s beside a "
                    f"job of {settings.batch_requests} for {settings.seconds:g} s")
                job = client.submit([_request(2_000_000 + i, settings.max_tokens)
                                     for i in range(settings.batch_requests)])
                progress = JobProgress(client, job.job_id)
                outcomes = flood(client, rate, settings)
                done, gap = progress.stop()
                if not client.job(job.job_id).finished:
                    client.cancel(job.job_id)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return figures_of(outcomes, capacity, rate, done, gap, settings)


def run_bench(args) -> int:
    from workers.model.default_model import ensure_default_model

    settings = OverloadSettings(args.seconds, args.calibrate, args.deadline, args.overload,
                                args.concurrent, args.max_tokens, args.batch_requests)
    settings.check()
    model_dir = args.model or str(ensure_default_model())
    f = bench_overload(model_dir, settings, log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(asdict(f), indent=2))
        return 0
    print(f"capacity {f.capacity_per_s:.2f} interactive requests/s; flood {f.rate_per_s:.2f}/s "
          f"for {f.seconds:g} s beside a batch job; deadline (TTFT) {f.deadline_s:g} s")
    print(f"interactive_deadline_met_share {f.interactive_deadline_met_share:.3f} "
          f"(target >= 0.95) of {f.accepted} accepted; TTFT p50 {f.ttft_p50_s:.3f} s, "
          f"p99 {f.ttft_p99_s:.3f} s")
    print(f"refused_share {f.refused_share:.3f} ({f.refused} of {f.sent} refused with a "
          f"Retry-After; {f.refused_without_retry_after} without, {f.failed} failed)")
    print(f"served_late {f.served_late} (target 0)")
    print(f"batch_progress {f.batch_progress} results during the flood (longest gap "
          f"{f.batch_longest_gap_s:.1f} s)")
    return 0


def register_bench(sub) -> None:
    d = OverloadSettings()
    p = sub.add_parser("overload", help="an interactive flood at 2x one worker's capacity "
                       "beside a batch job: deadlines met, refusals, the job's progress")
    p.add_argument("--seconds", type=float, default=d.seconds, help="length of the flood")
    p.add_argument("--calibrate", type=float, default=d.calibrate_s,
                   help="seconds of closed-loop requests measuring the capacity")
    p.add_argument("--deadline", type=float, default=d.deadline_s,
                   help="the TTFT (s) an interactive request must meet: [limits] max_ttft_s")
    p.add_argument("--overload", type=float, default=d.overload,
                   help="the flood's rate over the measured capacity")
    p.add_argument("--concurrent", type=int, default=d.concurrent,
                   help="[limits] max_concurrent of the frontend")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--batch-requests", type=int, default=d.batch_requests)
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_bench)
