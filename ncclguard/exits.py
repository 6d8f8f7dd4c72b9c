"""Ending this process: at once, from any thread (:func:`exit_now`: what a rank does when it must
leave now, fenced out, judged stuck, told to stop by its peers, where an exception could be caught
by the user's code or wait for a collective that never ends); or at the interpreter's exit, once the
work under way on helper threads is over (:class:`ExitWait`).

At exit the interpreter must not finalize while a daemon thread is inside C++ code that gives the
GIL back to Python: the thread is ended by ``pthread_exit`` as it takes the GIL again, the forced
unwind meets a C++ frame that cannot pass it (pybind11's ``gil_scoped_release``, matplotlib's
``ft2font``), and the process dies with ``terminate called without an active exception`` (status
134, pytorch/pytorch#38228), however well its work ended. So the exit first stops the threads that
start torch calls of their own on a period (:func:`poller`: the left-behind fence's store read, the
verdict's look): an :class:`ExitWait` drained while one of them could still start a call would let
that call run into finalization.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from ncclguard._log import log

__all__ = ["EXITING", "ExitWait", "exit_now", "poller", "stop_pollers"]

POLLERS_WAIT_S = 5.0  # how long the exit waits, in all, for the pollers to end their current look

EXITING = threading.Event()  # set at the interpreter's exit (stop_pollers): a poller starts nothing after it
_pollers_lock = threading.Lock()
_pollers: list[tuple[threading.Thread, Callable[[], None] | None]] = []
_pollers_hooked = threading.Event()  # stop_pollers is registered with atexit


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


def poller(thread: threading.Thread, wake: Callable[[], None] | None = None) -> threading.Thread:
    """Counts ``thread``, which starts torch calls of its own on a period, as one the exit stops
    before it waits for the calls under way. The thread waits with ``EXITING.wait(period)`` and
    returns once :data:`EXITING` is set.

    Args:
        thread: the poller, not yet started.
        wake: wakes it from a wait of its own (a condition's), if it waits on something else.

    Returns:
        ``thread``, started.
    """
    with _pollers_lock:
        _pollers[:] = [(t, w) for t, w in _pollers if t.is_alive()]
        _pollers.append((thread, wake))
        if not _pollers_hooked.is_set():
            atexit.register(stop_pollers)
            _pollers_hooked.set()
    thread.start()
    return thread


def stop_pollers(wait_s: float = POLLERS_WAIT_S) -> list[str]:
    """Sets :data:`EXITING` and waits, ``wait_s`` in all, for the pollers to end. Run at exit only:
    :data:`EXITING` stays set.

    Args:
        wait_s: how long to wait for them, in all.

    Returns:
        The names of the pollers still running (a look blocked past the wait; logged).
    """
    EXITING.set()
    until = time.monotonic() + wait_s
    with _pollers_lock:
        pollers = [(t, w) for t, w in _pollers if t.is_alive() and t is not threading.current_thread()]
    for _, wake in pollers:
        if wake is not None:
            wake()
    threads = [t for t, _ in pollers]
    for thread in threads:
        thread.join(max(until - time.monotonic(), 0.0))
    left = [t.name for t in threads if t.is_alive()]
    if left:
        log.warning("ncclguard: %s still running at exit after %.0f s", ", ".join(left), wait_s)
    return left


class ExitWait:
    """Work under way on helper threads that the interpreter's exit waits for, each piece until
    ``wait_s`` after its start (see the module doc). :meth:`drain`, after :func:`stop_pollers`, is
    registered with atexit at the first :meth:`enter`.

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
                atexit.register(self._at_exit)
                self._hooked = True

    def leave(self, done: threading.Event) -> None:
        """The piece of work keyed by ``done`` is over."""
        with self.lock:
            self.under_way.pop(done, None)

    def _at_exit(self) -> None:
        stop_pollers()  # none starts a call once the wait below has seen none under way
        self.drain()

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
