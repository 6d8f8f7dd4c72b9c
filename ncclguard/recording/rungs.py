"""The watchdog's rungs that acted on this process: what a failed step's commit names as a cause.

A rung that acts (``raise``, ``abort``, ``fence``, ``exit``, your own) can fail the step in flight;
``report`` changes nothing. The running watchdog's incident desk notes each rung that acted here
(the record is emptied as a watchdog starts and as it stops), and
:func:`~ncclguard.recovery.commit.should_commit` reads them, so the commit needs nothing of the
watchdog but this record (a base the two share, below both).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

__all__ = ["PASSIVE", "ActedRung", "ActedRungs", "acted"]

PASSIVE = ("report", "resolved")  # the ladder's entries that change nothing in the step
MAX_ACTED = 64  # the newest kept: a commit looks back one step


@dataclass(frozen=True)
class ActedRung:
    """One rung that acted.

    Attributes:
        incident: the incident's id.
        kind: the incident's kind (``hang``, ``desync``, ...).
        rung: the rung's name.
        created: ``time.time()`` when the incident was raised.
    """

    incident: str
    kind: str
    rung: str
    created: float


class ActedRungs:
    """The rungs that acted on this process, newest last (written by the watchdog's thread, read by
    the training thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rungs: deque[ActedRung] = deque(maxlen=MAX_ACTED)

    def note(self, rung: ActedRung) -> None:
        """Notes ``rung`` (a passive one is not noted)."""
        if rung.rung in PASSIVE:
            return
        with self._lock:
            self._rungs.append(rung)

    def since(self, when: float) -> list[ActedRung]:
        """The rungs of incidents raised at ``when`` (``time.time()``) or later, oldest first."""
        with self._lock:
            return [r for r in self._rungs if r.created >= when]

    def clear(self) -> None:
        """Forgets every rung (the watchdog, as it starts and as it stops: only the running one's count)."""
        with self._lock:
            self._rungs.clear()


acted = ActedRungs()  # the process's: one watchdog per process
