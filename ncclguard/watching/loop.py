"""What the watchdog's thread does at each tick: its loop, the heartbeat it publishes, the peers it
reads, the hangs and lost peers it detects and hands to the incident desk.

A mixin of :class:`~ncclguard.watching.watchdog.Watchdog`, which holds the state these methods use
(the per-world members that ``Watchdog._enter`` makes); the watchdog's life cycle and public API
are in :mod:`ncclguard.watching.watchdog`.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ncclguard._log import log
from ncclguard._naming import node_name
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.model import BackendEntry, Heartbeat, IncidentKind, Statement, TrackSpan
from ncclguard.recording.flight import recorder
from ncclguard.recording.phase import main_thread_phase
from ncclguard.watching.base.hang_bound import HangBound, phase_kind
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.desk.left_behind import LeftBehind, fence_if_left_behind
from ncclguard.watching.sensors import detect
from ncclguard.watching.sensors.backend_watch import BackendWatch
from ncclguard.watching.sensors.liveness import Liveness
from ncclguard.watching.sensors.rank_state import RankState, WorldArrivals
from ncclguard.watching.sensors.story import MainThreadTrack, backend_entries
from ncclguard.watching.sensors.straggler import from_config
from ncclguard.watching.views import Views
from ncclguard.watching.worlds import Announced, connect
from ncclguard.world import World

__all__ = ["Loop"]


class Loop:
    """The watchdog thread's loop and what it does at each tick (see the module doc)."""

    # Set by the Watchdog (its __init__, start() and _enter()).
    config: WatchdogConfig
    rank: int
    world_size: int
    generation: int
    _stop: threading.Event
    _desk: IncidentDesk | None
    _given_store: Any
    _announced: Announced
    _state: RankState
    _liveness: Liveness
    _backend: BackendWatch
    _track: MainThreadTrack
    _left: LeftBehind | None
    _beat: int
    _reported_ops: set[tuple[str, int]]
    _slow_store: bool
    _straggle: Any
    hang: HangBound
    _hang_s: float

    def _enter(self, world: World) -> None:
        raise NotImplementedError  # the Watchdog's

    @property
    def incidents(self) -> list[dict[str, Any]]:
        raise NotImplementedError  # the Watchdog's

    def peer_heartbeats(self) -> dict[int, Heartbeat]:
        """The last heartbeat of each watched peer (its host and address among them); empty before start."""
        liveness = getattr(self, "_liveness", None)
        return liveness.heartbeats() if liveness is not None else {}

    def _run(self) -> None:
        cfg = self.config
        assert self._desk is not None
        poll = min(cfg.heartbeat_s / 5, 0.5)
        connect(self._desk, self.config, self.world_size, self._given_store, self.generation)
        if self._desk.store is not None:
            self.hang.load(self._desk.store, self._origin())  # a restarted process goes on from its predecessor's
        next_beat = 0.0
        views = Views(cfg)  # the status index and the metrics, once per beat
        while not self._stop.is_set():
            world = self._announced.take()
            if world is not None:
                self._enter(world)
                next_beat = 0.0  # beat at once in the new world
            desk = self._desk
            try:
                now = time.monotonic()
                recorder.sweep()
                self._track.sample()
                if self._beat:  # a straggler window closes at the first tick past its end
                    self._straggle.tick()
                self._learn_hang(desk, now)
                if now >= next_beat:
                    next_beat = now + cfg.heartbeat_s
                    self._publish(desk)
                    self._watch(desk)
                    views.beat(self, desk)
                self._check_hang(desk)
                self._check_peers(desk)
                desk.poll()
                desk.progress()
                self._slow_store = False
            except StoreUnreachable as exc:
                desk.store_gone(exc)
            except StoreTimeout as exc:
                if not self._slow_store:  # one line per slow spell
                    log.warning("watchdog: the store is slow (%s); trying again every tick", exc)
                self._slow_store = True
            except Exception:  # noqa: BLE001 - the watchdog must outlive its own bugs
                log.exception("watchdog tick failed; going on")
            self._stop.wait(poll)
        if self._desk.store is not None:
            self._desk.store.close()  # its helper thread ends with the watchdog

    def _origin(self) -> int:
        """This process's launch rank (``RANK``): the key of what it learned, the same after a rebuild."""
        raw = os.environ.get("RANK", "")
        return int(raw) if raw.isdigit() else self.rank

    def _learn_hang(self, desk: IncidentDesk, now: float) -> None:
        """Feeds the hang bound this tick's numbers and phases, and sets the bound in force."""
        kinds = {phase_kind(main_thread_phase())} | {
            phase_kind(hb.phase) for hb in self._liveness.heartbeats().values()
        }
        seqs = self._state.backend_seq()
        if self.hang.tick(now, sum(seqs.values()) if seqs else None, kinds, len(desk.cases)) and desk.store is not None:
            self.hang.save(desk.store, self._origin())  # now, not at the next beat: a rank may die before it
        self._hang_s = self._backend.hang_timeout_s = self.hang.bound(kinds)

    def _story(self) -> tuple[list[TrackSpan], list[BackendEntry]]:
        return self._track.spans(), backend_entries()

    def _statement(self) -> Statement:
        st = self._state.statement(self._beat, self._liveness.views(time.monotonic()))
        return self._straggle.stamp(st) if self._beat else st  # with the straggler figures

    def _publish(self, desk: IncidentDesk) -> None:
        self._beat += 1
        if self._beat == 1:  # a new world (or start): straggler windows start afresh (docs/stragglers.md)
            self._straggle = from_config(self.rank, self.config, WorldArrivals())
        if desk.store is None:
            return
        if (straggler := self._straggle.check(self._liveness.heartbeats())) is not None:  # peers as read last beat
            desk.open(straggler)
        hb = self._straggle.on_beat(self._state.heartbeat(self._beat))
        now = time.monotonic()
        self._backend.own_seqs.update(hb.backend_seq, now)
        update: dict[str, Any] = {"hang_bound_s": round(self._hang_s, 3)}
        if hb.backend_seq is not None:
            update["backend_still"] = self._backend.own_seqs.still(now)
        hb = hb.model_copy(update=update)
        try:
            desk.store.publish_heartbeat(hb)
        except StoreTimeout:
            pass  # slow store: the next beat tries again
        self.hang.save(desk.store, self._origin())

    def _watch(self, desk: IncidentDesk) -> None:
        if desk.store is None or not self._liveness.watched:
            return
        try:
            beats = desk.store.read_heartbeats(self._liveness.watched)
        except StoreTimeout:
            return
        for r in self._liveness.observe(beats, now := time.monotonic()):
            log.warning("watchdog: rank %d is beating again", r)
        fence_if_left_behind(self._left, desk.store, self.rank, self.generation, now, bool(self._liveness.stale(now)))

    def _check_hang(self, desk: IncidentDesk) -> None:
        inflight = self._state.inflight()
        found = detect.find_hangs(self.rank, inflight, time.time(), self._hang_s, self._reported_ops)
        for hang in found:
            assert hang.op_key is not None
            self._reported_ops.add(hang.op_key)
        if desk.store is not None:  # the peers' backend numbers come through the store
            found += self._backend.confirm(self._backend.suspects(inflight))
        for hang in found:
            log.error("watchdog: hang: %s", hang.reason)
            desk.open(hang)

    def _check_peers(self, desk: IncidentDesk) -> None:
        if desk.store is None:
            return  # without a store no beat can arrive: silence says nothing about the peers
        hosts = {r: node_name(hb.host, hb.address) for r, hb in self._liveness.heartbeats().items()}
        lost = detect.find_lost(self._liveness.newly_stale(time.monotonic()), hosts)
        if lost is None:
            return
        log.error("watchdog: peer lost: %s", lost.reason)
        if any(not c.ladder.settled and c.doc.kind is IncidentKind.PEERS_LOST for c in desk.cases):
            return  # an open lost-incident's merge will list these ranks too
        desk.open(lost)
