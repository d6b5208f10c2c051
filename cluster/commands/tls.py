"""``orchard tls init``, and the ``--ca/--cert/--key`` options every client command takes.

``tls init`` writes a private CA, the frontend's certificate (for ``--hosts``) and a client
certificate under ``RUN/tls/`` (``cluster.api.tls``), then prints the ``[frontend]`` lines
that turn TLS on and the files a client on another machine needs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cluster.api.tls import init_tls
from cluster.config import default_run_dir


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """``--ca``, ``--cert``, ``--key``: TLS to a frontend (default: the run dir's tls/)."""
    parser.add_argument("--ca", type=Path, default=None,
                        help="the CA certificate to trust (default: RUN/tls/ca.pem if present)")
    parser.add_argument("--cert", type=Path, default=None,
                        help="a client certificate, for mutual TLS (with --key)")
    parser.add_argument("--key", type=Path, default=None, help="the client certificate's key")


def client_files(args) -> dict:
    return {"ca": args.ca, "cert": args.cert, "key": args.key}


def init(args) -> int:
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else []
    folder = init_tls(run_dir, hosts, force=args.force)
    names = ", ".join([*hosts, "localhost", "127.0.0.1", "::1"])
    print(f"wrote a CA and certificates to {folder} (the server certificate names {names})")
    print(f"\nTo serve TLS, set in {run_dir / 'orchard.toml'}:\n")
    print("[frontend]")
    print(f'host = "{hosts[0] if hosts else "127.0.0.1"}"')
    print('tls_cert = "tls/server.pem"\ntls_key = "tls/server.key"')
    print('client_ca = "tls/ca.pem"   # optional: mutual TLS, clients must show client.pem')
    print("\nA client on another machine needs ca.pem (and, for mutual TLS, client.pem and "
          "client.key)\nin its run directory's tls/ folder, or passed as --ca/--cert/--key.")
    return 0


def register(subparsers) -> None:
    tls = subparsers.add_parser("tls", help="TLS for serving other machines (init)")
    sub = tls.add_subparsers(dest="tls_command", metavar="ACTION", required=True)
    p = sub.add_parser("init", help="create a CA, a server and a client certificate")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the cluster's run directory (default: $ORCHARD_RUN_DIR or ./run)")
    p.add_argument("--hosts", default="", metavar="NAME,IP,...",
                   help="names and addresses clients reach the head by (loopback is added)")
    p.add_argument("--force", action="store_true", help="replace an existing CA")
    p.set_defaults(func=init)
