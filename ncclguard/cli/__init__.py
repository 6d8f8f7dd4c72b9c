"""``python -m ncclguard <command>``: the command-line face of ncclguard (CLIs print; the library logs)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# command -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("ncclguard.cli.demo", "run the 2-rank demo: guarded collectives, a stall caught, a desync named"),
    "doctor": ("ncclguard.cli.doctor", "check the network and timeout environment and say what to change"),
    "report": ("ncclguard.cli.report", "render a merged incident report from an incident directory"),
    "status": ("ncclguard.cli.status", "a live, read-only view of a running job, read from its store"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="python -m ncclguard", description="Collectives that never hang.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        modules[name] = importlib.import_module(module)
        modules[name].add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
