"""Abandoned process groups, released off the training thread.

Dropping the last reference to a gloo group runs its destructor, which waits until the group's
work queue is empty. After a timeout that queue still holds the abandoned collective, which ends
only when every peer has closed its side or at the group's own timeout (30 min by default for
gloo): measured here, 7 s with an 8 s group timeout and a stalled peer. torch releases the GIL in
that destructor, so running it on a thread of its own keeps the training thread free.

The reaper keeps each abandoned group until it holds the last Python reference (a DDP wrapper the
user has not dropped yet keeps one), so the destructor runs on the reaper's thread, not on the
thread that happens to drop the last reference. References held by a reference cycle (an
exception whose traceback holds a frame that holds the group) go only with the cyclic garbage
collector, so while something is held the reaper runs ``gc.collect()`` after 2 s, then at
doubling intervals (6, 14, 30, 62 s), and no more: a pause of tens of milliseconds each time.

An object still referenced elsewhere when its hold time is over (by then its collectives have all
ended, so its destructor no longer waits on anyone) is let go with a warning: it lives as long
as those references do.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ncclguard._log import log
from ncclguard.deadlines import Deadline

__all__ = ["Reaper", "reaper"]

# sys.getrefcount of an object referenced only by one attribute: that and the call's argument.
_ALONE = 2
_FIRST_GC_S = 2.0
_LAST_GC_S = 62.0


@dataclass
class _Grave:
    obj: Any
    until: float  # time.monotonic() after which the reaper lets go even if others still hold it
    label: str


class Reaper:
    """Holds abandoned objects and drops each once nothing else references it, on its own thread.

    The thread runs only while something is held, so an idle reaper costs no thread.

    Args:
        poll_s: how often the thread looks at the references held.
    """

    def __init__(self, poll_s: float = 0.1) -> None:
        self._poll_s = poll_s
        self._lock = threading.Condition()
        self._held: list[_Grave] = []
        self._thread: threading.Thread | None = None
        self._releasing = 0

    def bury(self, objects: list[Any], hold_s: float, label: str = "object") -> None:
        """Takes ``objects`` over; the caller should drop its own references to them.

        Args:
            objects: what to release.
            hold_s: the longest the reaper waits for the other references to go.
            label: what they are, for the log.
        """
        if not objects:
            return
        until = time.monotonic() + hold_s
        with self._lock:
            self._held.extend(_Grave(obj, until, label) for obj in objects)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ncclguard-reaper", daemon=True)
                self._thread.start()

    def pending(self) -> int:
        """Objects held or being released right now."""
        with self._lock:
            return len(self._held) + self._releasing

    def wait_idle(self, timeout: float | timedelta | Deadline) -> bool:
        """Waits until every object was released, until ``timeout`` (seconds, or a deadline); True when idle."""
        deadline = Deadline.after(timeout)
        with self._lock:
            while self._held or self._releasing or self._thread is not None:
                if deadline.passed():
                    return False
                self._lock.wait(deadline.left())
        return True

    def _run(self) -> None:
        interval = _FIRST_GC_S
        next_gc = time.monotonic() + interval
        while True:
            now = time.monotonic()
            if now >= next_gc:
                gc.collect()  # cycles that still hold an object; the check below then sees it alone
                interval *= 2
                next_gc = now + interval if interval <= _LAST_GC_S else float("inf")
                now = time.monotonic()
            with self._lock:
                if not self._held:
                    self._thread = None
                    self._lock.notify_all()
                    return
                keep: list[_Grave] = []
                released: list[Any] = []
                for grave in self._held:
                    refs = sys.getrefcount(grave.obj)
                    if refs <= _ALONE:
                        released.append(grave.obj)
                    elif now >= grave.until:
                        log.warning(
                            "reaper: an abandoned %s is still referenced %d time(s) outside ncclguard; let go",
                            grave.label,
                            refs - _ALONE,
                        )
                    else:
                        keep.append(grave)
                        continue
                    grave.obj = None
                self._held = keep
                self._releasing += len(released)
            if released:
                self._release(released)
            else:
                time.sleep(self._poll_s)

    def _release(self, released: list[Any]) -> None:
        start = time.monotonic()
        count = len(released)
        try:
            released.clear()  # the destructors run here, without the GIL; they may wait on peers
        except Exception:  # noqa: BLE001 - a failing destructor must not kill the reaper
            log.exception("reaper: releasing an abandoned object raised")
        took = time.monotonic() - start
        if took > 1.0:
            log.info("reaper: released %d abandoned object(s) in %.1f s", count, took)
        with self._lock:
            self._releasing -= count
            self._lock.notify_all()


reaper = Reaper()
