"""``python -m ncclguard.supervise [--restarts N] [--warm-spare] [--preload MOD] [--backoff S] [--stop-grace S] [--kill-wait S] -- CMD ...``"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ncclguard.supervise.loop import DEFAULT_STOP_GRACE_S, KILL_WAIT_S, run_rank


def main(args: Sequence[str] | None = None) -> int:
    """The command line; returns the rank's last exit status."""
    ap = argparse.ArgumentParser(
        prog="ncclguard supervise",  # also python -m ncclguard.supervise
        description="Run one rank's command; when it dies, post its death in the job's store and restart it alone.",
    )
    ap.add_argument("--restarts", type=int, default=1, help="restarts of this rank at most (default 1)")
    ap.add_argument("--backoff", type=float, default=0.0, help="seconds to wait before a cold restart")
    ap.add_argument(
        "--warm-spare",
        action="store_true",
        help="keep a standby process that has imported torch, to take a dead rank's place (about 0.3 GB of memory)",
    )
    ap.add_argument("--preload", action="append", default=[], help="a module the spare imports too (repeatable)")
    ap.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE_S,
        help=f"seconds the rank has to end after SIGTERM/SIGINT, then SIGKILL (default {DEFAULT_STOP_GRACE_S:g})",
    )
    ap.add_argument(
        "--kill-wait",
        type=float,
        default=KILL_WAIT_S,
        help=f"seconds a SIGKILLed rank has to be reaped before it is posted dead and the job goes on (default {KILL_WAIT_S:g})",
    )
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the rank's command")
    ns = ap.parse_args(args)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    try:
        return run_rank(
            cmd,
            ns.restarts,
            backoff_s=ns.backoff,
            warm_spare=ns.warm_spare,
            preload=ns.preload,
            stop_grace_s=ns.stop_grace,
            kill_wait_s=ns.kill_wait,
        )
    except ValueError as exc:
        ap.error(str(exc))
    return 2  # unreachable: ap.error exits


if __name__ == "__main__":
    sys.exit(main())
