"""``orchard traces gather``: every node's trace files in one directory, for ``orchard report``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.config import default_run_dir


def gather(args) -> int:
    from cluster.backend import bootstrap
    from cluster.daemon import ClusterState
    from cluster.telemetry.gather import gather as gather_files

    run_dir = args.run_dir if args.run_dir is not None else default_run_dir()
    address = args.ray_address
    if address is None:
        state = ClusterState.read(run_dir)
        if state is None:
            raise ValueError(f"no cluster is running from {run_dir} (no cluster.json): start it "
                             f"with `orchard up --run-dir {run_dir}` or pass --ray-address")
        address = state.ray_address
    bootstrap.join(address)
    try:
        alive = [(n.node_id, n.address) for n in bootstrap.nodes() if n.alive]
        print(f"gathering from {len(alive)} node(s) into {args.out}", file=sys.stderr)

        def show(node, written: int) -> None:
            size = sum(len(data) for _, _, data in node.files)
            print(f"  node {node.address} ({node.node_id[:12]}): {len(node.files)} files, "
                  f"{size / 1e6:.1f} MB, {written} new", file=sys.stderr)

        total = gather_files(run_dir, args.out, alive, show)
    finally:
        bootstrap.shutdown()
    print(f"wrote {total} files; read them with `orchard report --traces {args.out / 'traces'}`")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("traces", help="trace files of a multi-node cluster")
    sub = p.add_subparsers(dest="traces_command", required=True)
    g = sub.add_parser("gather", help="copy every node's trace and metric files into one "
                                      "directory, through Ray (no scp needed)")
    g.add_argument("--run-dir", type=Path, default=None,
                   help="the cluster's run directory, the same path on every node "
                        "(default: $ORCHARD_RUN_DIR or ./run)")
    g.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="the Ray head (default: the running cluster's, from cluster.json)")
    g.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="where to write DIR/traces and DIR/metrics")
    g.set_defaults(func=gather)
