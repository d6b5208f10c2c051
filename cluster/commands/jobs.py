"""``orchard submit``, ``orchard results``, ``orchard jobs``, ``orchard cancel``: batch jobs.

``orchard submit`` streams the file (``Client.submit_file``); the server checks each line and
names a bad one. ``orchard jobs prune --older-than DAYS`` works on the run directory's job
store directly (no frontend needed). The others talk to a running frontend through
``cluster.api.client``: the address comes from ``--address``, ``$ORCHARD_ADDRESS`` or the run
directory's ``frontend.json``; the API key from ``--api-key``, ``$ORCHARD_API_KEY`` or the run
directory's ``orchard.toml`` (``--tenant``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from cluster.api.batchfile import output_lines
from cluster.api.client import Client, JobStatus, OrchardError
from cluster.commands.tls import add_client_args, client_files
from cluster.config import CacheConfig, default_run_dir, load_config
from cluster.jobs.store import JobStore
from cluster.report.summary import forecast_of, summarize_job
from router.cost import load_price_table
from proto.orchard.v1 import orchard_pb2 as pb

PROGRESS_BYTES = 4 << 20  # files smaller than this are sent without a progress bar
SPAN_FLUSH_S = 6.0  # the trace exporter's batch delay (OpenTelemetry's default 5 s) and a margin


def _connect_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="the cluster's run directory (default: $ORCHARD_RUN_DIR or ./run)")
    parser.add_argument("--address", default=None, help="frontend host:port")
    add_client_args(parser)
    parser.add_argument("--api-key", default=None, help="a tenant API key")
    parser.add_argument("--tenant", default=None, help="use this tenant's key from the config")


def _client(args) -> Client:
    return Client.from_run_dir(args.run_dir, tenant=args.tenant, api_key=args.api_key,
                               address=args.address, **client_files(args))


def _job_dict(job: JobStatus) -> dict:
    return {"job_id": job.job_id, "state": job.state, "total": job.total,
            "completed": job.completed, "failed": job.failed, "cancelled": job.cancelled,
            "created_unix_ms": job.created_unix_ms, "finished_unix_ms": job.finished_unix_ms,
            "priority": job.priority}


def _progress_line(job: JobStatus, started: float) -> str:
    return (f"{job.job_id} {job.state}: {job.done}/{job.total} done, {job.failed} failed, "
            f"{time.monotonic() - started:.1f} s")


PRIORITIES = {"batch": pb.PRIORITY_BATCH, "interactive": pb.PRIORITY_INTERACTIVE}


def _send_file(client: Client, path: Path, idempotency_key: str, priority: str = "batch"
               ) -> JobStatus:
    """Stream ``path`` to the server with a progress bar on stderr (big files take seconds)."""
    size = path.stat().st_size
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=Console(stderr=True), transient=True,
                  disable=size < PROGRESS_BYTES) as progress:
        task = progress.add_task(f"sending {path.name}", total=size)
        try:
            return client.submit_file(path, idempotency_key,
                                      on_sent=lambda n: progress.update(task, completed=n),
                                      priority=PRIORITIES[priority])
        except OrchardError as exc:
            raise ValueError(f"{exc.code}: {exc.message}") from None


def _summary_line(args, client: Client, job: JobStatus) -> str:
    """Requests, tokens, forecast and measured M and cost (``cluster.report.summary``),
    priced with the run directory's price table, TTL and block size (orchard's defaults
    when this machine has no run directory)."""
    run_dir = args.run_dir if args.run_dir is not None else default_run_dir()
    try:
        config = load_config(run_dir)
    except FileNotFoundError:
        config = None
    cache = config.cache if config else CacheConfig()
    prices = load_price_table((config.telemetry.prices if config else "") or None)
    forecast, model = forecast_of(job.job_id, run_dir / "traces")
    # The job's span reaches the trace files with the exporter's next batch (up to
    # SPAN_FLUSH_S after the job started): a job that finished sooner waits for it.
    deadline = time.monotonic() + SPAN_FLUSH_S
    while forecast is None and (run_dir / "traces").is_dir() and time.monotonic() < deadline:
        time.sleep(0.25)
        forecast, model = forecast_of(job.job_id, run_dir / "traces")
    summary = summarize_job(job.job_id, client.results(job.job_id), prices, model or job.model,
                            cache.ttl_s, cache.block_size, forecast)
    return summary.line()


def submit(args) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with _client(args) as client:
        job = _send_file(client, path, args.idempotency_key, args.priority)
        # stderr, so that --json output stays one object; the id is known even if the wait
        # is interrupted (the job keeps running: `orchard results JOB` later)
        print(f"submitted {job.job_id}: {job.total} requests", file=sys.stderr)
        if args.wait:
            started = time.monotonic()
            tty = sys.stderr.isatty()

            def show(status: JobStatus) -> None:
                end = "\r" if tty and not status.finished else "\n"
                print(_progress_line(status, started), end=end, file=sys.stderr, flush=True)

            job = client.wait(job.job_id, on_progress=show)
            print(_summary_line(args, client, job), file=sys.stderr)
    if args.json:
        print(json.dumps(_job_dict(job)))
    else:
        print(job.job_id)
    return 0


def results(args) -> int:
    with _client(args) as client:
        job = client.job(args.job)
        lines = output_lines(client.results(args.job, follow=args.wait),
                             created_s=job.created_unix_ms // 1000)
    text = "".join(line + "\n" for line in lines)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {len(lines)} results of {job.total} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def jobs(args) -> int:
    since_ms = parse_since(args.since, time.time()) if args.since else 0
    with _client(args) as client:
        listed = client.jobs(limit=args.limit, states=args.state or (), since_ms=since_ms)
    if args.json:
        print(json.dumps([_job_dict(j) for j in listed]))
        return 0
    print(f"{'JOB':<22} {'STATE':<10} {'DONE':>9} {'FAILED':>6}  {'CREATED (UTC)':<19}  "
          "FINISHED (UTC)")
    for job in listed:
        print(f"{job.job_id:<22} {job.state:<10} {f'{job.done}/{job.total}':>9} "
              f"{job.failed:>6}  {_when(job.created_unix_ms):<19}  "
              f"{_when(job.finished_unix_ms)}")
    return 0


def prune(args) -> int:
    """Delete finished jobs older than ``--older-than`` days, straight from the job store
    (safe beside a running frontend: it never touches queued or running jobs)."""
    if args.older_than < 0:
        raise ValueError(f"--older-than must be >= 0 days, got {args.older_than}")
    db_path = load_config(args.run_dir or default_run_dir()).db_path
    if not db_path.exists():
        raise ValueError(f"{db_path}: no job store there; pass the cluster's --run-dir")
    now_ms = time.time_ns() // 1_000_000
    store = JobStore(db_path, lambda: now_ms)
    try:
        before = db_path.stat().st_size
        removed = store.prune(now_ms - int(args.older_than * 86_400_000))
        after = db_path.stat().st_size
    finally:
        store.close()
    print(f"pruned {removed} finished job(s) older than {args.older_than:g} days; "
          f"{db_path} {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
    return 0


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) if ms else "-"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now_s: float) -> int:
    """``--since``: a duration back from now (``90m``, ``6h``, ``2d``) or a UTC date or time
    (``2026-11-30``, ``2026-11-30T08:00``); milliseconds since the epoch."""
    text = text.strip()
    if text[:-1].replace(".", "", 1).isdigit() and text[-1:] in _UNITS:
        return int((now_s - float(text[:-1]) * _UNITS[text[-1]]) * 1000)
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since: {text!r} is neither a duration (90m, 6h, 2d) nor a UTC "
                         "date or time (2026-11-30, 2026-11-30T08:00)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return int(moment.timestamp() * 1000)


def cancel(args) -> int:
    with _client(args) as client:
        job = client.cancel(args.job)
    print(json.dumps(_job_dict(job)))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("submit", help="submit an OpenAI Batch JSONL file as a job")
    p.add_argument("file", metavar="FILE.jsonl")
    p.add_argument("--wait", action="store_true", help="show progress until the job finishes")
    p.add_argument("--json", action="store_true", help="print the job id, state and counts")
    p.add_argument("--idempotency-key", default="", metavar="KEY",
                   help="submitting again with the same KEY returns the first job, not a new one")
    p.add_argument("--priority", choices=sorted(PRIORITIES), default="batch",
                   help="the lane the job's requests take (default batch; interactive: served "
                        "before batch work, never shed)")
    _connect_args(p)
    p.set_defaults(func=submit)

    p = subparsers.add_parser("results", help="write a job's results (OpenAI Batch output)")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--out", default=None, help="write to FILE instead of stdout")
    p.add_argument("--wait", action="store_true", help="wait for the job to finish")
    _connect_args(p)
    p.set_defaults(func=results)

    p = subparsers.add_parser("jobs", help="list this tenant's jobs, newest first; "
                              "`jobs prune` deletes old finished ones")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p.add_argument("--state", action="append", metavar="STATE",
                   choices=("queued", "running", "succeeded", "cancelled"),
                   help="only jobs in STATE (repeat for several)")
    p.add_argument("--since", default=None, metavar="WHEN",
                   help="only jobs created since WHEN: 90m, 6h, 2d, or a UTC date/time")
    p.add_argument("--json", action="store_true")
    _connect_args(p)
    p.set_defaults(func=jobs)
    actions = p.add_subparsers(dest="action", metavar="{prune}")
    q = actions.add_parser("prune", help="delete finished jobs (and their requests and "
                           "results) from the job store")
    q.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                   help="jobs that finished more than DAYS days ago")
    q.add_argument("--run-dir", type=Path, default=None,
                   help="the cluster's run directory (default: $ORCHARD_RUN_DIR or ./run)")
    q.set_defaults(func=prune)

    p = subparsers.add_parser("cancel", help="cancel a queued or running job")
    p.add_argument("job", metavar="JOB")
    _connect_args(p)
    p.set_defaults(func=cancel)
