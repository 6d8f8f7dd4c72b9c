"""A small launcher: runs N ranks of a command on this host, bounded in time.

It sets the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), but unlike
torchrun it does not tear the other ranks down when one dies, which is what a fault test or a
demo of a killed rank needs. Every rank gets its own process group, so a time-out kills all of
it, grandchildren included.

With ``restarts=N`` it restarts a rank that died, alone, up to N times, with the same ``RANK``
and ``NCCLGUARD_RESTART_COUNT`` set to its restart number: the restarted process rejoins the
live ranks (:func:`ncclguard.rejoin_world`) and takes their state (:func:`ncclguard.heal_from_peer`);
``RecoveringStep(..., heal=True)`` does both. Every restart is logged in
:attr:`SpawnResult.restarts`. Every death (an exit that is not 0) is posted in the job's store
(:mod:`ncclguard.store.deaths`), so the survivors' commit settles without waiting for the dead rank.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ncclguard.recovery._rebuild.restarts import RESTART_COUNT_VAR
from ncclguard.store.deaths import DeathPoster

__all__ = [
    "RESTART_COUNT_VAR",
    "RankExit",
    "Restart",
    "SpawnResult",
    "free_port",
    "spawn",
    "under_launcher",
]


@dataclass
class RankExit:
    """How one rank ended: its last process's exit code (negative: killed by that signal) and the
    output of all its processes, in order (a restart is marked by a line in both streams).

    Attributes:
        restarts: times the launcher restarted it.
        lives: the exit code of each of its processes, the last one included.
    """

    rank: int
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    restarts: int = 0
    lives: list[int | None] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class Restart:
    """One restart by :func:`spawn`'s restart policy.

    Attributes:
        rank: the rank restarted (its ``RANK`` stays the same).
        count: its restart number (the restarted process's ``NCCLGUARD_RESTART_COUNT``).
        returncode: how the process before it ended (negative: killed by that signal).
        at_s: seconds from the launch to the restart.
    """

    rank: int
    count: int
    returncode: int
    at_s: float


@dataclass
class SpawnResult:
    """All ranks of one :func:`spawn`, in rank order, the restarts it made, and its wall time."""

    ranks: list[RankExit] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False
    restarts: list[Restart] = field(default_factory=list)

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


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below the kernel's ephemeral range and above the ports services keep


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (``bind(0)``, an outgoing connection); 32768 by default."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(count: int = 1) -> int:
    """A TCP port on loopback that was free a moment ago (with ``count``, the ``count - 1`` after it too),
    chosen at random below the kernel's ephemeral range.

    A port from ``bind(0)`` comes from that range, and in the seconds before the store binds it any
    outgoing connection or gloo's own listeners on this host may take it (CI: ``EADDRINUSE`` at the
    store's bind, and the launcher's death poster connected to another job's gloo listener there).
    Below the range only an explicit bind takes a port.

    Args:
        count: how many consecutive ports must be free (a rank per port: ``port + LOCAL_RANK``).

    Returns:
        The first port.

    Raises:
        OSError: no free port found in 200 tries.
    """
    low = _ephemeral_low()
    ports = range(LOWEST_PORT, low - count) if low - count > LOWEST_PORT + 1000 else range(1024, 65536 - count)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(ports)
        if all(_bindable(port + i) for i in range(count)):
            return port
    raise OSError(f"no {count} free consecutive port(s) on loopback in 200 tries")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # the store listens on every address
        except OSError:
            return False
    return True


def under_launcher() -> bool:
    """True when torchrun (or this launcher) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class _Rank:
    """One rank's processes: the live one, and the captured output of all of them."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], cwd: str | None, capture: bool) -> None:
        self.rank, self.argv, self.env, self.cwd, self.capture = rank, argv, env, cwd, capture
        # Files, not pipes: a rank that prints a lot must never block on a full pipe.
        self.files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) if capture else (None, None)
        self.lives: list[int | None] = []
        self.proc = self._start(0)

    def _start(self, count: int) -> subprocess.Popen:
        env = {**self.env, RESTART_COUNT_VAR: str(count)}
        return subprocess.Popen(
            self.argv,
            env=env,
            cwd=self.cwd,
            stdout=self.files[0],
            stderr=self.files[1],
            text=True,
            start_new_session=True,
        )

    def note(self, text: str) -> None:
        """A line of the launcher's own in the rank's captured stderr."""
        if self.files[1] is not None:
            self.files[1].write(f"# ncclguard.testing.launch: {text}\n")
            self.files[1].flush()

    def restart(self, returncode: int) -> None:
        _kill_tree(self.proc)  # what the dead process left running in its session
        self.proc.wait()
        self.lives.append(returncode)
        count = len(self.lives)
        for f in self.files:
            if f is not None:
                f.write(f"# ncclguard.testing.launch: rank {self.rank} exited {returncode}; restart {count}\n")
                f.flush()
        self.proc = self._start(count)

    def finish(self) -> RankExit:
        timed_out = self.proc.poll() is None
        _kill_tree(self.proc)  # also ends anything the rank left running in its session
        self.proc.wait()
        text = []
        for f in self.files:
            if f is None:
                text.append("")
                continue
            f.seek(0)
            text.append(f.read())
            f.close()
        lives = [*self.lives, self.proc.returncode]
        return RankExit(
            self.rank, self.proc.returncode, text[0], text[1], timed_out, restarts=len(self.lives), lives=lives
        )


def spawn(
    argv: Sequence[str],
    nproc: int,
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    capture: bool = True,
    restarts: int = 0,
    restart_on: Collection[int] | None = None,
) -> SpawnResult:
    """Runs ``argv`` as ``nproc`` ranks on this host and waits at most ``timeout_s`` for all.

    A rank that dies is not torn down with the others. With ``restarts`` it is started again,
    alone, with the same ``RANK``, ``LOCAL_RANK`` and ``MASTER_PORT`` and with
    ``NCCLGUARD_RESTART_COUNT`` set to its restart number (1, 2, ...; 0 in a first process).

    Args:
        argv: the command, as a list (no shell), e.g. ``[sys.executable, "-m", "mod"]``.
        nproc: number of ranks.
        timeout_s: wall-clock bound for the whole job, restarts included; ranks still running
            then are killed.
        env: extra environment variables for every rank.
        cwd: working directory of the ranks.
        capture: collect stdout/stderr (else they go to this process's).
        restarts: how many times each rank may be restarted (0: never).
        restart_on: the exit codes that earn a restart, as ``Popen.returncode`` gives them
            (negative: killed by that signal, e.g. ``-signal.SIGKILL``); None: any non-zero exit.
            A rank that exits 0 is never restarted.

    Returns:
        Each rank's exit, ``timed_out`` when the bound was hit, and every restart made.

    Raises:
        ValueError: ``nproc`` < 1, ``timeout_s`` <= 0, ``restarts`` < 0, or ``restart_on`` holds 0
            or a non-integer.
    """
    codes = _checked(nproc, timeout_s, restarts, restart_on)
    base = _job_env(env, nproc)
    start = time.monotonic()
    ranks = [
        _Rank(
            rank,
            list(argv),
            {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)},
            cwd,
            capture,
        )
        for rank in range(nproc)
    ]
    result = SpawnResult()
    result.timed_out = _supervise(ranks, base, result.restarts, restarts, codes, start, start + timeout_s)
    result.ranks = [r.finish() for r in ranks]
    result.wall_s = time.monotonic() - start
    return result


def _checked(nproc: int, timeout_s: float, restarts: int, restart_on: Collection[int] | None) -> set[int] | None:
    """Checks :func:`spawn`'s arguments.

    Returns:
        The exit codes that earn a restart, or None for any non-zero one.

    Raises:
        ValueError: as :func:`spawn` says.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an int >= 0 (restarts per rank), got {restarts!r}")
    codes = None if restart_on is None else set(restart_on)
    if codes is not None and any(isinstance(c, bool) or not isinstance(c, int) or c == 0 for c in codes):
        raise ValueError(
            f"restart_on must hold non-zero exit codes (negative for a signal, e.g. -9 for SIGKILL), got {restart_on!r}"
        )
    return codes


def _job_env(env: Mapping[str, str] | None, nproc: int) -> dict[str, str]:
    """The environment every rank shares: this process's, ``env``, and torchrun's variables of a
    one-host job of ``nproc`` ranks (a free port on loopback for the store); the rank's own come later."""
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
    return base


def _supervise(
    ranks: list[_Rank],
    base: dict[str, str],
    made: list[Restart],
    restarts: int,
    codes: set[int] | None,
    start: float,
    deadline: float,
) -> bool:
    """Waits for every rank to end, until ``deadline`` (``time.monotonic()``): posts each death in
    the job's store and restarts a rank that earned it (appended to ``made``).

    Returns:
        Whether the deadline came first (ranks still running are left to :meth:`_Rank.finish`).
    """
    running = set(range(len(ranks)))
    deaths: DeathPoster | None = None  # made at the first death: a job where nobody dies needs none
    while running:
        for rank in sorted(running):
            r = ranks[rank]
            rc = r.proc.poll()
            if rc is None:
                continue
            if rc != 0:  # the survivors' commit reads a dead rank's notice and settles at once
                deaths = deaths or DeathPoster(base, connect_s=0.0)
                why_not = deaths.post(rank, r.proc.pid, rc, len(r.lives))
                if why_not is not None:
                    r.note(why_not)
            if rc != 0 and len(r.lives) < restarts and (codes is None or rc in codes):
                r.restart(rc)
                made.append(Restart(rank, len(r.lives), rc, time.monotonic() - start))
            else:
                running.discard(rank)
        if not running:
            break
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)  # a restart waits this long at most; polling costs nothing beside the ranks
    return False


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
    ap.add_argument("--restarts", type=int, default=0, help="restart a rank that exits non-zero, alone, up to N times")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    res = spawn(cmd, ns.nproc, timeout_s=ns.timeout, capture=False, restarts=ns.restarts)
    sys.exit(0 if res.ok else 1)
