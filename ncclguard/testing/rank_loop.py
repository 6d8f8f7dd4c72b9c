"""Restarts one rank alone: ``python -m ncclguard.testing.rank_loop --restarts N -- CMD ...``.

A launcher that tears every worker down when one exits non-zero (torchrun's agent) cannot heal a
single rank. Run this as the worker instead: it runs ``CMD`` and, when it ends by a signal or a
non-zero status, runs it again with the same environment (same ``RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and ``NCCLGUARD_RESTART_COUNT`` set to the restart number, up to ``N`` times.
The launcher sees one process that has not exited, so the other ranks are left alone and the
restarted process rejoins them (``RecoveringStep(..., heal=True)``). Under torchrun::

    torchrun --nproc-per-node=4 -m ncclguard.testing.rank_loop --restarts 2 -- python train.py

It exits with the last run's status (128 + the signal for a run killed by one), so a rank that
keeps dying still ends the job. SIGTERM and SIGINT sent to it are passed to the running command.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "run_rank"]

RESTART_COUNT_VAR = "NCCLGUARD_RESTART_COUNT"


def run_rank(argv: Sequence[str], restarts: int, *, backoff_s: float = 0.0) -> int:
    """Runs ``argv``, restarting it after each failure up to ``restarts`` times.

    Args:
        argv: the rank's command, as a list (no shell).
        restarts: the most restarts.
        backoff_s: seconds to wait before each restart.

    Returns:
        The last run's exit status as a shell gives it (128 + N for a run killed by signal N).

    Raises:
        ValueError: an empty command or a negative ``restarts``.
    """
    if not argv:
        raise ValueError("rank_loop needs the rank's command after --")
    if restarts < 0:
        raise ValueError(f"restarts must be >= 0, got {restarts}")
    child: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        count = 0
        while True:
            env = {**os.environ, RESTART_COUNT_VAR: str(count)}
            proc = subprocess.Popen(list(argv), env=env)
            child[:] = [proc]
            rc = proc.wait()
            status = 128 - rc if rc < 0 else rc
            if rc == 0 or count >= restarts:
                return status
            count += 1
            sys.stderr.write(f"ncclguard.testing.rank_loop: the rank exited {rc}; restart {count} of {restarts}\n")
            sys.stderr.flush()
            time.sleep(backoff_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(args: Sequence[str] | None = None) -> int:
    """The command line: ``--restarts N [--backoff S] -- CMD ...``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m ncclguard.testing.rank_loop", description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=1, help="restarts of this rank at most (default 1)")
    ap.add_argument("--backoff", type=float, default=0.0, help="seconds to wait before a restart")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the rank's command")
    ns = ap.parse_args(args)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    return run_rank(cmd, ns.restarts, backoff_s=ns.backoff)


if __name__ == "__main__":
    sys.exit(main())
