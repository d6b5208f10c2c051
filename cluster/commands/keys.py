"""``orchard keys create / list / revoke``: tenant API keys an operator manages.

They work on the run directory's key file (``cluster.api.keys``), so they need the operator's
access to it (the head machine); a running frontend picks every change up on its next call.
A created key is printed once and stored only as a hash.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cluster.api.keys import KeyRecord, KeyStore
from cluster.config import default_run_dir, load_config


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _store(args) -> tuple[KeyStore, Path]:
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    return KeyStore(run_dir, _now_ms), run_dir


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ms / 1000)) if ms else "-"


def _record_dict(record: KeyRecord) -> dict:
    return {"id": record.key_id, "tenant": record.tenant, "name": record.name,
            "state": record.state(_now_ms()), "created_unix_ms": record.created_ms,
            "expires_unix_ms": record.expires_ms, "revoked_unix_ms": record.revoked_ms}


def create(args) -> int:
    store, run_dir = _store(args)
    tenants = load_config(run_dir).tenants()
    if args.tenant not in tenants:
        raise ValueError(f"--tenant: no tenant {args.tenant!r} in {run_dir}/orchard.toml; "
                         f"known tenants: {', '.join(tenants) or 'none'}")
    record, key = store.create(args.tenant, args.name, args.expires)
    if args.json:
        print(json.dumps({**_record_dict(record), "key": key}))
        return 0
    print(f"created {record.key_id} for tenant {record.tenant}"
          f"{f', expires {_when(record.expires_ms)} UTC' if record.expires_ms else ''}",
          file=sys.stderr)
    print("the key (shown once; orchard keeps only its hash):", file=sys.stderr)
    print(key)
    return 0


def list_keys(args) -> int:
    store, _ = _store(args)
    records = store.list()
    if args.json:
        print(json.dumps([_record_dict(r) for r in records]))
        return 0
    print(f"{'ID':<18} {'TENANT':<12} {'NAME':<16} {'STATE':<8} {'CREATED (UTC)':<17} EXPIRES")
    for r in records:
        print(f"{r.key_id:<18} {r.tenant:<12} {r.name or '-':<16} {r.state(_now_ms()):<8} "
              f"{_when(r.created_ms):<17} {_when(r.expires_ms)}")
    return 0


def revoke(args) -> int:
    store, _ = _store(args)
    record = store.revoke(args.id)
    print(json.dumps(_record_dict(record)))
    return 0


def register(subparsers) -> None:
    keys = subparsers.add_parser("keys", help="manage tenant API keys (create, list, revoke)")
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)

    p = sub.add_parser("create", help="create a key for a tenant; printed once")
    p.add_argument("--tenant", required=True)
    p.add_argument("--name", default="", help="a label to recognise the key by")
    p.add_argument("--expires", type=float, default=None, metavar="DAYS",
                   help="the key stops working after DAYS days (default: never)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=create)

    p = sub.add_parser("list", help="every managed key: id, tenant, name, state, dates")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=list_keys)

    p = sub.add_parser("revoke", help="revoke a key by id; a running frontend refuses it at once")
    p.add_argument("id", metavar="ID")
    p.set_defaults(func=revoke)

    for p in sub.choices.values():
        p.add_argument("--run-dir", type=Path, default=None,
                       help="the cluster's run directory (default: $ORCHARD_RUN_DIR or ./run)")
