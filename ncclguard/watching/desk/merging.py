"""The merge of an incident's statements into its report, by the rank that claimed it, and a node's
first rank following a merge made elsewhere: the :class:`Merger` of an
:class:`~ncclguard.watching.desk.desk.IncidentDesk`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Protocol

from ncclguard._log import log
from ncclguard._naming import HOSTNAME, node_address, node_name
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.assemble import assemble, with_whole
from ncclguard.incidents.files import INCIDENT_FILE, SUMMARY_FILE
from ncclguard.incidents.model import (
    Finding,
    Heartbeat,
    Incident,
    IncidentKind,
    MergedNote,
    Statement,
    StoreFinding,
)
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import BRIEF_FROM, StoreRefused, WatchdogStore
from ncclguard.watching.desk.cases import Case, stale_from_statements, write_report
from ncclguard.watching.sensors.liveness import Liveness
from ncclguard.watching.sensors.native import add_outside_stacks

__all__ = ["MergeDesk", "Merger", "gather", "whole_of"]


# Above this many ranks, a node's first rank on another host does not copy the merged report into
# its own incident directory: the copy reads every statement again, and each node doing so would
# cost the job's store (number of nodes) times the merge (benchmarks/desk_scale.py). It logs where
# the report is, as below this size.
COPY_MAX_RANKS = 1024


# Above BRIEF_FROM ranks the merge reads each rank's head (Statement.head), then the whole statements
# of the culprits and of the first WHOLE_VICTIMS victims: a head holds what the analysis reads.
WHOLE_VICTIMS = 8

# What a merge gathered: each rank's statement (or its head), the last heartbeat of each rank that
# said nothing, and whether the statements are heads.
Gathered = tuple[dict[int, Statement], dict[int, Heartbeat], bool]


def gather(store: WatchdogStore, n: int, world_size: int) -> Gathered:
    """What the ranks of a ``world_size``-rank world said on incident ``n``: their statements, or
    above :data:`BRIEF_FROM` ranks their heads; and the heartbeats of the ranks that said nothing.

    Raises:
        StoreTimeout, StoreUnreachable: the store did not answer.
    """
    ranks = list(range(world_size))
    heads = world_size > BRIEF_FROM
    said = store.read_heads(n, ranks) if heads else store.read_statements(n, ranks)
    return said, store.read_heartbeats([r for r in ranks if r not in said]), heads


def whole_of(store: WatchdogStore, n: int, incident: Incident, known: Mapping[int, Statement]) -> Incident:
    """``incident``, assembled from heads, with the whole statements of its culprits and of its first
    :data:`WHOLE_VICTIMS` victims read from the store (``known``: statements at hand, not read).

    Raises:
        StoreTimeout, StoreUnreachable: the store did not answer.
    """
    chosen = {c.rank for c in incident.culprits} | set(incident.victims[:WHOLE_VICTIMS])
    whole = store.read_statements(n, sorted(chosen - set(known)))
    return with_whole(incident, {**whole, **known})


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

    def _gather(self, case: Case, stale: dict[int, float]) -> Gathered | None:
        """What the ranks said on ``case`` (:func:`gather`); None while still waiting."""
        assert self.desk.store is not None
        try:
            dumped = self.desk.store.add_dumped(case.doc.n, 0)
        except StoreRefused:  # the counter holds something else: wait out merge_wait, merge what came
            dumped = 0
        if dumped < self.desk.world_size - len(stale) and time.monotonic() < case.merge_deadline:
            return None
        return gather(self.desk.store, case.doc.n, self.desk.world_size)

    def merge(self, case: Case) -> bool:
        """Merges when every live rank has spoken or the wait is over; returns True once merged."""
        doc = case.doc
        stale = self.desk.liveness.stale(time.monotonic())
        statements: dict[int, Statement] = {self.desk.rank: case.statement}
        heartbeats: dict[int, Heartbeat] = self.desk.liveness.heartbeats()
        extra: list[Finding] = []
        heads = False
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
            statements, heartbeats, heads = gathered
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
            heads=heads,
        )
        if heads:
            incident = self._whole(case, incident)
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

    def _whole(self, case: Case, incident: Incident) -> Incident:
        """``incident`` with the whole statements of its culprits and a few victims (:func:`whole_of`),
        this rank's own as it made it; from the heads alone when the store does not answer."""
        assert self.desk.store is not None
        try:
            return whole_of(self.desk.store, case.doc.n, incident, {self.desk.rank: case.statement})
        except (StoreTimeout, StoreUnreachable) as exc:
            log.warning("watchdog: incident %s: the report holds the ranks' heads only: %s", case.doc.id, exc)
            return with_whole(incident, {self.desk.rank: case.statement})

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
        statements, heartbeats, heads = gather(self.desk.store, case.doc.n, self.desk.world_size)
        stale = stale_from_statements(self.desk.liveness.stale(time.monotonic()), statements)
        incident = assemble(
            case.doc,
            statements,
            heartbeats,
            {r: a for r, a in stale.items() if r not in statements},
            self.desk.world_size,
            merged_by=note.rank if note.rank is not None else self.desk.rank,
            waiting_after_s=self.desk.config.heartbeat_s,
            heads=heads,
        )
        write_report(case, incident, announce=False, plot=self.desk.config.incident_plot)
        return f"; the same report here: {case.dir / SUMMARY_FILE}"
