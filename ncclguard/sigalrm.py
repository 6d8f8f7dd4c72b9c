"""sigalrm_timeout: a deadline for Python code in the main thread, delivered by SIGALRM.

What it can and cannot do: a SIGALRM handler runs in the main thread between bytecodes. It ends
a Python-level stall (a slow evaluation loop, a sleep, a busy loop) within milliseconds of the
deadline, but it cannot interrupt a blocking C++ call such as a gloo or NCCL collective: the
handler only runs once that call returns. The watchdog (:mod:`ncclguard.watchdog`) and the
deadlines of :func:`ncclguard.safe_all_reduce` are what bound a stuck collective.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from ncclguard.errors import CollectiveTimeout
from ncclguard.timeouts import to_seconds

__all__ = ["sigalrm_timeout"]

# Deadlines of the open guards, outermost first: (monotonic deadline, message).
_stack: list[tuple[float, str]] = []


def _arm(deadline: float) -> None:
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-6))


def _on_alarm(signum: int, frame: Any) -> None:
    now = time.monotonic()
    expired = [entry for entry in _stack if entry[0] <= now + 1e-3]
    if not expired:  # an early tick (timer granularity): re-arm for the nearest deadline
        if _stack:
            _arm(min(d for d, _ in _stack))
        return
    deadline, message = min(expired)
    raise CollectiveTimeout(message, op="python", elapsed_s=0.0)


@contextmanager
def sigalrm_timeout(seconds: float, message: str | None = None) -> Iterator[None]:
    """Raises :class:`ncclguard.errors.CollectiveTimeout` in the main thread after ``seconds``.

    Sub-second deadlines work (``setitimer``). Guards nest: the earliest deadline fires, and when
    an inner guard exits the outer one goes on with its remaining time. On exit the previous
    SIGALRM handler and timer are restored.

    Args:
        seconds: the deadline, from entry; positive.
        message: the error's text (default: "Python code ran past its N s deadline").

    Raises:
        RuntimeError: called outside the main thread, or on a platform without SIGALRM.
        ValueError: ``seconds`` is not positive.
        CollectiveTimeout: (inside the block) the deadline passed.
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
    entry = (start + seconds, message or f"Python code ran past its {seconds:g} s deadline")
    outer = not _stack
    if outer:
        prev_handler = signal.signal(signal.SIGALRM, _on_alarm)
        prev_remaining, prev_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    _stack.append(entry)
    _arm(min(d for d, _ in _stack))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _stack.remove(entry)
        if _stack:
            _arm(min(d for d, _ in _stack))
        elif outer:
            signal.signal(signal.SIGALRM, prev_handler)
            if prev_remaining > 0:
                left = prev_remaining - (time.monotonic() - start)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), prev_interval)
