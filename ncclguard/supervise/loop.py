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
keeps dying still ends the job.

**A stuck rank.** Every second it also samples its rank's process from ``/proc`` and reads the
waiting ranks' asks about it (:mod:`ncclguard.supervise.judge`): a rank on another host whose
threads cannot run (SIGSTOP, the GIL held in C) can be judged and ended only here. A process it
judges stuck (or that its peers judged stuck and that did not exit by itself) gets SIGKILL: its
sockets close, so the waiting ranks' op fails at once. Then, when the engine heals (``heal=True``,
said in the ask) and a restart is left, the rank is restarted as after a kill: it rejoins in its old
place and a live peer heals it. Otherwise its death is posted as stuck (``STUCK_RC``: the waiting
ranks' rebuild settles without waiting for it) and the supervisor exits 0 without a restart, as the
rank itself would have (a non-zero status would make torchrun's agent end every other rank).

**Told to stop.** SIGTERM and SIGINT sent to the supervisor (torchrun's agent sends its workers'
sessions the signal it got: Slurm's preemption, ``scancel``, a spot notice) go to the running
process, the warm spare is let go, and no restart follows: the rank has ``stop_grace_s`` seconds
(default 8, inside a 10 s bound) to end, then it is SIGKILLed. A rank that ended by SIGTERM or
SIGINT, or exited 143 (128 + SIGTERM: the recovery engine's status after a preemption stop,
:mod:`ncclguard.recovery.preempt`), is not restarted either, whoever signalled it. The supervisor
then exits with the rank's status, or 128 + the signal when the rank exited 0.

**Its launcher gone.** A launcher killed outright (SIGKILL: the OOM killer, a lost node agent) stops
no worker. The supervisor learns of it by SIGHUP, which the kernel sends when the thread that started
it ends (``PR_SET_PDEATHSIG``), or by its own poll of its parent (:mod:`ncclguard.supervise.parent`),
and stops as when told to stop: SIGTERM to the rank, SIGKILL after the stop grace, no restart, then it
exits with the rank's status. A SIGHUP while its parent process lives is ignored.

**A rank that SIGKILL does not end.** A process in uninterruptible sleep (a GPU's Xid, a hung NFS or
FUSE request, a frozen cgroup v1) takes SIGKILL but does not die until it leaves the kernel, which may
be never: waiting for it would leave the rank's death unposted and every peer's meeting waiting its
bound, again and again. Every wait for a process the supervisor SIGKILLed (after the stop grace, or
as stuck) is bounded by ``kill_wait_s`` (:data:`KILL_WAIT_S`, 10 s by default, plus at most one poll;
a sound process dies in milliseconds, a large one unmapping its memory in seconds). Past it the
supervisor says so (``... was sent SIGKILL 10 s ago and is not reaped (state D) ...``), takes it as killed by
SIGKILL (``Popen.returncode`` -9) and goes the way a reaped one goes: after a stop it exits 137
(128 + SIGKILL); a stuck rank's death is posted as above (a kill when it is restarted, else
``STUCK_RC``), then the rank is restarted beside the process that would not die, or the supervisor
exits 0 (a non-zero status would end the survivors). The process is left to the kernel (and to
``init`` once the supervisor exits). A warm spare that does not end is let go the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from ncclguard.errors import RestartRefused
from ncclguard.recovery._rebuild.restarts import STOP_GRACE_VAR, SUPERVISED_RESTARTS_VAR
from ncclguard.store.deaths import STUCK_RC, DeathPoster
from ncclguard.supervise.judge import POLL_S, Ended, StuckWatch
from ncclguard.supervise.parent import ORPHAN_SIGNAL, ParentWatch
from ncclguard.supervise.spare import RESTART_COUNT_VAR, restart_command, target_of

__all__ = [
    "DEFAULT_STOP_GRACE_S",
    "KILL_WAIT_S",
    "RESTART_COUNT_VAR",
    "STOPPED_STATUSES",
    "Supervisor",
    "reap_within",
    "run_rank",
    "stopped",
]

DEFAULT_STOP_GRACE_S = 8.0  # a rank told to stop ends within this, so the job ends within 10 s
# How a rank told to stop ends: killed by SIGTERM or SIGINT (Popen's negative codes), or exited
# 128 + SIGTERM, the status ncclguard.recovery.preempt.PREEMPTED_STATUS gives after its checkpoint.
STOPPED_STATUSES = (-int(signal.SIGTERM), -int(signal.SIGINT), 128 + int(signal.SIGTERM))
# How long a process sent SIGKILL has to be reaped before the supervisor goes on without it (see the
# module doc): a sound process dies in milliseconds, a large one unmapping its memory in seconds.
KILL_WAIT_S = 10.0
_KILLED = -int(signal.SIGKILL)  # Popen's status of a process killed by SIGKILL: what an unreaped one is taken for


def stopped(returncode: int) -> bool:
    """Whether a rank's exit status (``Popen.returncode``) says it was told to stop: never restarted."""
    return returncode in STOPPED_STATUSES


def _say(text: str) -> None:
    sys.stderr.write(f"ncclguard.supervise: {text}\n")
    sys.stderr.flush()


def reap_within(proc: subprocess.Popen[Any], bound_s: float) -> int | None:
    """Waits at most ``bound_s`` for ``proc`` to end; its ``returncode``, or None while it has not."""
    try:
        return proc.wait(timeout=max(0.0, bound_s))
    except subprocess.TimeoutExpired:
        return None


def _state(pid: int) -> str:
    """A process's state letter from ``/proc`` (``D``: uninterruptible sleep), or ``?``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return "?"


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

    def discard(self, kill_wait_s: float = KILL_WAIT_S) -> None:
        """Lets the spare go: an end of input, SIGKILL 2 s later, and at most ``kill_wait_s`` more."""
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()  # an end of input: the spare exits by itself
                except OSError:
                    pass
            if reap_within(self.proc, 2.0) is None:
                self.proc.kill()
                if reap_within(self.proc, kill_wait_s) is None:
                    _say(
                        f"the warm spare (pid {self.proc.pid}) was sent SIGKILL {kill_wait_s:g} s ago and is not "
                        f"reaped (state {_state(self.proc.pid)}): left to the kernel"
                    )


class Supervisor:
    """Runs one rank's command and restarts it alone after each failure (see the module doc).

    Args:
        argv: the rank's command, as a list (no shell).
        restarts: the most restarts.
        backoff_s: seconds to wait before a cold restart.
        warm_spare: keep a standby process ready (a Python command: ``python script ...`` or
            ``python -m module ...``).
        preload: modules the spare imports beyond torch and ncclguard (``transformers``, ...).
        stop_grace_s: seconds a rank has to end after the supervisor is told to stop, before SIGKILL.
        kill_wait_s: seconds a process sent SIGKILL has to be reaped before the supervisor goes on
            without it (taken as killed by SIGKILL; see the module doc).

    Raises:
        ValueError: an empty command, a negative ``restarts``, or a ``stop_grace_s`` or ``kill_wait_s``
            not above 0.
    """

    def __init__(
        self,
        argv: Sequence[str],
        restarts: int,
        *,
        backoff_s: float = 0.0,
        warm_spare: bool = False,
        preload: Sequence[str] = (),
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        kill_wait_s: float = KILL_WAIT_S,
    ) -> None:
        if not argv:
            raise ValueError("the supervisor needs the rank's command after --")
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
        if warm_spare and target_of(argv) is None:
            raise ValueError(
                f"--warm-spare needs a Python command (python SCRIPT ... or python -m MODULE ...), got {list(argv)[:3]}"
            )
        if isinstance(stop_grace_s, bool) or not isinstance(stop_grace_s, int | float) or not stop_grace_s > 0:
            raise ValueError(f"the stop grace must be a number of seconds above 0, got {stop_grace_s!r}")
        if isinstance(kill_wait_s, bool) or not isinstance(kill_wait_s, int | float) or not kill_wait_s > 0:
            raise ValueError(f"the kill wait must be a number of seconds above 0, got {kill_wait_s!r}")
        self.kill_wait_s = float(kill_wait_s)
        # The last process sent SIGKILL and when (monotonic): the timer thread of a stop writes it too.
        self.killed: tuple[subprocess.Popen[Any], float] | None = None
        self.unreaped: list[int] = []  # the processes SIGKILLed and never reaped within kill_wait_s
        self.argv, self.restarts, self.backoff_s = list(argv), restarts, backoff_s
        self.stop_grace_s = float(stop_grace_s)
        self.stopping: int | None = None  # the signal that told this supervisor to stop
        self.stop_send = int(signal.SIGTERM)  # what the running process is sent on a stop
        self.parent = ParentWatch()
        self.warm_spare, self.preload = warm_spare, list(preload)
        # Every process it starts learns the restarts it has (the engine heals by default under them)
        # and its stop grace (the preemption checkpoint says how much of it the save took).
        self.env = {**os.environ, SUPERVISED_RESTARTS_VAR: str(restarts), STOP_GRACE_VAR: f"{self.stop_grace_s:g}"}
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
        env = self._env(restart)
        cmd: list[str] | str = list(self.argv)
        if restart:
            time.sleep(self.backoff_s)
            # Its init_process_group must make the stand-in, whatever the script's order: the start-up
            # hook where it loads, else the script run through the spare's --now; else no restart.
            cmd = restart_command(self.argv, env, restart)
            if isinstance(cmd, str):
                raise RestartRefused(cmd)
        proc = subprocess.Popen(cmd, env=env)
        self._new_spare()
        return proc

    def _new_spare(self) -> None:
        if self.warm_spare and len(self.lives) < self.restarts:
            self.spare = _Spare(self.argv, self._env(None), self.preload)

    def _forward(self, signum: int, _frame: object) -> None:
        self._stop(signum, signum)

    def _stop(self, signum: int, send: int) -> None:
        """Told to stop by ``signum``: sends the running process ``send``, SIGKILL after the grace."""
        first = self.stopping is None
        if first:
            self.stopping, self.stop_send = signum, send
        self._tell(send, timer=first)

    def _orphan(self, signum: int, _frame: object) -> None:
        """:data:`ORPHAN_SIGNAL`: when the launcher is gone, a stop (SIGTERM to the rank); else ignored."""
        if not self.parent.gone():
            _say(f"signal {signum} while the launcher (pid {self.parent.parent}) lives: ignored")
            return
        if self.stopping is None:
            _say(
                f"the launcher (pid {self.parent.parent}) is gone: stopping the rank (SIGTERM, SIGKILL after "
                f"{self.stop_grace_s:g} s), no restart"
            )
        self._stop(signum, int(signal.SIGTERM))

    def _tell(self, signum: int, timer: bool) -> None:
        """Sends the running process ``signum``; with ``timer``, SIGKILLs it after the grace."""
        child = self.child
        if child is None:
            return
        if child.poll() is None:
            child.send_signal(signum)
        if timer:
            # A timer thread: the main thread may be blocked in wait(), which a handler cannot end.
            killer = threading.Timer(self.stop_grace_s, self._kill, (child,))
            killer.daemon = True
            killer.start()

    def _kill(self, child: subprocess.Popen[Any]) -> None:
        if child.poll() is None:
            _say(f"the rank (pid {child.pid}) did not end within {self.stop_grace_s:g} s of the stop; SIGKILL")
            self.killed = (child, time.monotonic())
            child.kill()

    def run(self) -> int:
        """Runs the rank to its end; returns the last run's status as a shell gives it."""
        raw = self.env.get("RANK", "")
        origin = int(raw) if raw.isdigit() else None
        poster = DeathPoster(self.env) if origin is not None else None
        watch = StuckWatch(origin, poster.store, _say) if poster is not None and origin is not None else None
        previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        previous[ORPHAN_SIGNAL] = signal.signal(ORPHAN_SIGNAL, self._orphan)
        self.parent.arm()  # after the handler: the launcher's end, even before this line, is a stop
        try:
            count = 0
            self.child = self._start(0)
            if self.stopping is not None:  # stopped before there was a process to tell
                self._tell(self.stop_send, timer=True)
            while True:
                rc, ended = self._wait(watch, count < self.restarts)
                self.lives.append(rc)
                status = 128 - rc if rc < 0 else rc
                if self.stopping is not None or stopped(rc):
                    return self._stopped(rc, status)
                if ended is not None:
                    if not self._after_stuck(ended, poster, origin, count):
                        return 0
                elif rc != 0 and poster is not None and origin is not None:  # the last death too
                    why_not = poster.post(origin, self.child.pid, rc, count)
                    if why_not is not None:
                        _say(why_not)
                if ended is None and (rc == 0 or count >= self.restarts):
                    return status
                count += 1
                how = "was not reaped" if self.child.pid in self.unreaped else f"exited {rc}"
                _say(f"the rank (pid {self.child.pid}) {how}; restart {count} of {self.restarts}")
                # Beside a process that would not die: sound on CPU. On a GPU the old process keeps its
                # CUDA context and memory until the kernel lets it go (after an Xid, often not before a
                # GPU reset): the new one may fail to allocate or to start CUDA, and then dies or is
                # judged stuck like any other, until the restarts run out.
                try:
                    self.child = self._start(count)
                except RestartRefused as exc:
                    _say(f"restart {count} not made: {exc}; exiting {status or 1}")
                    return status or 1
                if self.stopping is not None:  # told to stop while it started: it goes the same way
                    self._tell(self.stop_send, timer=True)
        finally:
            self.parent.disarm()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.spare is not None:
                self.spare.discard(self.kill_wait_s)

    def _wait(self, watch: StuckWatch | None, can_restart: bool) -> tuple[int, Ended | None]:
        """Waits for the running process to end, looking at it every poll; returns its status and,
        when the supervisor ended it as stuck, what it ended. Once it was sent SIGKILL (as stuck, or
        after a stop's grace) the wait is bounded by ``kill_wait_s``: past it, -SIGKILL."""
        child = self.child
        assert child is not None
        if watch is not None:
            watch.follow(child)
        ended: Ended | None = None
        while True:
            killed = self.killed
            left = killed[1] + self.kill_wait_s - time.monotonic() if killed and killed[0] is child else None
            rc = reap_within(child, POLL_S if left is None else min(POLL_S, left))
            if rc is not None:
                return rc, ended
            if left is not None and left <= 0:
                return self._gone_unreaped(child), ended
            if watch is None or ended is not None or self.stopping is not None:
                continue  # told to stop: the stop's own timer ends it
            ended = watch.look(child, can_restart)
            if ended is not None:  # sent SIGKILL: its status comes within kill_wait_s, or it is taken as killed
                self.killed = (child, time.monotonic())

    def _gone_unreaped(self, child: subprocess.Popen[Any]) -> int:
        """A process sent SIGKILL that was not reaped within ``kill_wait_s``: said, and taken as killed."""
        self.unreaped.append(child.pid)
        _say(
            f"the rank (pid {child.pid}) was sent SIGKILL {self.kill_wait_s:g} s ago and is not reaped "
            f"(state {_state(child.pid)}: uninterruptible sleep, a GPU fault, a hung filesystem, a frozen "
            "cgroup?); taken as killed by SIGKILL and left to the kernel, the supervisor goes on without it"
        )
        return _KILLED

    def _after_stuck(self, ended: Ended, poster: DeathPoster | None, origin: int | None, life: int) -> bool:
        """After this supervisor ended its rank as stuck: posts its death where its peers have not
        (a restart-to-come as a kill, else ``STUCK_RC``: they go on without it at once). Returns
        whether the rank is restarted (it rejoins and is healed)."""
        restart = ended.restart
        if ended.post and poster is not None and origin is not None:
            why_not = poster.post(origin, ended.pid, -int(signal.SIGKILL) if restart else STUCK_RC, life)
            if why_not is not None:
                _say(why_not)
        if not restart:
            why = (
                "its peers went on without it"
                if ended.judged == "peers" and not ended.post
                else "it is not healed (heal=False) or has no restart left"
            )
            _say(f"the rank (pid {ended.pid}) was ended as stuck and {why}: exiting 0, no restart")
        return restart

    def _stopped(self, rc: int, status: int) -> int:
        """The status after a stop: the rank's, or 128 + the signal the supervisor got if it exited 0."""
        assert self.child is not None  # the run that just ended
        why = f"signal {self.stopping}" if self.stopping is not None else "its own stop"
        why = "its launcher's end" if self.stopping == ORPHAN_SIGNAL else why
        how = "was not reaped" if self.child.pid in self.unreaped else f"exited {rc}"
        _say(f"the rank (pid {self.child.pid}) {how} after {why}: told to stop, it stays down")
        if status == 0 and self.stopping is not None:
            return 128 + self.stopping
        return status


def run_rank(
    argv: Sequence[str],
    restarts: int,
    *,
    backoff_s: float = 0.0,
    warm_spare: bool = False,
    preload: Sequence[str] = (),
    stop_grace_s: float = DEFAULT_STOP_GRACE_S,
    kill_wait_s: float = KILL_WAIT_S,
) -> int:
    """Runs ``argv`` under a :class:`Supervisor`; returns the last run's exit status.

    Args:
        argv: the rank's command.
        restarts: the most restarts.
        backoff_s: seconds to wait before a cold restart.
        warm_spare: keep a standby process ready.
        preload: modules the spare imports.
        stop_grace_s: seconds a rank has to end after a stop, before SIGKILL.
        kill_wait_s: seconds a process sent SIGKILL has to be reaped before the supervisor goes on.

    Returns:
        The status (128 + N for a run killed by signal N).
    """
    sup = Supervisor(
        argv,
        restarts,
        backoff_s=backoff_s,
        warm_spare=warm_spare,
        preload=preload,
        stop_grace_s=stop_grace_s,
        kill_wait_s=kill_wait_s,
    )
    return sup.run()
