"""``orchard cache`` and ``orchard invalidate``: the cluster's prefix caches, for operators.

Both go through the gRPC admin API with an admin key (``--api-key``, ``$ORCHARD_API_KEY``, or
the run directory's config).
"""
from __future__ import annotations

import json
from pathlib import Path

from cluster.api.client import Client
from cluster.commands.tls import add_client_args, client_files


def _admin(args) -> Client:
    return Client.from_run_dir(args.run_dir, admin=True, api_key=args.api_key,
                               address=args.address, **client_files(args))


def cache(args) -> int:
    with _admin(args) as client:
        s = client.cache_stats()
    figures = {"workers": s.workers, "cache_bytes": s.cache_bytes,
               "cache_capacity_bytes": s.cache_capacity_bytes, "cache_blocks": s.cache_blocks,
               "input_tokens": s.input_tokens, "cached_tokens": s.cached_tokens,
               "computed_tokens": s.computed_tokens, "written_tokens": s.written_tokens,
               "hit_ratio": round(s.hit_ratio, 4)}
    if s.HasField("disk"):
        figures.update(disk_figures(s.disk))
    if args.json:
        print(json.dumps(figures))
        return 0
    for key, value in figures.items():
        print(f"{key:<22} {value}")
    return 0


def disk_figures(d) -> dict:
    """A disk tier (``orchard.v1.DiskTier``) as the ``disk_*`` figures the commands print."""
    return {"disk_bytes": d.bytes, "disk_capacity_bytes": d.capacity_bytes,
            "disk_blocks": d.blocks,
            "disk_free_bytes": d.free_bytes if d.HasField("free_bytes") else None,
            "disk_corrupt": d.corrupt, "disk_torn": d.torn, "disk_outdated": d.outdated,
            "disk_full": d.full, "disk_evictions": d.evictions}


def _prefix(args) -> dict:
    if args.prefix_tokens is not None:
        try:
            return {"token_ids": [int(t) for t in args.prefix_tokens.split(",") if t.strip()]}
        except ValueError:
            raise ValueError("--prefix-tokens must be comma-separated integers, e.g. 1,2,3")
    if args.prefix_messages is not None:
        path = Path(args.prefix_messages)
        try:
            messages = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path}: expected a JSON list of {{role, content}} messages")
        return {"messages": messages}
    return {}


def invalidate(args) -> int:
    prefix = _prefix(args)
    with _admin(args) as client:
        removed = client.invalidate(args.tenant, **prefix)
    what = "under the prefix" if prefix else "in the namespace"
    print(f"removed {removed} cached blocks of tenant {args.tenant!r} {what}")
    return 0


def _connect_args(parser) -> None:
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="the cluster's run directory (default: $ORCHARD_RUN_DIR or ./run)")
    parser.add_argument("--address", default=None, help="frontend host:port")
    add_client_args(parser)
    parser.add_argument("--api-key", default=None, help="an admin key")


def register(subparsers) -> None:
    p = subparsers.add_parser("cache", help="cluster prefix-cache statistics")
    p.add_argument("--json", action="store_true")
    _connect_args(p)
    p.set_defaults(func=cache)

    p = subparsers.add_parser("invalidate",
                              help="drop a tenant's cached prefixes (all, or under a prefix)")
    p.add_argument("--tenant", required=True)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--prefix-tokens", metavar="IDS", help="comma-separated token ids")
    group.add_argument("--prefix-messages", metavar="FILE.json",
                       help="a JSON list of chat messages: drop what is cached under them")
    _connect_args(p)
    p.set_defaults(func=invalidate)
