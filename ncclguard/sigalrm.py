"""sigalrm_timeout: a deadline for Python code in the main thread, delivered by SIGALRM.

What it can and cannot do: a SIGALRM handler runs in the main thread between bytecodes. It ends
a Python-level stall (a slow evaluation loop, a sleep, a busy loop) within milliseconds of the
deadline, but it cannot interrupt a blocking C++ call such as a gloo or NCCL collective: the
handler only runs once that call returns (tests/base/test_sigalrm.py and
tests/watching/test_watchdog_multirank.py show both sides). The watchdog (:mod:`ncclguard.watching.watchdog`) and
the deadlines of :func:`ncclguard.safe_all_reduce` are what bound a stuck collective.

The timer's SIGALRM is sent to the process, not to a thread, and the kernel may hand it to
another thread: its C handler then only flags the signal, and a main thread asleep in a system
call (``time.sleep``) is not woken until the call returns. Seen once in a guarded evaluation here
(a 30 s sleep ran to its end past a 1 s deadline); reproduced by sending the signal to another
thread (tests/base/test_sigalrm.py). So while a guard is open a helper thread sends SIGALRM to the main
thread itself, once per deadline, when a deadline is :data:`_KICK_S` overdue and has not fired.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ncclguard.deadlines import to_seconds
from ncclguard.errors import DeadlineExceeded

__all__ = ["sigalrm_timeout"]

_EARLY = 1e-3  # a tick this close to a deadline counts as on time (timer granularity)
_KICK_S = 0.02  # a deadline this overdue and not fired: its signal went astray (module doc)


@dataclass
class _Deadline:
    at: float  # time.monotonic()
    seconds: float
    message: str
    started: float
    fired: bool = False
    # The timer that was armed before the outermost guard: its handler is called at its time.
    previous: Callable[[int, Any], Any] | int | None = None  # a handler, or SIG_DFL
    interval: float = 0.0
    kicked: bool = False  # SIGALRM was sent to the main thread again for it


# The open guards' deadlines (and the previous timer's, if one was armed), in entry order.
_stack: list[_Deadline] = []


def _arm() -> None:
    """Arms the timer for the nearest deadline that has not fired, or disarms it."""
    pending = [d.at for d in _stack if not d.fired]
    if pending:
        signal.setitimer(signal.ITIMER_REAL, max(min(pending) - time.monotonic(), 1e-6))
    else:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _on_alarm(signum: int, frame: Any) -> None:
    now = time.monotonic()
    due = sorted((d for d in _stack if not d.fired and d.at <= now + _EARLY), key=lambda d: d.at)
    for d in due:
        if d.previous is not None or d.interval:  # the timer armed before us: hand it its tick
            if d.interval:
                d.at += d.interval
            else:
                d.fired = True
            if callable(d.previous):
                d.previous(signum, frame)
            continue
        d.fired = True  # never re-armed: the exception below is this deadline's only effect
        _arm()
        raise DeadlineExceeded(d.message, seconds=d.seconds, elapsed_s=now - d.started)
    _arm()  # an early tick, or only the previous timer was due


# Held while the kicker sends and while the outermost guard stops it, so that no kick is sent
# once the guard has begun to put the previous handler back.
_kick_lock = threading.Lock()


def _kicker(stop: threading.Event, main_ident: int) -> None:
    """Sends SIGALRM to the main thread for each deadline overdue by _KICK_S that has not fired.

    It wakes at the nearest such time, and at least every 0.25 s (a nested guard may have added
    an earlier deadline), so a long evaluation costs it a few wake-ups a second.
    """
    wait = 0.0
    while not stop.wait(wait):
        with _kick_lock:
            if stop.is_set():
                return
            now = time.monotonic()
            open_ = [d for d in list(_stack) if not d.fired and not d.kicked]
            late = [d for d in open_ if d.at + _KICK_S <= now]
            for d in late:
                d.kicked = True
            if late:
                signal.pthread_kill(main_ident, signal.SIGALRM)
            upcoming = [d.at + _KICK_S - now for d in open_ if d not in late]
            wait = min([0.25, *upcoming]) if upcoming else 0.25
            wait = max(wait, 1e-3)


@contextmanager
def sigalrm_timeout(seconds: float, message: str | None = None) -> Iterator[None]:
    """Raises :class:`ncclguard.errors.DeadlineExceeded` (a ``TimeoutError``) in the main thread after ``seconds``.

    Sub-second deadlines work (``setitimer``). Guards nest: the earliest deadline fires, and when
    an inner guard exits the outer one goes on with its remaining time. A timer armed before the
    outermost guard keeps running: its handler is called when it comes due, and on exit the
    previous SIGALRM handler and the rest of that timer are put back.

    Args:
        seconds: the deadline, from entry; positive (a number or a timedelta).
        message: the error's text (default: "Python code ran past its N s deadline").

    Raises:
        RuntimeError: called outside the main thread, or on a platform without SIGALRM.
        TypeError, ValueError: ``seconds`` is not a positive duration.
        DeadlineExceeded: (inside the block) the deadline passed.
    """
    seconds = to_seconds(seconds, "seconds")
    if not hasattr(signal, "SIGALRM") or not hasattr(signal, "setitimer"):
        raise RuntimeError("sigalrm_timeout needs SIGALRM and setitimer, which this platform lacks; use the Watchdog")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "sigalrm_timeout works only in the main thread (Python delivers signals there); "
            "use the Watchdog or a safe_* deadline in other threads"
        )
    start = time.monotonic()
    outer = not _stack
    prev_handler: Any = None
    previous: _Deadline | None = None
    if outer:
        prev_remaining, prev_interval = signal.setitimer(signal.ITIMER_REAL, 0)
        prev_handler = signal.signal(signal.SIGALRM, _on_alarm)
        if prev_remaining > 0:
            previous = _Deadline(
                start + prev_remaining,
                prev_remaining,
                "",
                start,
                previous=prev_handler if callable(prev_handler) else signal.SIG_DFL,
                interval=prev_interval,
            )
            _stack.append(previous)
    entry = _Deadline(start + seconds, seconds, message or f"Python code ran past its {seconds:g} s deadline", start)
    _stack.append(entry)
    stop_kicker = threading.Event()
    if outer:
        kicker = threading.Thread(
            target=_kicker, args=(stop_kicker, threading.get_ident()), name="ncclguard-sigalrm-kick", daemon=True
        )
        kicker.start()
    _arm()
    try:
        yield
    finally:
        if outer:
            with _kick_lock:
                stop_kicker.set()
        # A kick sent before the lock was taken is delivered, at the latest, when this call
        # returns, while the handler is still ours (an extra tick is ignored: nothing is due).
        signal.setitimer(signal.ITIMER_REAL, 0)
        _stack.remove(entry)
        if outer:
            if previous is not None:
                _stack.remove(previous)
            if prev_handler is not None:  # None: a handler installed from C, which Python cannot restore
                signal.signal(signal.SIGALRM, prev_handler)
            if previous is not None and not previous.fired:
                signal.setitimer(signal.ITIMER_REAL, max(previous.at - time.monotonic(), 1e-6), previous.interval)
        else:
            _arm()
