"""``ncclguard <command>`` (or ``python -m ncclguard <command>``): the command-line face of ncclguard
(CLIs print; the library logs). One entry point, in torchrun's conventions: ``--version``, ``--help``
without importing any command (only the chosen command's module is imported), and every option
in both spellings where a command takes torchrun's (``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

# command -> (module, one-line help). A module with add_arguments(parser) and run(args) -> int is
# parsed here; one with main(argv) -> int reads its own arguments (torchrun's, a rank's command).
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("ncclguard.cli.run", "torchrun with ncclguard on in every rank, no change to the script"),
    "supervise": (
        "ncclguard.supervise.__main__",
        "run one rank's command under its supervisor: a dead rank posted and restarted alone",
    ),
    "bench": ("ncclguard.bench.main", "measure all_reduce on this machine: busbw, latency, the check's cost"),
    "status": ("ncclguard.cli.status", "a live, read-only view of a running job, read from its store"),
    "report": ("ncclguard.cli.report", "render a merged incident report from an incident directory"),
    "doctor": ("ncclguard.cli.doctor", "check the network and timeout environment and say what to change"),
    "demo": ("ncclguard.cli.demo", "run the 2-rank demo: guarded collectives, a stall caught, a desync named"),
}
OWN_ARGUMENTS = ("run", "supervise", "bench")  # these read their own argv (main(argv))


def version() -> str:
    """ncclguard's installed version, or ``unknown`` (a source tree run without an install)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ncclguard")
    except PackageNotFoundError:
        return "unknown"


def _top_parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="ncclguard",
        description="Collectives that never hang; the rank that hangs a job named, and the job back.",
        epilog=f"commands:\n{commands}\n\n'ncclguard COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ncclguard {version()}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of the commands below")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen command; returns its exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if not args_in or args_in[0] not in COMMANDS:
        _top_parser().parse_args(args_in[:1])  # --help, --version, or a refusal naming the commands
        return 2  # unreachable: argparse exits on each of those
    name, rest = args_in[0], args_in[1:]
    module = importlib.import_module(COMMANDS[name][0])  # only the chosen command's imports
    if name in OWN_ARGUMENTS:
        # torchrun's options, a rank's command, the benchmark's own parser: not ours to parse.
        return int(module.main(rest) or 0)
    help_text = COMMANDS[name][1]
    parser = argparse.ArgumentParser(prog=f"ncclguard {name}", description=help_text)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
