"""The ``nexus`` command: parses arguments and starts or calls the components.

Each subcommand lives in its own ``nexus/<name>_cmd.py`` module exposing
``register(subparsers)``, which adds its parser and sets ``func`` to a callable
``(args) -> int`` returning the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nexus.process import die_with_parent

# Modules that contribute subcommands, in help order.
COMMAND_MODULES = (
    "nexus.serve_cmd",
    "nexus.components_cmd",
    "nexus.models_cmd",
    "nexus.profile_cmd",
    "nexus.plan_cmd",
    "nexus.bench_cmd",
    "nexus.queries_cmd",
    "nexus.status_cmd",
    "nexus.simulate_cmd",
    "nexus.db_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nexus", description="Nexus-style DNN inference serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subcommand not built (yet); its own missing deps still fail loudly
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
