"""What another thread tells the watchdog to raise: the recovery engine's numerical findings
(docs/numerics.md), which its commit names on the training thread. The desk is the watchdog
thread's alone, so a finding waits in :class:`Told` and is opened there at the next tick, as any
detection (claimed once across ranks by its signature, dumped, merged, reported)."""

from __future__ import annotations

import threading
from collections import deque

from ncclguard._log import log
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.sensors.detect import Detection

__all__ = ["MAX_TOLD", "Told"]

MAX_TOLD = 16  # detections waiting at most (the oldest goes first, said once)


class Told:
    """Detections told by other threads, opened on the watchdog's thread (:meth:`open_in`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Detection] = deque()
        self._dropped = False

    def put(self, det: Detection) -> None:
        """Queues ``det`` for the next tick (from any thread)."""
        with self._lock:
            if len(self._queue) >= MAX_TOLD:
                gone = self._queue.popleft()
                if not self._dropped:
                    self._dropped = True
                    log.warning("watchdog: more than %d findings waiting; %s is not raised", MAX_TOLD, gone.signature)
            self._queue.append(det)

    def clear(self) -> None:
        """Forgets what waits (a restarted watchdog starts afresh)."""
        with self._lock:
            self._queue.clear()

    def open_in(self, desk: IncidentDesk) -> None:
        """Opens what waits, oldest first (the watchdog's thread).

        Raises:
            StoreTimeout, StoreUnreachable: the store did not answer; the detection it was opening
                waits for the next tick.
        """
        while True:
            with self._lock:
                if not self._queue:
                    return
                det = self._queue[0]
            desk.open(det)
            with self._lock:
                if self._queue and self._queue[0] is det:
                    self._queue.popleft()
