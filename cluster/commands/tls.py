"""``orchard tls init``, and the ``--ca/--cert/--key`` options every client command takes.

``tls init`` writes a private CA, the frontend's certificate (for ``--hosts``) and a client
certificate under ``RUN/tls/`` (``cluster.tls``). With ``--write`` it sets the
``[frontend]`` keys that turn TLS on in ``RUN/orchard.toml`` itself (merged into the section
the file has; ``cluster.config.update_config``), else it prints them to set by hand; then the
files a client on another machine needs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cluster.tls import init_tls
from cluster.config import default_run_dir, update_config, write_default_config


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """``--ca``, ``--cert``, ``--key``: TLS to a frontend (default: the run dir's tls/)."""
    parser.add_argument("--ca", type=Path, default=None,
                        help="the CA certificate to trust (default: RUN/tls/ca.pem if present)")
    parser.add_argument("--cert", type=Path, default=None,
                        help="a client certificate, for mutual TLS (with --key)")
    parser.add_argument("--key", type=Path, default=None, help="the client certificate's key")


def client_files(args) -> dict:
    return {"ca": args.ca, "cert": args.cert, "key": args.key}


def frontend_settings(hosts: list[str], mutual: bool) -> dict[str, str]:
    """The ``[frontend]`` keys that serve the certificates ``init_tls`` wrote."""
    settings = {"tls_cert": "tls/server.pem", "tls_key": "tls/server.key"}
    if hosts:
        settings = {"host": hosts[0], **settings}
    if mutual:
        settings["client_ca"] = "tls/ca.pem"
    return settings


def init(args) -> int:
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else []
    folder = init_tls(run_dir, hosts, force=args.force)
    names = ", ".join([*hosts, "localhost", "127.0.0.1", "::1"])
    print(f"wrote a CA and certificates to {folder} (the server certificate names {names})")
    settings = frontend_settings(hosts, args.mutual)
    if args.write:
        write_default_config(run_dir)  # a run directory without a config gets the default
        path = update_config(run_dir, "frontend", settings)
        print(f"\nset in the [frontend] section of {path}: {', '.join(settings)}; restart the "
              "cluster (`orchard down`, `orchard up`) to serve TLS")
    else:
        print(f"\nTo serve TLS, set these keys in the [frontend] section of "
              f"{run_dir / 'orchard.toml'} (add to the section the file has; a second "
              "[frontend] header is an error), or let `orchard tls init --write` set them:\n")
        for key, value in settings.items():
            print(f'{key} = "{value}"')
        if not args.mutual:
            print('# client_ca = "tls/ca.pem"   # mutual TLS: clients must show client.pem '
                  '(--mutual)')
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
    p.add_argument("--write", action="store_true",
                   help="set the [frontend] TLS keys in RUN/orchard.toml (merged into the "
                        "section it has) instead of printing them")
    p.add_argument("--mutual", action="store_true",
                   help="also require client certificates signed by the CA (client_ca)")
    p.set_defaults(func=init)
