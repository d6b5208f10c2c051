"""The ``orchard`` command line: discovers the subcommand modules in ``cluster.commands``.

Errors meant for the user (``ValueError`` and ``FileNotFoundError`` carrying a message that
says what to fix) print as ``orchard: error: ...`` with exit status 2, never a traceback; an
error status from a running cluster's API (``OrchardError``) prints the same way, status 1.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from cluster import commands
from cluster.api.client import OrchardError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchard", description="Prefix-cache-aware LLM serving on a Ray cluster of Macs")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"orchard: error: {exc}", file=sys.stderr)
        return 2
    except OrchardError as exc:
        print(f"orchard: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("orchard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
