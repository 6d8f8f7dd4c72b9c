"""An incident as a rank handles it: the :class:`Case`, its directory, its dump and report on disk,
and what the store says of its report. Nothing is written outside ``incident_dir``
(:func:`incident_path`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.files import INCIDENT_FILE, SUMMARY_FILE, write_json, write_text
from ncclguard.incidents.model import (
    BackendEntry,
    FenceNote,
    Heartbeat,
    Incident,
    IncidentDoc,
    IncidentKind,
    MergedNote,
    OpRecord,
    RankDump,
    Statement,
    TrackSpan,
)
from ncclguard.incidents.pictures import draw_later
from ncclguard.incidents.render import render
from ncclguard.watching.base.watchdog_store import INCIDENT_ID, WatchdogStore
from ncclguard.watching.ladder.actions import (
    IncidentRef,
    LadderState,
)
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.rank_state import RankState

__all__ = ["Case", "blocked_in", "describe", "incident_path", "past_op", "stale_from_statements"]
__all__ += ["MAX_NEW_INCIDENTS", "CounterReads", "gen_tag", "mark_fenced", "merged_note", "op_resolved", "write_report"]

_BACKEND_KINDS = (IncidentKind.BACKEND_DESYNC, IncidentKind.BACKEND_STUCK)  # numbered by the backend
_REPORTS = (IncidentKind.STRAGGLER, IncidentKind.SENSOR, IncidentKind.NUMERICS)  # never a rung past report
MAX_NEW_INCIDENTS = 256  # more new incidents in one poll is not the watchdog's doing (a counter someone set)


def incident_path(root: Path | str, ident: str) -> Path:
    """The directory of incident ``ident`` under ``root``, resolved.

    Raises:
        ValueError: ``ident`` is not a plain name (:data:`~ncclguard.watching.base.watchdog_store.INCIDENT_ID`),
            or the directory resolves outside ``root`` (a symbolic link there pointing out).
    """
    if not INCIDENT_ID.match(ident):
        raise ValueError(f"incident id {ident[:80]!r} is not a plain directory name; nothing is written for it")
    base = Path(root).resolve()
    where = (base / ident).resolve()
    if where.parent != base:
        raise ValueError(f"incident directory {base / ident} resolves to {where}, outside {base}; nothing is written")
    return where


@dataclass
class Case:
    """An incident as this rank handles it."""

    doc: IncidentDoc
    dir: Path
    local: bool
    statement: Statement
    heartbeats: dict[int, Heartbeat]
    threads: dict[str, list[str]]
    records: list[OpRecord]
    merger: bool = False
    filing: bool = False  # its statement waits in the node's store to be carried (the node tier)
    merge_deadline: float = 0.0
    merged: bool = False
    followed: bool = False  # a node's first rank: the merged report logged (and copied) here
    ladder: LadderState = field(default_factory=LadderState)
    track: list[TrackSpan] = field(default_factory=list)  # where the main thread was (the pictures)
    backend: list[BackendEntry] = field(default_factory=list)  # torch's flight recorder (the pictures)

    @property
    def ref(self) -> IncidentRef:
        return IncidentRef(self.doc, self.dir)

    def to_dump(self, waiting_after_s: float, watchdog: dict[str, Any], ladder: Sequence[str]) -> RankDump:
        """This rank's dump of the incident (``rank<r>.json``)."""
        return RankDump(
            incident=self.doc,
            statement=self.statement,
            threads=self.threads,
            records=self.records,
            heartbeats={str(r): hb for r, hb in self.heartbeats.items()},
            waiting_after_s=waiting_after_s,
            watchdog=watchdog,
            ladder=list(ladder),
            actions=[s.entry() for s in self.ladder.steps],
            track=self.track,
            backend=self.backend,
        )

    def record(self) -> dict[str, Any]:
        """What :attr:`Watchdog.incidents` shows of it."""
        return {
            "id": self.doc.id,
            "kind": self.doc.kind.value,
            "dir": str(self.dir),
            "merger": self.merger,
            "actions": [s.entry().to_json() for s in self.ladder.steps],
            "settled": self.ladder.settled,
            "doc": self.doc.to_json(),
        }


def describe(
    det: Detection, rank: int, n: int, ident: str, created: float, signature: str | None = None
) -> IncidentDoc:
    """The incident ``det`` as raised by ``rank``: numbered ``n``, named ``ident``."""
    return IncidentDoc(
        kind=det.kind,
        reason=det.reason,
        id=ident,
        by=rank,
        created=created,
        n=n,
        signature=signature if signature is not None else det.signature,
        group=det.group,
        seq=det.seq,
        op=det.op,
        ranks=list(det.ranks) if det.ranks is not None else None,
        store_text=det.store_text,
        straggler=det.straggler,
        numerics=det.numerics,
    )


def past_op(doc: IncidentDoc, state: RankState) -> bool | None:
    """Whether this rank is past the op of ``doc``: its recorded op completed (a hang), or its
    backend number moved beyond the op's (a desync); always for a report (a straggler, a sensor's
    finding, the recovery engine's numerical finding); None for kinds without an op."""
    if doc.kind in _REPORTS:
        return True  # a report: nothing to clear, and never a rung past report (docs/stragglers.md)
    key = doc.op_key
    if key is not None:
        return state.completed(key)
    if doc.kind in _BACKEND_KINDS and doc.group is not None and doc.seq is not None:
        return (state.backend_seq() or {}).get(doc.group, -1) > doc.seq
    return None


def op_resolved(case: Case, state: RankState, store: WatchdogStore | None) -> bool:
    """True once the op of a hang or desync incident completed somewhere (never for lost ranks):
    here (then marked in the store, for the others) or on a rank that marked it."""
    passed = past_op(case.doc, state)
    if passed is None:
        return False
    if passed:
        if not case.local and store is not None:
            with contextlib.suppress(StoreTimeout, StoreUnreachable):
                store.set_mark(store.keys.resolved(case.doc.n))
        return True
    if case.local or store is None:
        return False
    try:
        return store.has_mark(store.keys.resolved(case.doc.n))
    except (StoreTimeout, StoreUnreachable):
        return False


class CounterReads:
    """When the watchdog reads the store's incident counter: at every tick while something happens
    (an incident of this rank open, one just raised here or by another rank), else every half beat,
    at most a quarter of ``merge_wait_s``. Read at every tick, the counter was 10 of a healthy rank's
    13 store requests a beat (``benchmarks/watchdog_scale.py``); a rank an incident is about learns
    it at most half a beat late, well within the merge's wait.

    Args:
        every: the seconds between reads while nothing happens.
    """

    def __init__(self, every: float) -> None:
        self.every, self._at = every, 0.0

    def now(self) -> None:
        """Has the next tick read it (an incident was just raised)."""
        self._at = 0.0

    def due(self, now: float, busy: bool) -> bool:
        """Whether to read it at this tick (``now``: ``time.monotonic()``; ``busy``: something is open)."""
        if now < self._at and not busy:
            return False
        self._at = now + self.every
        return True


def blocked_in(doc: IncidentDoc, state: RankState) -> OpRecord | None:
    """The op the main thread is blocked in: a recorded synchronous op, or, at a desync's backend
    number, the backend op issued from C++ (nothing recorded it in Python)."""
    rec = state.blocked_in()
    if rec is None and doc.kind in _BACKEND_KINDS and doc.group is not None and doc.seq is not None:
        if (state.backend_seq() or {}).get(doc.group) == doc.seq:
            rec = OpRecord(seq=doc.seq, op=doc.op or "a backend op", group=doc.group, start=doc.created)
    return rec


def stale_from_statements(stale: Mapping[int, float], statements: Mapping[int, Statement]) -> dict[int, float]:
    """``stale`` plus the peers any statement found stale (each rank watches a few peers: a peer
    is lost if anyone found it so), with the longest silence seen; ranks that spoke are not."""
    out = dict(stale)
    for st in statements.values():
        for r, view in st.peers.items():
            if view.stale and int(r) not in statements:
                out[int(r)] = max(out.get(int(r), 0.0), view.age_s)
    return out


def merged_note(store: WatchdogStore | None, case: Case) -> MergedNote | None:
    """The merged report of ``case`` as the store has it (the ``fence`` rung's input); None
    without a store or before the merge."""
    if store is None or case.local:
        return None
    try:
        return store.read_merged(case.doc.n)
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not read the merged report of incident %s: %s", case.doc.id, exc)
        return None


def mark_fenced(store: WatchdogStore | None, case: Case) -> bool:
    """Puts this rank's fence mark in the store (status shows it); False when it could not."""
    if store is None or case.local:
        return False
    note = FenceNote(rank=case.statement.rank, host=HOSTNAME, pid=os.getpid(), incident=case.doc.id, time=time.time())
    try:
        store.put_fenced(note)
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not mark this rank fenced in the store: %s", exc)
        return False
    return True


def write_report(case: Case, incident: Incident, *, announce: bool = True, plot: bool = False) -> None:
    """Writes the merged ``incident.json`` and ``summary.txt`` of ``case`` (and logs the report);
    with ``plot``, ``timeline.png`` too, from a thread of its own when matplotlib is installed."""
    text = render(incident)
    try:
        write_json(case.dir / INCIDENT_FILE, incident)
        write_text(case.dir / SUMMARY_FILE, text)
    except OSError as exc:
        log.error("watchdog: could not write incident %s: %s", case.doc.id, exc)
    if plot:
        draw_later(incident, case.dir)
    if announce:
        log.error(
            "watchdog: incident %s merged: %s; report: %s", case.doc.id, incident.summary, case.dir / SUMMARY_FILE
        )
        log.info("watchdog: incident report\n%s", text)


def gen_tag(world: Mapping[str, Any]) -> str:
    # Incident numbers restart in each generation: its ids say which one ("g1-001").
    gen = world.get("generation", 0)
    return f"g{gen}-" if gen else ""
