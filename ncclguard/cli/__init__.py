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
    "run": ("ncclguard.cli.run", "torchrun with ncclguard on in every rank, no change to the script"),
    "status": ("ncclguard.cli.status", "a live, read-only view of a running job, read from its store"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen command; returns its exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["run"]:
        # torchrun's options and the script's arguments are not ours to parse: run reads them itself.
        from ncclguard.cli import run

        return run.main(args_in[1:])
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
