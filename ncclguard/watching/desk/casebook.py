"""This rank's incidents across the worlds its watchdog followed: the cases of the desks before, then
the current desk's, and the wait for one (``Watchdog.incidents``, ``Watchdog.wait_for_incident``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.watching.desk.cases import Case
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.sensors.detect import Detection

__all__ = ["Casebook"]


class Casebook:
    """The cases of this rank, oldest first; the desks notify ``cond`` whenever a case changes."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.desk: IncidentDesk | None = None  # the world's desk now
        self._retired: list[Case] = []  # the cases of earlier worlds' desks, oldest first

    def clear(self) -> None:
        """Forgets every case (a restarted watchdog starts afresh)."""
        with self.cond:
            self.desk, self._retired = None, []

    def follow(self, desk: IncidentDesk) -> None:
        """Makes ``desk`` the current one; the cases of the one before are kept as they were."""
        with self.cond:
            if self.desk is not None:
                self._retired.extend(self.desk.cases)
            self.desk = desk

    def cases(self) -> list[Case]:
        """Every case, oldest first (call with ``cond`` held)."""
        return self._retired + (self.desk.cases if self.desk is not None else [])

    def records(self) -> list[dict[str, Any]]:
        """Each case as ``Watchdog.incidents`` shows it."""
        with self.cond:
            return [c.record() for c in self.cases()]

    def wait(self, timeout: float, count: int = 1, merged: bool = False, settled: bool = False) -> None:
        """Waits until there are ``count`` cases, at most ``timeout`` seconds (see
        ``Watchdog.wait_for_incident`` for ``merged`` and ``settled``)."""
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            cases = self.cases()
            if len(cases) < count:
                return False
            last = cases[count - 1]
            if settled and not last.ladder.settled:
                return False
            return not merged or (last.dir / INCIDENT_FILE).is_file()

        with self.cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, 0.05))

    def wait_handled(self, det: Detection, timeout: float) -> bool:
        """Waits until this rank has handled the incident of ``det`` (raised here or by a peer: the
        same signature; or raised here alone, without a store), and merged it when this rank is its
        merger, at most ``timeout`` seconds.

        Returns:
            True once it was.
        """
        deadline = time.monotonic() + timeout

        def handled() -> bool:
            for case in self.cases():
                doc = case.doc
                mine = doc.signature == det.signature or (case.local and doc.numerics == det.numerics)
                if mine and doc.kind is det.kind:
                    return case.merged or not case.merger
            return False

        with self.cond:
            while not handled():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.05))
        return True
