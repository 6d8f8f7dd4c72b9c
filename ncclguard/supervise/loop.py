"""The supervisor of one rank: runs its command, and when it dies, says so and starts it again.

A launcher that tears every worker down when one exits non-zero (torchrun's agent: "On failures
or membership changes ALL surviving workers are killed immediately") cannot heal a single rank.
Run the rank under its supervisor instead; the launcher then sees one process that does not exit,
and the other ranks are left alone::

    torchrun --nproc-per-node=4 -m ncclguard.supervise --restarts 3 --warm-spare -- python train.py

(``ncclguard run --ncclguard-restarts 3`` does this for you.) When the rank's process ends by a signal or a
non-zero status, the supervisor

1. posts a death notice in the job's store (:mod:`ncclguard.store.deaths`): the survivors' commit
   settles at once instead of waiting its bound for the dead rank's statement;
2. starts the rank again with the same environment (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
   and ``NCCLGUARD_RESTART_COUNT`` set to its restart number, so the new process rejoins the
   survivors and is healed from a live peer (``heal=True``); with ``--warm-spare``, the standby
   process that already imported torch (:mod:`ncclguard.supervise.spare`) takes the place, and a
   new spare is started for the next death.

It exits with the last run's status (128 + the signal for a run killed by one), so a rank that
keeps dying still ends the job. SIGTERM and SIGINT sent to it go to the running process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ncclguard.store.deaths import DeathPoster
from ncclguard.supervise.spare import RESTART_COUNT_VAR, target_of

__all__ = ["RESTART_COUNT_VAR", "Supervisor", "run_rank"]


def _say(text: str) -> None:
    sys.stderr.write(f"ncclguard.supervise: {text}\n")
    sys.stderr.flush()


class _Spare:
    """One standby process, importing or waiting for the word."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], preload: Sequence[str]) -> None:
        spare = [sys.executable, "-m", "ncclguard.supervise.spare"]
        for name in preload:
            spare += ["--preload", name]
        self.proc = subprocess.Popen([*spare, "--", *argv], env=env, stdin=subprocess.PIPE, text=True)

    def take_over(self, restart: int) -> subprocess.Popen[Any] | None:
        """Gives the spare the word; the process that now runs the rank, or None if it is gone."""
        if self.proc.poll() is not None or self.proc.stdin is None:
            return None
        try:
            self.proc.stdin.write(json.dumps({"restart": restart}) + "\n")
            self.proc.stdin.flush()
            self.proc.stdin.close()
        except OSError:
            return None
        return self.proc

    def discard(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()  # an end of input: the spare exits by itself
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Supervisor:
    """Runs one rank's command and restarts it alone after each failure (see the module doc).

    Args:
        argv: the rank's command, as a list (no shell).
        restarts: the most restarts.
        backoff_s: seconds to wait before a cold restart.
        warm_spare: keep a standby process ready (a Python command: ``python script ...`` or
            ``python -m module ...``).
        preload: modules the spare imports beyond torch and ncclguard (``transformers``, ...).

    Raises:
        ValueError: an empty command or a negative ``restarts``.
    """

    def __init__(
        self,
        argv: Sequence[str],
        restarts: int,
        *,
        backoff_s: float = 0.0,
        warm_spare: bool = False,
        preload: Sequence[str] = (),
    ) -> None:
        if not argv:
            raise ValueError("the supervisor needs the rank's command after --")
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
        if warm_spare and target_of(argv) is None:
            raise ValueError(
                f"--warm-spare needs a Python command (python SCRIPT ... or python -m MODULE ...), got {list(argv)[:3]}"
            )
        self.argv, self.restarts, self.backoff_s = list(argv), restarts, backoff_s
        self.warm_spare, self.preload = warm_spare, list(preload)
        self.env = dict(os.environ)
        self.child: subprocess.Popen[Any] | None = None
        self.spare: _Spare | None = None
        self.lives: list[int] = []  # each process's exit status, as Popen gives it

    def _env(self, restart: int | None) -> dict[str, str]:
        env = dict(self.env)
        if restart is None:
            env.pop(RESTART_COUNT_VAR, None)  # a spare learns its number when it takes over
        else:
            env[RESTART_COUNT_VAR] = str(restart)
        return env

    def _start(self, restart: int) -> subprocess.Popen[Any]:
        if self.spare is not None:
            spare, self.spare = self.spare, None
            proc = spare.take_over(restart)
            if proc is not None:
                _say(f"restart {restart}: the warm spare (pid {proc.pid}) takes over")
                self._new_spare()
                return proc
        if restart:
            time.sleep(self.backoff_s)
        proc = subprocess.Popen(self.argv, env=self._env(restart))
        self._new_spare()
        return proc

    def _new_spare(self) -> None:
        if self.warm_spare and len(self.lives) < self.restarts:
            self.spare = _Spare(self.argv, self._env(None), self.preload)

    def _forward(self, signum: int, _frame: object) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        """Runs the rank to its end; returns the last run's status as a shell gives it."""
        raw = self.env.get("RANK", "")
        origin = int(raw) if raw.isdigit() else None
        poster = DeathPoster(self.env) if origin is not None else None
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            count = 0
            self.child = self._start(0)
            while True:
                rc = self.child.wait()
                self.lives.append(rc)
                status = 128 - rc if rc < 0 else rc
                if rc != 0 and poster is not None and origin is not None:  # the last death too
                    why_not = poster.post(origin, self.child.pid, rc, count)
                    if why_not is not None:
                        _say(why_not)
                if rc == 0 or count >= self.restarts:
                    return status
                count += 1
                _say(f"the rank (pid {self.child.pid}) exited {rc}; restart {count} of {self.restarts}")
                self.child = self._start(count)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.spare is not None:
                self.spare.discard()


def run_rank(
    argv: Sequence[str], restarts: int, *, backoff_s: float = 0.0, warm_spare: bool = False, preload: Sequence[str] = ()
) -> int:
    """Runs ``argv`` under a :class:`Supervisor`; returns the last run's exit status.

    Args:
        argv: the rank's command.
        restarts: the most restarts.
        backoff_s: seconds to wait before a cold restart.
        warm_spare: keep a standby process ready.
        preload: modules the spare imports.

    Returns:
        The status (128 + N for a run killed by signal N).
    """
    return Supervisor(argv, restarts, backoff_s=backoff_s, warm_spare=warm_spare, preload=preload).run()
