"""Ending this process: at once, from any thread (:func:`exit_now`: what a rank does when it must
leave now, fenced out, judged stuck, told to stop by its peers, where an exception could be caught
by the user's code or wait for a collective that never ends); or at the interpreter's exit, once the
work under way on helper threads is over (:class:`ExitWait`).

At exit the interpreter must not finalize while a daemon thread is inside C++ code that gives the
GIL back to Python: the thread is ended by ``pthread_exit`` as it takes the GIL again, the forced
unwind meets a C++ frame that cannot pass it (pybind11's ``gil_scoped_release``, matplotlib's
``ft2font``), and the process dies with ``terminate called without an active exception`` (status
134, pytorch/pytorch#38228), however well its work ended.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import NoReturn

from ncclguard._log import log

__all__ = ["ExitWait", "exit_now"]


def exit_now(code: int) -> NoReturn:
    """``os._exit(code)`` once the logs and the standard streams are flushed.

    Args:
        code: the process's exit status.
    """
    for handler in logging.getLogger().handlers + logging.getLogger("ncclguard").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a broken handler must not keep the process alive
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ExitWait:
    """Work under way on helper threads that the interpreter's exit waits for, each piece until
    ``wait_s`` after its start (see the module doc). :meth:`drain` is registered with atexit at the
    first :meth:`enter`.

    Args:
        what: what the work is, for the warning on what is left (``"store call(s)"``).
        wait_s: how long after its start a piece of work is waited for.
        why_left: why work older than that may be left to finalization (ends the warning).

    Attributes:
        under_way: each piece's done event (set by its thread when it ends) and when it started.
    """

    def __init__(self, what: str, wait_s: float, why_left: str) -> None:
        self.what, self.wait_s, self.why_left = what, wait_s, why_left
        self.lock = threading.Lock()
        self.under_way: dict[threading.Event, float] = {}
        self._hooked = False

    def enter(self, done: threading.Event) -> None:
        """Counts a piece of work as under way until :meth:`leave` (or ``done`` is set)."""
        with self.lock:
            self.under_way[done] = time.monotonic()
            if not self._hooked:
                atexit.register(self.drain)
                self._hooked = True

    def leave(self, done: threading.Event) -> None:
        """The piece of work keyed by ``done`` is over."""
        with self.lock:
            self.under_way.pop(done, None)

    def drain(self, wait_s: float | None = None) -> int:
        """Waits until no piece is under way, each at most until ``wait_s`` after its start.

        Args:
            wait_s: how long after its start a piece is waited for (default: the instance's).

        Returns:
            How many are still under way (0: finalization is safe for them).
        """
        wait_s = self.wait_s if wait_s is None else wait_s
        while True:
            now = time.monotonic()
            with self.lock:
                pieces = {d: start for d, start in self.under_way.items() if not d.is_set()}
            waited = {done: start + wait_s - now for done, start in pieces.items() if start + wait_s > now}
            if not waited:
                if pieces:
                    log.warning(
                        "ncclguard: %d %s still under way at exit, each over %.0f s old; left to finalization (%s)",
                        len(pieces),
                        self.what,
                        wait_s,
                        self.why_left,
                    )
                return len(pieces)
            done, left = next(iter(waited.items()))
            done.wait(min(left, 0.1))
