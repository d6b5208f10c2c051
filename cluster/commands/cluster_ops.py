"""``orchard up``, ``down``, ``scale``, ``drain``, ``workers``, ``frontends``: running and
operating a cluster.

``up`` and ``down`` manage the serving process (``cluster.daemon``); ``frontends`` reads the
job store's leases (``cluster.jobs.lease``) straight from the run directory. ``scale``, ``drain`` and
``workers`` act on a running cluster through the gRPC admin API (``cluster.api.client`` with an
admin key from the run directory's ``orchard.toml``), so they work while jobs run and from any
machine that can reach the frontend.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from urllib.parse import urlsplit

from cluster.commands.cache import disk_figures
from cluster.commands.tls import add_client_args
from cluster.config import CONFIG_NAME, Config, default_run_dir, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start a cluster: Ray, worker actors, router, frontend")
    _run_dir(up)
    up.add_argument("--workers", type=int, default=2, help="worker actors to start (default 2)")
    up.add_argument("--address", default=None,
                    help="join the Ray cluster at HOST:PORT instead of starting one locally")
    up.add_argument("--detach", action="store_true",
                    help="leave the cluster running in the background and return once ready")
    up.add_argument("--cpus-per-worker", type=float, default=1.0,
                    help="CPUs each worker actor reserves (sets its BLAS threads; default 1)")
    up.add_argument("--workers-per-node", type=int, default=1,
                    help="worker actors allowed on one node (default 1: one MLX worker per Mac)")
    up.set_defaults(func=cmd_up)

    down = subparsers.add_parser("down", help="stop the cluster started with `orchard up --detach`")
    _run_dir(down)
    down.set_defaults(func=cmd_down)

    scale = subparsers.add_parser("scale", help="add or drain workers until N serve")
    _admin_args(scale)
    scale.add_argument("--workers", type=int, required=True)
    scale.add_argument("--json", action="store_true")
    scale.set_defaults(func=cmd_scale)

    drain = subparsers.add_parser("drain", help="stop routing to a worker; it finishes and leaves")
    _admin_args(drain)
    drain.add_argument("worker", help="worker id, as `orchard workers` lists it")
    drain.add_argument("--json", action="store_true")
    drain.set_defaults(func=cmd_drain)

    fronts = subparsers.add_parser("frontends", help="list the frontends serving the run "
                                   "directory's job store: address, lease, jobs they run")
    _run_dir(fronts)
    fronts.add_argument("--json", action="store_true")
    fronts.set_defaults(func=cmd_frontends)

    workers = subparsers.add_parser("workers", help="list workers: node, state, load, cache")
    _admin_args(workers)
    workers.add_argument("--json", action="store_true")
    workers.set_defaults(func=cmd_workers)


def _run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="the cluster's run directory (default: $ORCHARD_RUN_DIR or ./run)")


def _admin_args(parser: argparse.ArgumentParser) -> None:
    _run_dir(parser)
    parser.add_argument("--address", default=None, help="frontend host:port")
    add_client_args(parser)
    parser.add_argument("--api-key", default=None, help="an admin API key")


def _options(args):
    from cluster.backend.bootstrap import Placement
    from cluster.daemon import UpOptions

    return UpOptions(args.run_dir or default_run_dir(), args.workers, args.address,
                     Placement(args.cpus_per_worker, args.workers_per_node))


def cmd_up(args) -> int:
    from cluster import daemon

    options = _options(args)
    if args.detach:
        state = daemon.spawn_detached(options)
        ending = f"stop it with `orchard down --run-dir {options.run_dir}`"
        print("\n".join(up_lines(state, load_config(options.run_dir), ending)), flush=True)
        return 0

    def ready(state) -> None:
        config = load_config(options.run_dir)
        print("\n".join(up_lines(state, config, "Ctrl-C to stop")), flush=True)
    daemon.serve_until_stopped(options, ready)
    print("orchard: cluster stopped", flush=True)
    return 0


def up_lines(state, config: Config, ending: str) -> list[str]:
    """What ``orchard up`` prints once the cluster serves: both addresses with their ports,
    and, when a port was picked at this start (``port = 0``), how to pin it."""
    grpc_port = state.frontend.rpartition(":")[2]
    http = (f"HTTP API {state.http} (port {urlsplit(state.http).port})" if state.http
            else "HTTP API off ([http] enabled = false)")
    lines = [f"orchard: cluster up (pid {state.pid}): gRPC {state.frontend} (port {grpc_port}), "
             f"{http}, {state.workers} worker(s), Ray {state.ray_address}; {ending}"]
    picked = [name for name, port, on in (("[frontend] port", config.port, True),
                                          ("[http] port", config.http.port, bool(state.http)))
              if on and port == 0]
    if picked:
        lines.append(f"orchard: {' and '.join(picked)} = 0 in "
                     f"{config.run_dir / CONFIG_NAME}: a free port, new at every start; "
                     "set a fixed one there for clients on other machines")
    if state.metrics:
        lines.append(f"orchard: Prometheus metrics at {state.metrics}/metrics (no key, this "
                     "machine only); also on the HTTP port with an admin key")
    return lines


def cmd_down(args) -> int:
    from cluster import daemon

    run_dir = args.run_dir or default_run_dir()
    state = daemon.stop_detached(run_dir)
    if state is None:
        print(f"orchard: no cluster process recorded in {run_dir}; stopped what a killed one "
              "left running")
    else:
        print(f"orchard: cluster stopped (pid {state.pid}, run dir {run_dir})")
    return 0


def cmd_frontends(args) -> int:
    """The job store's frontends, read from it directly (no frontend needs to answer)."""
    import time

    from cluster.jobs.lease import frontends

    db_path = load_config(args.run_dir or default_run_dir()).db_path
    if not db_path.exists():
        raise ValueError(f"{db_path}: no job store there; pass the cluster's --run-dir")
    now_ms = time.time_ns() // 1_000_000
    state = frontends(db_path, now_ms)
    if args.json:
        print(json.dumps({"frontends": [
            {"frontend_id": f.frontend_id, "address": f.address, "jobs": f.jobs,
             "lease_left_s": round((f.expires_ms - now_ms) / 1000, 3)} for f in state.live],
            "orphaned_jobs": state.orphaned_jobs}, indent=2))
        return 0
    print(f"{'frontend':<20} {'address':<24} {'jobs':>5} {'lease left':>10}")
    for f in state.live:
        print(f"{f.frontend_id:<20} {f.address:<24} {f.jobs:>5} "
              f"{(f.expires_ms - now_ms) / 1000:>9.1f}s")
    print(f"unfinished jobs no live frontend holds (taken at the next lease tick): "
          f"{state.orphaned_jobs}")
    return 0


def _admin(args):
    from cluster.api.client import Client
    from cluster.commands.tls import client_files

    return Client.from_run_dir(args.run_dir, admin=True, api_key=args.api_key,
                               address=args.address, **client_files(args))


def _call(fn):
    from cluster.api.client import OrchardError

    try:
        return fn()
    except OrchardError as exc:
        raise ValueError(str(exc)) from None


def cmd_scale(args) -> int:
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    with _admin(args) as client:
        workers = _call(lambda: client.scale(args.workers))
    _print_workers(workers, args.json)
    return 0


def cmd_drain(args) -> int:
    with _admin(args) as client:
        worker = _call(lambda: client.drain(args.worker))
    _print_workers([worker], args.json)
    return 0


def cmd_workers(args) -> int:
    with _admin(args) as client:
        workers = _call(client.workers)
    _print_workers(workers, args.json)
    return 0


def worker_dict(w) -> dict:
    out = {"worker_id": w.worker_id, "node": w.node, "state": w.state, "running": w.running,
           "queued_tokens": w.queued_tokens, "cache_bytes": w.cache_bytes,
           "cache_capacity_bytes": w.cache_capacity_bytes, "cache_blocks": w.cache_blocks,
           "hit_ratio": round(w.hit_ratio, 4), "requests_served": w.requests_served}
    if w.HasField("disk"):
        out.update(disk_figures(w.disk))
    return out


def _print_workers(workers, as_json: bool) -> None:
    if as_json:
        print(json.dumps([worker_dict(w) for w in workers], indent=2))
        return
    print(f"{'worker':<8} {'node':<14} {'state':<9} {'running':>7} {'queued':>7} "
          f"{'cache MiB':>9} {'blocks':>7} {'hit':>6} {'served':>7}   disk tier")
    for w in workers:
        print(f"{w.worker_id:<8} {w.node[:12]:<14} {w.state:<9} {w.running:>7} "
              f"{w.queued_tokens:>7} {w.cache_bytes / 2**20:>9.2f} {w.cache_blocks:>7} "
              f"{w.hit_ratio:>6.1%} {w.requests_served:>7}   {_disk_line(w)}", file=sys.stdout)


def _disk_line(w) -> str:
    if not w.HasField("disk"):
        return "none"
    d = w.disk
    free = f"{d.free_bytes / 2**30:.1f} GiB free" if d.HasField("free_bytes") else "free unknown"
    line = (f"{d.bytes / 2**20:.2f} of {d.capacity_bytes / 2**20:.0f} MiB, {d.blocks} blocks, "
            f"{free}, corrupt {d.corrupt}, torn {d.torn}, evicted {d.evictions}")
    return line + (", FULL: writes stopped" if d.full else "")
