"""The orphan guard of ``ncclguard run``: a launcher that dies without ending its job takes the job with it.

torchrun's agent stops every worker on its orderly way out (a failed rank, SIGTERM, SIGINT). Killed
outright (SIGKILL: the OOM killer, a lost node agent) it stops nothing, and since it starts each
worker in a session of its own, the workers, their supervisors' ranks and everything they started
run on. ``ncclguard run`` starts this guard before torchrun, as a process of its own (detached: it is
neither among the launcher's children nor in its process group or session), holding the read end of
a pipe whose write end only the launcher holds. The launcher writes ``done`` when it returns; the
end of the pipe without ``done`` means the launcher died. The guard then

1. finds the job's processes: those whose environment holds the launcher's ``NCCLGUARD_LAUNCHER``
   token, which every worker and everything it starts inherits;
2. sends each of them, and the process group each worker leads, SIGTERM (a supervisor stops its rank
   and exits, a plain rank ends or writes its preemption checkpoint);
3. after the grace (the stop grace, default 8 s), sends SIGKILL to whatever is left, and exits.

It runs by path (``python -S .../reaper.py``) on the standard library alone: importing ncclguard would
import torch (seconds, hundreds of MB) in a process that only waits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DONE", "Guard", "holders", "holds", "main", "reap"]

DONE = b"done\n"  # what the launcher writes when it returns: no reaping
_VAR = b"NCCLGUARD_LAUNCHER="  # ncclguard.supervise.parent.LAUNCHER_VAR (not imported: the guard is torch-free)
STARTER_WAIT_S = 30.0  # the guard's starter forks it and exits (tens of ms); past this it is given up
_log = logging.getLogger("ncclguard")


def holds(environ: bytes, token: str) -> bool:
    """Whether a process's ``/proc/PID/environ`` (NUL-separated) holds ``NCCLGUARD_LAUNCHER=token``."""
    return bool(token) and _VAR + token.encode() in environ.split(b"\0")


def holders(token: str, proc: Path = Path("/proc"), skip: Sequence[int] = ()) -> list[int]:
    """The pids of the processes whose environment holds the launcher's ``token``.

    Args:
        token: the launcher's ``NCCLGUARD_LAUNCHER`` value.
        proc: where the processes are listed.
        skip: pids never listed (the guard itself).

    Returns:
        The pids, those of processes this user may read (a zombie's environment reads empty: not listed).
    """
    out = []
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if holds((entry / "environ").read_bytes(), token):
                out.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(out)


def _signal(pids: Sequence[int], signum: int) -> None:
    """Sends ``signum`` to each process, and to the process group of each that leads one."""
    mine = os.getpgrp()
    for pid in pids:
        try:
            if os.getpgid(pid) == pid and pid != mine:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            continue


def reap(token: str, grace_s: float, *, proc: Path = Path("/proc"), poll_s: float = 0.1) -> list[int]:
    """Ends the processes that hold ``token``: SIGTERM, then SIGKILL to those left after ``grace_s``.

    Args:
        token: the launcher's ``NCCLGUARD_LAUNCHER`` value.
        grace_s: seconds they have to end after SIGTERM.
        proc: where the processes are listed.
        poll_s: how often the guard looks whether they are gone.

    Returns:
        The pids found at first.
    """
    me = [os.getpid()]
    found = holders(token, proc, me)
    if not found:
        return []
    _log.warning(
        "ncclguard run: the launcher is gone without ending its job: SIGTERM to its %d processes (%s), "
        "SIGKILL after %g s",
        len(found),
        " ".join(map(str, found)),
        grace_s,
    )
    _signal(found, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while (left := holders(token, proc, me)) and time.monotonic() < end:
        time.sleep(poll_s)
    if left:
        _log.warning("ncclguard run: %d processes of the job left after %g s: SIGKILL", len(left), grace_s)
        _signal(left, signal.SIGKILL)
    return found


class Guard:
    """The guard of one launcher, seen from the launcher: started detached, told ``done`` at the end.

    Args:
        token: the launcher's ``NCCLGUARD_LAUNCHER`` value (set in its workers' environment).
        grace_s: seconds the job's processes have to end after SIGTERM, once the launcher is gone.
        env: the guard's environment (default this one's).

    Raises:
        OSError: the guard could not be started (its starter failed, or had not exited within
            :data:`STARTER_WAIT_S`: then it is killed, and the job runs without a guard).
    """

    def __init__(self, token: str, grace_s: float, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-S", str(Path(__file__).resolve()), "--token", token, "--grace", str(grace_s)]
        # The first process forks the guard and exits: the guard is nobody's child here, in a session of its own.
        starter = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True
        )
        try:
            rc = starter.wait(timeout=STARTER_WAIT_S)
        except subprocess.TimeoutExpired:
            starter.kill()  # before any worker starts: a guard it forked meanwhile finds nothing to reap
            raise OSError(f"the orphan guard's starter had not exited within {STARTER_WAIT_S:g} s") from None
        if rc != 0 or starter.stdin is None:
            raise OSError(f"the orphan guard's starter exited {starter.returncode}")
        self.pipe = starter.stdin  # its write end: the launcher's alone (not inherited: close-on-exec)
        self.token = token

    def done(self) -> None:
        """Says the launcher returned: the guard exits without reaping."""
        try:
            self.pipe.write(DONE)
            self.pipe.close()
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """The guard's life: detach, wait for the launcher's end, reap when it ended without ``done``."""
    ap = argparse.ArgumentParser(prog="ncclguard/supervise/reaper.py")
    ap.add_argument("--token", required=True)
    ap.add_argument("--grace", type=float, default=8.0)
    ns = ap.parse_args(argv)
    if os.fork() > 0:  # the starter exits at once: the launcher reaps it, the guard is left detached
        os._exit(0)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # a terminal's signals are the launcher's to act on
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _log.addHandler(handler)
    said = b""
    while chunk := os.read(sys.stdin.fileno(), 64):
        said += chunk
    if said.startswith(DONE.strip()):
        return 0
    reap(ns.token, ns.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
