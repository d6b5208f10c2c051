"""One module per group of ``orchard`` subcommands.

Each module defines ``register(subparsers)``, which adds its subcommands and sets ``func`` (a
callable taking the parsed arguments and returning an exit code) on each. ``cluster.cli``
discovers the modules here, so adding a command never touches a shared list.
"""
