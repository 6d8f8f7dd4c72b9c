"""``python -m ncclguard demo``: the main job, as acts run one after the other on real ranks.

Each act is a module under ``ncclguard.cli`` with ``run(args) -> int`` that launches its own
ranks (gloo, CPU) and prints what happened. The demo fails when an act fails.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

# The acts, in order. Each module: TITLE (str) and run(args) -> int (0 = the act showed what it should).
ACTS = [
    "ncclguard.cli.demo_collectives",
    "ncclguard.cli.demo_bench",
    "ncclguard.cli.demo_desync",
    "ncclguard.cli.demo_recovery",
    "ncclguard.cli.demo_commit",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(n.rsplit(".", 1)[1] for n in ACTS)
    parser.add_argument("--only", help=f"run only the act whose module name ends with this ({names})")


def run(args: argparse.Namespace) -> int:
    if args.only and not any(name.endswith(args.only) for name in ACTS):
        names = ", ".join(n.rsplit(".", 1)[1] for n in ACTS)
        print(f"ncclguard demo: no act named {args.only!r}; the acts: {names}", file=sys.stderr)
        return 2
    failed = []
    for name in ACTS:
        if args.only and not name.endswith(args.only):
            continue
        act = importlib.import_module(name)
        print(f"\n=== {act.TITLE} ===", flush=True)
        start = time.monotonic()
        rc = act.run(args)
        print(f"--- {'ok' if rc == 0 else 'FAILED'} ({time.monotonic() - start:.1f} s)", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"\ndemo: {len(failed)} act(s) failed: {', '.join(failed)}")
        return 1
    print("\ndemo: every act showed what it should.")
    return 0
