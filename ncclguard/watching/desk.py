"""Incidents across ranks: claim, statements, merge, and the ladder of each one.

An incident is a numbered entry in the store. The first rank that detects something claims its
signature and numbers it; every rank's watchdog that sees the number handles it: dumps the stacks
of all its Python threads, its flight records and the heartbeats to
``<incident_dir>/<id>/rank<r>.json`` and publishes a statement; the first rank done merges the
statements into ``incident.json`` and ``summary.txt`` (:mod:`ncclguard.incidents.analysis`),
waiting at most ``merge_wait`` for the others. Then every rank climbs the action ladder
(:mod:`ncclguard.watching.actions`). Without a store (a world of one, or the store gone) a rank
handles its incidents alone ("local" incidents, numbered below zero). Nothing is written
outside ``incident_dir`` (:func:`incident_path`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclguard._log import log
from ncclguard._naming import HOSTNAME, rank_ranges
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.analysis import assemble
from ncclguard.incidents.files import INCIDENT_FILE, SUMMARY_FILE, write_json
from ncclguard.incidents.model import (
    BackendEntry,
    FenceNote,
    Finding,
    Heartbeat,
    Incident,
    IncidentDoc,
    IncidentKind,
    MergedNote,
    OpRecord,
    RankDump,
    Statement,
    StoreFinding,
    TrackSpan,
)
from ncclguard.incidents.pictures import draw_later
from ncclguard.incidents.render import render
from ncclguard.watching.actions import (
    Action,
    ActionContext,
    IncidentRef,
    Ladder,
    LadderState,
    MainThreadRaiser,
    Outcome,
    Step,
)
from ncclguard.watching.detect import Detection
from ncclguard.watching.liveness import Liveness
from ncclguard.watching.native import add_outside_stacks
from ncclguard.watching.protocol import INCIDENT_ID, StoreRefused, WatchdogStore
from ncclguard.watching.settings import WatchdogConfig
from ncclguard.watching.snapshot import RankState

__all__ = ["Case", "IncidentDesk", "blocked_in", "describe", "incident_path", "past_op", "stale_from_statements"]
__all__ += ["mark_fenced", "merged_note", "write_report"]

_BACKEND_KINDS = (IncidentKind.BACKEND_DESYNC, IncidentKind.BACKEND_STUCK)  # numbered by the backend
MAX_NEW_INCIDENTS = 256  # more new incidents in one poll is not the watchdog's doing (a counter someone set)


def incident_path(root: Path | str, ident: str) -> Path:
    """The directory of incident ``ident`` under ``root``, resolved.

    Raises:
        ValueError: ``ident`` is not a plain name (:data:`~ncclguard.watching.protocol.INCIDENT_ID`),
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
    merge_deadline: float = 0.0
    merged: bool = False
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
    )


def past_op(doc: IncidentDoc, state: RankState) -> bool | None:
    """Whether this rank is past the op of ``doc``: its recorded op completed (a hang), or its
    backend number moved beyond the op's (a desync); always for a straggler; None for kinds without an op."""
    if doc.kind is IncidentKind.STRAGGLER:
        return True  # a report: nothing to clear, and never a rung past report (docs/stragglers.md)
    key = doc.op_key
    if key is not None:
        return state.completed(key)
    if doc.kind in _BACKEND_KINDS and doc.group is not None and doc.seq is not None:
        return (state.backend_seq() or {}).get(doc.group, -1) > doc.seq
    return None


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
    """The merged verdict of ``case`` as the store has it (the ``fence`` rung's input); None
    without a store or before the merge."""
    if store is None or case.local:
        return None
    try:
        return store.read_merged(case.doc.n)
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not read the merged verdict of incident %s: %s", case.doc.id, exc)
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
        (case.dir / SUMMARY_FILE).write_text(text)
    except OSError as exc:
        log.error("watchdog: could not write incident %s: %s", case.doc.id, exc)
    if plot:
        draw_later(incident, case.dir)
    if announce:
        log.error(
            "watchdog: incident %s merged: %s; report: %s", case.doc.id, incident.summary, case.dir / SUMMARY_FILE
        )
        log.info("watchdog: incident report\n%s", text)


def _gen_tag(world: Mapping[str, Any]) -> str:
    # Incident numbers restart in each generation: its ids say which one ("g1-001").
    gen = world.get("generation", 0)
    return f"g{gen}-" if gen else ""


class IncidentDesk:
    """Raises, handles and merges this rank's incidents, and climbs their ladders.

    Args:
        config: the watchdog's settings.
        state: this rank's state.
        liveness: the watched peers.
        ladder: the action ladder.
        raiser: carries the ``raise`` rung into the main thread (None without one).
        statement: this rank's statement now.
        cond: notified whenever an incident changes (``Watchdog.wait_for_incident`` waits on it).
        story: what this rank did lately, for the pictures (:mod:`ncclguard.watching.story`): the
            main thread's track and torch's flight-recorder entries; None: neither.
    """

    def __init__(
        self,
        config: WatchdogConfig,
        state: RankState,
        liveness: Liveness,
        ladder: Ladder,
        raiser: MainThreadRaiser | None,
        statement: Callable[[], Statement],
        cond: threading.Condition,
        story: Callable[[], tuple[list[TrackSpan], list[BackendEntry]]] | None = None,
    ) -> None:
        self.config, self.state, self.liveness, self.ladder = config, state, liveness, ladder
        self.raiser, self.statement, self.cond, self.story = raiser, statement, cond, story
        self.rank, self.world_size = state.rank, state.world_size
        self.store: WatchdogStore | None = None
        self.store_addr: str | None = None
        self.store_lost = False
        self.cases: list[Case] = []
        self.seen_count = 0
        # The world this desk raises incidents in: its generation and the rebuild that made it.
        self.world: dict[str, Any] = {"generation": 0}
        self._waiting_docs: dict[int, float] = {}
        self._local_count = 0

    def _notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # ----------------------------------------------------------------- raising

    def open(self, det: Detection) -> None:
        """Raises ``det`` in the store (once per signature across ranks), or locally without one.

        Raises:
            StoreTimeout, StoreUnreachable: the store did not answer.
        """
        if self.store is None:
            self.open_local(det)
            return
        token = f"{self.rank}:{uuid.uuid4().hex[:8]}"
        if not self.store.claim(det.signature, token):
            return  # another rank raised it; poll() picks it up
        try:
            n = self.store.number_incident()
        except StoreRefused as exc:  # the counter holds something else: no number in the store
            log.error("watchdog: incident counter unusable (%s); handling %s on this rank only", exc, det.signature)
            self.open_local(det)
            return
        created = time.time()
        ident = f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(created))}-{_gen_tag(self.world)}{n:03d}"
        doc = describe(det, self.rank, n, ident, created).model_copy(update=self.world)
        self.store.put_incident(doc)

    def open_local(self, det: Detection) -> None:
        """Handles ``det`` on this rank alone."""
        self._local_count += 1
        created = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(created))
        ident = f"{stamp}-{_gen_tag(self.world)}r{self.rank}-{det.kind.value}-{self._local_count}"
        doc = describe(det, self.rank, -self._local_count, ident, created, "local").model_copy(update=self.world)
        self.handle(doc, local=True)

    def store_gone(self, exc: BaseException) -> None:
        """The store stopped answering: drop it and raise a local ``store`` incident (once)."""
        if self.store_lost:
            return
        self.store_lost = True
        self.store = None
        addr = (
            self.store_addr
            or self.config.store_addr
            or f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        )
        text = (
            f"the rendezvous store at {addr} stopped answering ({exc}); it lives in rank 0's process under a plain "
            "launcher and in the agent under torchrun, so that process is probably gone"
        )
        log.error("watchdog: %s; handling incidents on this rank only from now on", text)
        self.open_local(Detection(IncidentKind.STORE_GONE, "the rendezvous store is gone", "local", store_text=text))

    # ----------------------------------------------------------------- handling

    def poll(self) -> None:
        """Handles the incidents numbered in the store since the last poll."""
        if self.store is None:
            return
        try:
            count = self.store.incident_count()
        except StoreTimeout:
            return
        if count - self.seen_count > MAX_NEW_INCIDENTS:
            self.store.warn_once(
                self.store.keys.count,
                f"{self.store.keys.count} jumped from {self.seen_count} to {count}: not the watchdog's doing; skipped",
            )
            self.seen_count = count
            return
        now, skipped = time.monotonic(), []
        for n in range(self.seen_count + 1, count + 1):  # each number's wait starts when first counted
            self._waiting_docs.setdefault(n, now)
        for n in range(self.seen_count + 1, count + 1):
            if not self.store.has_incident(n):
                if now - self._waiting_docs[n] < self.config.peer_timeout:
                    break  # its creator is between add and set; look again next tick
                skipped.append(n)
            else:
                doc = self.store.read_incident(n)
                if doc is None:
                    log.warning("watchdog: incident %d has no readable description; skipping it", n)
                else:
                    self.handle(doc, local=False)
            self.seen_count = n
            self._waiting_docs.pop(n, None)
        if skipped:
            many = len(skipped) > 1
            what = f"incidents {rank_ranges(skipped)} were" if many else f"incident {skipped[0]} was"
            log.warning("watchdog: %s counted but never described; skipping %s", what, "them" if many else "it")

    def handle(self, doc: IncidentDoc, *, local: bool) -> None:
        """Dumps this rank's state for incident ``doc`` and publishes its statement."""
        cfg = self.config
        statement = self.statement()
        try:
            where = incident_path(cfg.incident_dir, doc.id)
        except (ValueError, OSError) as exc:
            log.error("watchdog: incident %d not handled: %s", doc.n, exc)
            return
        # Its own (from its statement) and the watched peers' as last read: no store call, since at
        # N ranks a fresh read on every rank at once is N * watch_peers requests; the merger reads all.
        heartbeats = (
            {} if local else {**self.liveness.heartbeats(), self.rank: Heartbeat.model_validate(dict(statement))}
        )
        case = Case(
            doc,
            where,
            local,
            statement,
            heartbeats,
            self.state.threads(),
            self.state.records(),
        )
        if self.story is not None:
            try:
                case.track, case.backend = self.story()
            except Exception:  # noqa: BLE001 - the pictures' material must never cost the dump
                log.exception("watchdog: incident %s: no track or flight-recorder entries for the pictures", doc.id)
        now = time.monotonic()
        self.ladder.start(case.ladder, now, lambda action, step: self._act(case, action, step))
        self.write_dump(case)
        log.error(
            "watchdog: incident %s (%s): %s; this rank's dump: %s",
            doc.id,
            doc.kind.value,
            doc.reason,
            case.dir / f"rank{self.rank}.json",
        )
        if local or self.store is None:
            case.merger, case.merge_deadline = True, now
        else:
            try:
                self.store.put_statement(doc.n, statement)
                self.store.add_dumped(doc.n)
                case.merger = self.store.claim_merger(doc.n, self.rank, self.world_size)
                case.merge_deadline = now + cfg.merge_wait
            except (StoreTimeout, StoreUnreachable) as exc:
                # Nobody can collect this rank's statement: it merges what it has itself.
                case.merger, case.merge_deadline = True, now
                if isinstance(exc, StoreUnreachable):
                    self.store_gone(exc)
        with self.cond:
            self.cases.append(case)
            self.cond.notify_all()

    def write_dump(self, case: Case) -> None:
        try:
            dump = case.to_dump(self.config.heartbeat_s, json.loads(self.config.model_dump_json()), self.ladder.names)
            write_json(case.dir / f"rank{self.rank}.json", dump)
        except OSError as exc:
            log.error("watchdog: could not write the dump of incident %s: %s", case.doc.id, exc)

    # ----------------------------------------------------------------- merging

    def progress(self) -> None:
        """Merges what is ready to merge and climbs the ladders."""
        for case in list(self.cases):
            if case.ladder.settled:
                continue
            try:
                if case.merger and not case.merged and not self.merge(case):
                    continue  # still waiting for statements; the ladder waits for the merge
                self._climb(case)
            except StoreUnreachable as exc:
                self.store_gone(exc)  # this incident goes on without the store next tick

    def _gather(self, case: Case, stale: dict[int, float]) -> tuple[dict[int, Statement], dict[int, Heartbeat]] | None:
        """The statements and heartbeats of ``case`` from the store; None while still waiting."""
        assert self.store is not None
        try:
            dumped = self.store.add_dumped(case.doc.n, 0)
        except StoreRefused:  # the counter holds something else: wait out merge_wait, merge what came
            dumped = 0
        if dumped < self.world_size - len(stale) and time.monotonic() < case.merge_deadline:
            return None
        ranks = list(range(self.world_size))
        return self.store.read_statements(case.doc.n, ranks), self.store.read_heartbeats(ranks)

    def merge(self, case: Case) -> bool:
        """Merges when every live rank has spoken or the wait is over; returns True once merged."""
        doc = case.doc
        stale = self.liveness.stale(time.monotonic())
        statements: dict[int, Statement] = {self.rank: case.statement}
        heartbeats: dict[int, Heartbeat] = self.liveness.heartbeats()
        extra: list[Finding] = []
        if doc.kind is IncidentKind.STORE_GONE:
            heartbeats = {}
            extra = [StoreFinding(text=doc.store_text or doc.reason)]
        elif case.local or self.store is None:
            gone = f"the store went away before the merge: only rank {self.rank}'s statement and the heartbeats"
            extra = [] if case.local else [StoreFinding(text=f"{gone} it had seen are in this report")]
        else:
            try:
                gathered = self._gather(case, stale)
            except StoreUnreachable as exc:
                self.store_gone(exc)
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
            self.world_size,
            merged_by=self.rank,
            waiting_after_s=self.config.heartbeat_s,
            extra_findings=extra,
            analyse_ranks=doc.kind is not IncidentKind.STORE_GONE,
        )
        write_report(case, incident, plot=self.config.incident_plot)
        add_outside_stacks(incident, lambda more: write_report(case, more, announce=False))
        case.merged = True
        if self.store is not None and not case.local:
            with contextlib.suppress(StoreTimeout, StoreUnreachable):
                culprits = sorted({c.rank for c in incident.culprits})
                note = MergedNote(host=HOSTNAME, dir=str(case.dir), summary=incident.summary, culprits=culprits)
                self.store.put_merged(doc.n, note)
        self._notify()
        return True

    # ----------------------------------------------------------------- the ladder

    def resolved(self, case: Case) -> bool:
        """True once the op of a hang or desync incident completed somewhere (never for lost ranks)."""
        passed = past_op(case.doc, self.state)
        if passed is None:
            return False
        if passed:
            if not case.local and self.store is not None:
                with contextlib.suppress(StoreTimeout, StoreUnreachable):
                    self.store.mark_resolved(case.doc.n)
            return True
        if case.local or self.store is None:
            return False
        try:
            return self.store.is_resolved(case.doc.n)
        except (StoreTimeout, StoreUnreachable):
            return False

    def _act(self, case: Case, action: Action, step: Step) -> Outcome:
        def save(outcome: Outcome) -> None:
            step.outcome = outcome
            self.write_dump(case)

        blocked = lambda: blocked_in(case.doc, self.state)  # noqa: E731
        ctx = ActionContext(self.config, self.rank, self.state.main_ident, self.raiser, blocked, save)
        ctx.merged, ctx.mark_fenced = lambda: merged_note(self.store, case), lambda: mark_fenced(self.store, case)
        return action(case.ref, ctx)

    def _climb(self, case: Case) -> None:
        state = case.ladder
        following = self.ladder.names[state.rung + 1] if state.rung + 1 < len(self.ladder.names) else ""
        result = self.ladder.climb(
            state, time.monotonic(), lambda: self.resolved(case), lambda a, s: self._act(case, a, s)
        )
        if result == "waiting":
            return
        if result == "resolved":
            log.warning("watchdog: incident %s cleared before %s", case.doc.id, following)
        if result in ("resolved", "stepped"):
            self.write_dump(case)
        self._notify()
