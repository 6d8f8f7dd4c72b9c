"""A small launcher: runs N ranks of a command on this host, bounded in time.

It sets the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), but unlike
torchrun it does not tear the other ranks down when one dies, which is what a fault test or a
demo of a killed rank needs. Every rank gets its own process group, so a time-out kills all of
it, grandchildren included.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RankExit", "free_port", "spawn", "under_launcher"]


@dataclass
class RankExit:
    """How one rank ended: its exit code (negative: killed by that signal) and its output."""

    rank: int
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class SpawnResult:
    """All ranks of one :func:`spawn`, in rank order, and the wall time it took."""

    ranks: list[RankExit] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.ok for r in self.ranks)

    def json_lines(self, tag: str = "RESULT") -> dict[int, Any]:
        """Parses the line ``<tag> {json}`` that each rank printed, by rank (ranks that printed none
        are absent; the last such line of a rank wins)."""
        found: dict[int, Any] = {}
        prefix = tag + " "
        for r in self.ranks:
            for line in r.stdout.splitlines():
                if line.startswith(prefix):
                    found[r.rank] = json.loads(line[len(prefix) :])
        return found

    def output(self) -> str:
        """Every rank's stdout and stderr, labelled, for error messages."""
        return "\n".join(
            f"--- rank {r.rank} (rc={r.returncode}) stdout ---\n{r.stdout}\n--- rank {r.rank} stderr ---\n{r.stderr}"
            for r in self.ranks
        )


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    """True when torchrun (or this launcher) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def spawn(
    argv: Sequence[str],
    nproc: int,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    capture: bool = True,
) -> SpawnResult:
    """Runs ``argv`` as ``nproc`` ranks on this host and waits at most ``timeout_s`` for all.

    Args:
        argv: the command, as a list (no shell), e.g. ``[sys.executable, "-m", "mod"]``.
        nproc: number of ranks.
        timeout_s: wall-clock bound for the whole job; ranks still running then are killed.
        env: extra environment variables for every rank.
        cwd: working directory of the ranks.
        capture: collect stdout/stderr (else they go to this process's).

    Returns:
        Each rank's exit; ``timed_out`` when the bound was hit.

    Raises:
        ValueError: ``nproc`` < 1 or ``timeout_s`` <= 0.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    port = free_port()
    base = {**os.environ, **(env or {})}
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        ROLE_RANK="0",
        ROLE_WORLD_SIZE=str(nproc),
        OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nproc):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
        # Files, not pipes: a rank that prints a lot must never block on a full pipe.
        files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) if capture else (None, None)
        logs.append(files)
        procs.append(
            subprocess.Popen(
                list(argv), env=rank_env, cwd=cwd, stdout=files[0], stderr=files[1], text=True, start_new_session=True
            )
        )
    result = SpawnResult()
    deadline = start + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            result.timed_out = True
            break
    for rank, proc in enumerate(procs):
        timed_out = proc.poll() is None
        _kill_tree(proc)  # also ends anything the rank left running in its session
        proc.wait()
        text = []
        for f in logs[rank]:
            if f is None:
                text.append("")
                continue
            f.seek(0)
            text.append(f.read())
            f.close()
        result.ranks.append(RankExit(rank, proc.returncode, text[0], text[1], timed_out=timed_out))
    result.wall_s = time.monotonic() - start
    return result


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":  # python -m ncclguard.testing.launch -n 2 -- cmd ...
    import argparse

    ap = argparse.ArgumentParser(
        description="Run N ranks of a command on this host (torchrun's variables, no teardown)."
    )
    ap.add_argument("-n", "--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    res = spawn(cmd, ns.nproc, timeout_s=ns.timeout, capture=False)
    sys.exit(0 if res.ok else 1)
