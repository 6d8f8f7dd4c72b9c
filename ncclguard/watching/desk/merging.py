"""The merge of an incident's statements into its report, by the rank that claimed it, and a node's
first rank following a merge made elsewhere: the :class:`Merger` of an
:class:`~ncclguard.watching.desk.desk.IncidentDesk`."""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

from ncclguard._log import log
from ncclguard._naming import HOSTNAME, node_address, node_name
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.assemble import assemble
from ncclguard.incidents.files import INCIDENT_FILE, SUMMARY_FILE
from ncclguard.incidents.model import (
    Finding,
    Heartbeat,
    IncidentKind,
    MergedNote,
    Statement,
    StoreFinding,
)
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import StoreRefused, WatchdogStore
from ncclguard.watching.desk.cases import Case, stale_from_statements, write_report
from ncclguard.watching.sensors.liveness import Liveness
from ncclguard.watching.sensors.native import add_outside_stacks

__all__ = ["MergeDesk", "Merger"]


# Above this many ranks, a node's first rank on another host does not copy the merged report into
# its own incident directory: the copy reads every statement again, and each node doing so would
# cost the job's store (number of nodes) times the merge (benchmarks/desk_scale.py). It logs where
# the report is, as below this size.
COPY_MAX_RANKS = 1024


class MergeDesk(Protocol):
    """What the merger reads of its desk: the settings, this rank, the peers, the store (which the
    desk drops when it goes away), and the desk's two calls."""

    config: WatchdogConfig
    rank: int
    world_size: int
    liveness: Liveness
    store: WatchdogStore | None

    def store_gone(self, exc: BaseException) -> None:
        """The store stopped answering: the desk handles what follows on this rank alone."""

    def notify(self) -> None:
        """An incident changed: whoever waits on the desk looks again."""


class Merger:
    """Gathers the statements of a case and merges them, or follows another rank's merge.

    Args:
        desk: the desk whose cases it merges.
    """

    def __init__(self, desk: MergeDesk) -> None:
        self.desk = desk

    def _gather(self, case: Case, stale: dict[int, float]) -> tuple[dict[int, Statement], dict[int, Heartbeat]] | None:
        """The statements and heartbeats of ``case`` from the store; None while still waiting."""
        assert self.desk.store is not None
        try:
            dumped = self.desk.store.add_dumped(case.doc.n, 0)
        except StoreRefused:  # the counter holds something else: wait out merge_wait, merge what came
            dumped = 0
        if dumped < self.desk.world_size - len(stale) and time.monotonic() < case.merge_deadline:
            return None
        ranks = list(range(self.desk.world_size))
        return self.desk.store.read_statements(case.doc.n, ranks), self.desk.store.read_heartbeats(ranks)

    def merge(self, case: Case) -> bool:
        """Merges when every live rank has spoken or the wait is over; returns True once merged."""
        doc = case.doc
        stale = self.desk.liveness.stale(time.monotonic())
        statements: dict[int, Statement] = {self.desk.rank: case.statement}
        heartbeats: dict[int, Heartbeat] = self.desk.liveness.heartbeats()
        extra: list[Finding] = []
        if doc.kind is IncidentKind.STORE_GONE:
            heartbeats = {}
            extra = [StoreFinding(text=doc.store_text or doc.reason)]
        elif case.local or self.desk.store is None:
            gone = f"the store went away before the merge: only rank {self.desk.rank}'s statement and the heartbeats"
            extra = [] if case.local else [StoreFinding(text=f"{gone} it had seen are in this report")]
        else:
            try:
                gathered = self._gather(case, stale)
            except StoreUnreachable as exc:
                self.desk.store_gone(exc)
                return False  # merge from what this rank has, next tick
            if gathered is None:
                return False
            statements, heartbeats = gathered
            stale = stale_from_statements(stale, statements)
        incident = assemble(
            doc,
            statements,
            heartbeats,
            {r: a for r, a in stale.items() if r not in statements},
            self.desk.world_size,
            merged_by=self.desk.rank,
            waiting_after_s=self.desk.config.heartbeat_s,
            extra_findings=extra,
            analyse_ranks=doc.kind is not IncidentKind.STORE_GONE,
        )
        write_report(case, incident, plot=self.desk.config.incident_plot)
        add_outside_stacks(incident, lambda more: write_report(case, more, announce=False))
        case.merged = True
        if self.desk.store is not None and not case.local:
            with contextlib.suppress(StoreTimeout, StoreUnreachable):
                culprits = sorted({c.rank for c in incident.culprits})
                note = MergedNote(
                    host=HOSTNAME,
                    address=node_address(),
                    rank=self.desk.rank,
                    dir=str(case.dir),
                    summary=incident.summary,
                    culprits=culprits,
                )
                self.desk.store.put_merged(doc.n, note)
        self.desk.notify()
        return True

    def follow(self, case: Case) -> bool:
        """On a node's first rank that did not merge: once the merger's note is in the store, logs the
        merged report here, and writes the merged report into this host's incident directory when it
        is not there (a directory that is not shared), from the same statements, in a world of at
        most :data:`COPY_MAX_RANKS` ranks.

        Returns:
            True when done (or nothing is left to wait for); False to look again next tick.
        """
        if self.desk.store is None or case.local:
            return True
        try:
            note = self.desk.store.read_merged(case.doc.n)
        except StoreTimeout:
            return False
        if note is None:  # the merger has until its merge_wait; then a little more for its files
            return (
                time.monotonic() > case.merge_deadline + self.desk.config.merge_wait + 2 * self.desk.config.heartbeat_s
            )
        if (note.host, note.address) == (HOSTNAME, node_address()):
            return True  # merged on this host: its merger logged it here
        copied = "" if (case.dir / INCIDENT_FILE).exists() else self._copy_here(case, note)
        where = node_name(note.host, note.address)
        log.error(
            "watchdog: incident %s merged by rank %s on %s: %s; its report there: %s%s",
            case.doc.id,
            "?" if note.rank is None else note.rank,
            where,
            note.summary,
            f"{note.dir}/{SUMMARY_FILE}",
            copied,
        )
        return True

    def _copy_here(self, case: Case, note: MergedNote) -> str:
        """Writes the merged report into this host's incident directory, from the statements in the
        store, in a world of at most :data:`COPY_MAX_RANKS` ranks; the log line's words for it."""
        assert self.desk.store is not None
        if self.desk.world_size > COPY_MAX_RANKS:
            return f"; not copied here: over {COPY_MAX_RANKS} ranks only the merger reads every statement"
        ranks = list(range(self.desk.world_size))
        statements, heartbeats = (
            self.desk.store.read_statements(case.doc.n, ranks),
            self.desk.store.read_heartbeats(ranks),
        )
        stale = stale_from_statements(self.desk.liveness.stale(time.monotonic()), statements)
        incident = assemble(
            case.doc,
            statements,
            heartbeats,
            {r: a for r, a in stale.items() if r not in statements},
            self.desk.world_size,
            merged_by=note.rank if note.rank is not None else self.desk.rank,
            waiting_after_s=self.desk.config.heartbeat_s,
        )
        write_report(case, incident, announce=False, plot=self.desk.config.incident_plot)
        return f"; the same report here: {case.dir / SUMMARY_FILE}"
