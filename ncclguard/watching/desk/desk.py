"""Incidents across ranks: claim, statements, merge, and the ladder of each one.

An incident is a numbered entry in the store. The first rank that detects something claims its
signature and numbers it; every rank's watchdog that sees the number handles it: dumps the stacks
of all its Python threads, its flight records and the heartbeats to
``<incident_dir>/<id>/rank<r>.json`` and publishes a statement; the first rank done merges the
statements into ``incident.json`` and ``summary.txt`` (:mod:`ncclguard.incidents.analysis`),
waiting at most ``merge_wait`` for the others. Then every rank climbs the action ladder
(:mod:`ncclguard.watching.ladder.actions`). Without a store (a world of one, or the store gone) a rank
handles its incidents alone ("local" incidents, numbered below zero). Nothing is written
outside ``incident_dir`` (:func:`incident_path`).

This module raises and handles incidents and climbs their ladders; :mod:`~ncclguard.watching.desk.cases`
holds a case and its files, :mod:`~ncclguard.watching.desk.merging` the merge.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.files import write_json
from ncclguard.incidents.model import (
    BackendEntry,
    Heartbeat,
    IncidentDoc,
    IncidentKind,
    Statement,
    TrackSpan,
)
from ncclguard.recording.rungs import ActedRung, acted
from ncclguard.store.clients import Connecting
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import StoreRefused, WatchdogStore
from ncclguard.watching.desk.cases import (
    MAX_NEW_INCIDENTS,
    Case,
    CounterReads,
    blocked_in,
    describe,
    gen_tag,
    incident_path,
    mark_fenced,
    merged_note,
    op_resolved,
    past_op,
    stale_from_statements,
    write_report,
)
from ncclguard.watching.desk.merging import Merger
from ncclguard.watching.ladder.actions import (
    Action,
    ActionContext,
    Ladder,
    MainThreadRaiser,
    Outcome,
    Step,
)
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.liveness import Liveness, store_host_text
from ncclguard.watching.sensors.rank_state import RankState

__all__ = ["Case", "IncidentDesk", "blocked_in", "describe", "incident_path", "past_op", "stale_from_statements"]
__all__ += ["STORE_ASK_EVERY_S", "LostStore", "mark_fenced", "merged_note", "write_report"]

STORE_ASK_EVERY_S = 1.0  # how often a store that stopped answering is asked again


class LostStore:
    """A store that stopped answering, and when: asked again every :data:`STORE_ASK_EVERY_S`.

    Args:
        store: the store.
        since: ``time.monotonic()`` when it stopped answering.
    """

    def __init__(self, store: WatchdogStore, since: float) -> None:
        self.store, self.since, self._asked_at = store, since, 0.0

    def answers(self) -> bool:
        """One bounded call, at most every :data:`STORE_ASK_EVERY_S` (while the call it was stuck in
        has not returned, a question costs nothing); says it once it answers. Never raises."""
        now = time.monotonic()
        if now - self._asked_at < STORE_ASK_EVERY_S:
            return False
        self._asked_at = now
        try:
            self.store.job_incident_count()  # the job's store itself, not a node's copy
        except (StoreTimeout, StoreUnreachable, StoreRefused):
            return False
        log.warning(
            "watchdog: the store answers again after %.1f s; incidents are shared through it again", now - self.since
        )
        return True


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
        story: what this rank did lately, for the pictures (:mod:`ncclguard.watching.sensors.story`): the
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
        self.connecting: Connecting | None = None  # the store's client being made (watching/worlds.py)
        self.store_lost = False
        self.lost_store: LostStore | None = None  # the store that stopped answering, asked again
        self.store_closing = False  # the store's host said the store goes when it ends (the job's end)
        # A node's first rank logs every merged report, and copies the report where the directory is
        # not shared (Merger.follow): people read node 0's log, and any host's incident directory.
        self.node_leader = os.environ.get("LOCAL_RANK") == "0"
        self.cases: list[Case] = []
        self.seen_count = 0
        # The world this desk raises incidents in: its generation and the rebuild that made it.
        self.world: dict[str, Any] = {"generation": 0}
        self._waiting_docs: dict[int, float] = {}
        self._local_count = 0
        # A raise the store timed out on is tried again at the next tick (world_watch.found), with the
        # claim's token and the number it already took: a retry must not lose its own claim.
        self._raising: dict[str, tuple[str, int | None]] = {}
        self.counter_reads = CounterReads(min(config.heartbeat_s / 2, config.merge_wait / 4))
        self.merger = Merger(self)

    def close(self) -> None:
        """Ends this desk's store calls: its client's helper thread, and the tries of a connect under way."""
        if self.connecting is not None:
            self.connecting.close()
        if self.store is not None:
            self.store.close()

    def notify(self) -> None:
        """Wakes whoever waits for an incident to change (``Watchdog.wait_for_incident``)."""
        with self.cond:
            self.cond.notify_all()

    # ----------------------------------------------------------------- raising

    def open(self, det: Detection) -> None:
        """Raises ``det`` in the store (once per signature across ranks), or locally without one.

        Raises:
            StoreTimeout, StoreUnreachable: the store did not answer.
        """
        if self.store is None:
            self._raising.pop(det.signature, None)  # a claim left in a store that went is not taken up again
            self.open_local(det)
            return
        token, n = self._raising.setdefault(det.signature, (f"{self.rank}:{uuid.uuid4().hex[:8]}", None))
        if n is None:
            if not self.store.claim(det.signature, token):
                self._raising.pop(det.signature, None)
                self.counter_reads.now()  # another rank raised it: read it at this tick
                return
            try:
                n = self.store.number_incident()
            except StoreRefused as exc:  # the counter holds something else: no number in the store
                self._raising.pop(det.signature, None)
                log.error("watchdog: incident counter unusable (%s); handling %s on this rank only", exc, det.signature)
                self.open_local(det)
                return
            self._raising[det.signature] = (token, n)
        created = time.time()
        ident = f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(created))}-{gen_tag(self.world)}{n:03d}"
        doc = describe(det, self.rank, n, ident, created).model_copy(update=self.world)
        self.store.put_incident(doc)
        self._raising.pop(det.signature, None)
        self.counter_reads.now()  # handled, as on every rank, once read back: at this tick

    def open_local(self, det: Detection) -> None:
        """Handles ``det`` on this rank alone."""
        self._local_count += 1
        created = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(created))
        ident = f"{stamp}-{gen_tag(self.world)}r{self.rank}-{det.kind.value}-{self._local_count}"
        doc = describe(det, self.rank, -self._local_count, ident, created, "local").model_copy(update=self.world)
        self.handle(doc, local=True)

    def store_gone(self, exc: BaseException) -> None:
        """The store stopped answering: drop it and raise a local ``store`` incident (once), unless
        its host had said it was ending (:attr:`store_closing`): then the job is ending, and that is
        no incident.

        The store is kept aside and asked again (:meth:`store_back`): a store's host that stalled
        for seconds under load (seen in CI: the torchrun agent's store silent for 3 s, every rank at
        once) is the job's store again once it answers, and a rank the others then went on without
        can still be told so."""
        if self.store_lost:
            return
        self.store_lost = True
        self.lost_store = LostStore(self.store, time.monotonic()) if self.store is not None else None
        self.store = None
        if self.store_closing:
            log.info(
                "watchdog: the store is gone with its host, which had said it was ending (the job's end, not an "
                "incident); watching on without it"
            )
            return
        addr = (
            self.store_addr
            or self.config.store_addr
            or f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        )
        text = (
            f"the rendezvous store at {addr} stopped answering ({exc}); {store_host_text(addr, self.liveness)}: it "
            "lives in rank 0's process under a plain launcher and in the agent under torchrun, so that process or "
            "its host is gone (or the link to it is cut)"
        )
        log.error("watchdog: %s; handling incidents on this rank only until it answers again", text)
        self.open_local(Detection(IncidentKind.STORE_GONE, "the rendezvous store is gone", "local", store_text=text))

    def store_back(self) -> bool:
        """Takes the store that stopped answering back once it answers (:class:`LostStore`); True then."""
        lost = self.lost_store
        if not self.store_lost or lost is None or self.store_closing or not lost.answers():
            return False
        self.store, self.lost_store, self.store_lost = lost.store, None, False
        return True

    # ----------------------------------------------------------------- handling

    def poll_due(self, now: float) -> bool:
        """Whether the watchdog reads the incident counter (:meth:`poll`) at this tick (:class:`CounterReads`)."""
        busy = not all(c.ladder.settled for c in self.cases) or bool(self._waiting_docs)
        return self.counter_reads.due(now, busy)

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
                merges = self.store.file_statement(doc.n, statement)
                if doc.kind is IncidentKind.NUMERICS:  # a past event: the engine acted at its commit (status)
                    self.store.set_mark(self.store.keys.resolved(doc.n))
                case.merger, case.filing = bool(merges), merges is None
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
            try:
                if case.filing and file_later(self.store, case, self.config.merge_wait):
                    continue  # whether this rank merges is not known yet: its ladder waits, as a merger's does
                if not case.merger and not case.followed and self.node_leader:
                    case.followed = self.merger.follow(case)  # whatever the ladder does meanwhile
                if case.ladder.settled:
                    continue
                if case.merger and not case.merged and not self.merger.merge(case):
                    continue  # still waiting for statements; the ladder waits for the merge
                self._climb(case)
            except StoreUnreachable as exc:
                self.store_gone(exc)  # this incident goes on without the store next tick

    # ----------------------------------------------------------------- the ladder

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
            state,
            time.monotonic(),
            lambda: op_resolved(case, self.state, self.store),
            lambda a, s: self._act(case, a, s),
        )
        if result == "waiting":
            return
        if result == "resolved":
            log.warning("watchdog: incident %s cleared before %s", case.doc.id, following)
        if result == "stepped" and state.steps and state.steps[-1].outcome.done:
            acted.note(ActedRung(case.doc.id, case.doc.kind.value, state.steps[-1].rung, case.doc.created))
        if result in ("resolved", "stepped"):
            self.write_dump(case)
        self.notify()


def file_later(store: WatchdogStore | None, case: Case, merge_wait: float) -> bool:
    """Goes on with ``case``'s statement waiting in the node's store to be carried (the node tier:
    ``WatchdogStore.file_later``); with the job's store gone meanwhile, this rank merges what it has,
    as :meth:`IncidentDesk.handle` does. Returns whether it still waits."""
    if store is None:
        case.filing, case.merger, case.merge_deadline = False, True, time.monotonic()
        return False
    try:
        merges = store.file_later(case.doc.n)
    except StoreTimeout:
        return True  # the next tick tries again
    if merges is not None:
        case.filing = False
        if merges:
            case.merger, case.merge_deadline = True, time.monotonic() + merge_wait
    return case.filing
