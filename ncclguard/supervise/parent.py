"""A supervisor's tie to its launcher: when the launcher is gone, the supervisor ends its rank and itself.

A launcher killed outright (SIGKILL: the OOM killer, a lost node agent) stops none of its workers;
torchrun starts each in a session of its own, so they are reparented and run on. Two ways tell the
supervisor, either one enough:

- ``PR_SET_PDEATHSIG`` (Linux, ``prctl`` through ctypes): the kernel sends :data:`ORPHAN_SIGNAL`
  (SIGHUP) when the parent *thread* that forked this process ends. torchrun's agent starts its
  workers from the thread that runs the agent, the launcher's main thread (``LocalElasticAgent._start_workers``,
  ``SubprocessHandler`` → ``Popen``, called from ``agent.run()``), so that thread ends with the
  launcher. Should a thread of a live launcher fork a worker and end, the signal comes too: the
  supervisor checks that its parent process changed (``os.getppid()``) and otherwise ignores it;
- a poll of ``os.getppid()`` every :data:`POLL_S` in a daemon thread (where prctl is missing or
  failed): a changed parent means the launcher is gone, and this process sends itself the same signal.

The launcher gone before the signal was armed is seen too: ``ncclguard run`` sets
``NCCLGUARD_LAUNCHER`` (``<pid>-<token>``) for its workers; a parent that is not that pid while that
pid no longer exists means it is gone already.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Mapping

from ncclguard._log import log

__all__ = ["LAUNCHER_VAR", "ORPHAN_SIGNAL", "POLL_S", "ParentWatch", "launcher_pid", "orphaned", "set_death_signal"]

LAUNCHER_VAR = "NCCLGUARD_LAUNCHER"  # "<pid>-<token>": set by `ncclguard run` for every worker
ORPHAN_SIGNAL = signal.SIGHUP  # what the kernel (or the poll) sends a supervisor whose launcher is gone
POLL_S = 0.5  # the poll's period: the bound on noticing, where prctl is missing
_PR_SET_PDEATHSIG = 1  # include/uapi/linux/prctl.h


def launcher_pid(environ: Mapping[str, str]) -> int | None:
    """The launcher's pid from ``NCCLGUARD_LAUNCHER`` (``<pid>-<token>``), or None when unset or unreadable."""
    head = environ.get(LAUNCHER_VAR, "").split("-", 1)[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else None


def orphaned(parent: int, now: int, launcher: int | None, launcher_alive: bool) -> bool:
    """Whether the launcher is gone, from what a process knows of its parent.

    Args:
        parent: the parent it had when it armed (``os.getppid()`` then).
        now: its parent now.
        launcher: the launcher's pid (``NCCLGUARD_LAUNCHER``), or None when not started by ``ncclguard run``.
        launcher_alive: whether a process ``launcher`` exists now.

    Returns:
        True when the parent changed since arming, or when it was never the launcher and the launcher is
        gone (it died before this process armed).
    """
    if now != parent:
        return True
    return launcher is not None and parent != launcher and not launcher_alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def set_death_signal(signum: int) -> bool:
    """Asks the kernel to send ``signum`` to this process when its parent thread ends (0: never).

    Returns:
        True when set (Linux); False where ``prctl`` is missing or refused (the poll remains).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's prctl among them
        done = libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable (%s): the parent poll remains", exc)
        return False
    if done != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed (errno %d): the parent poll remains", ctypes.get_errno())
        return False
    return True


class ParentWatch:
    """Tells this process, by :data:`ORPHAN_SIGNAL`, that its launcher is gone (see the module doc).

    The caller installs its handler for the signal first, then :meth:`arm`; the handler asks
    :meth:`gone` (a signal while the parent lives is not the launcher's end) and :meth:`disarm` at the end.

    Args:
        environ: where ``NCCLGUARD_LAUNCHER`` is read (default ``os.environ``).
        poll_s: the poll's period.
        prctl: use ``PR_SET_PDEATHSIG`` where it exists (False: the poll alone).
    """

    def __init__(self, environ: Mapping[str, str] | None = None, *, poll_s: float = POLL_S, prctl: bool = True) -> None:
        self.launcher = launcher_pid(os.environ if environ is None else environ)
        self.parent = os.getppid()
        self.poll_s, self.prctl = poll_s, prctl
        self.armed_signal = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def gone(self) -> bool:
        """Whether the launcher is gone (the parent changed, or was gone before arming)."""
        launcher_alive = self.launcher is not None and _alive(self.launcher)
        return orphaned(self.parent, os.getppid(), self.launcher, launcher_alive)

    def arm(self) -> None:
        """Sets the death signal and starts the poll; signals at once when the launcher is gone already."""
        self.parent = os.getppid()
        self.armed_signal = self.prctl and set_death_signal(int(ORPHAN_SIGNAL))
        self._thread = threading.Thread(target=self._poll, name="ncclguard-parent", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            if self.gone() and not self._stop.is_set():  # disarmed: the caller's handler may be gone
                os.kill(os.getpid(), ORPHAN_SIGNAL)
                return
            if self._stop.wait(self.poll_s):
                return

    def disarm(self) -> None:
        """Clears the death signal and stops the poll."""
        self._stop.set()
        if self.armed_signal:
            set_death_signal(0)
            self.armed_signal = False
