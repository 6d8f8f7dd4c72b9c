"""What the watchdog watches in one world, and what it does with it at each tick and each beat.

A :class:`WorldWatch` holds what belongs to one world: this rank's place and state in it, its
watched peers' heartbeats, the backend's numbers, the sensors and the incident desk. The
:class:`~ncclguard.watching.watchdog.Watchdog` builds one at start and one for each world it follows
after a rebuild, and drives it from its thread; what outlives a world (the settings, the ladder, the
hang bound it learns, the cases of earlier worlds) stays with the watchdog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from ncclguard._log import log
from ncclguard._naming import node_name
from ncclguard.errors import StoreTimeout
from ncclguard.incidents.model import BackendEntry, Heartbeat, IncidentKind, Statement, TrackSpan
from ncclguard.recording.phase import main_thread_phase
from ncclguard.watching.base.hang_bound import HangBound, phase_kind
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.desk.left_behind import LeftBehind, fence_if_left_behind
from ncclguard.watching.desk.told import Told
from ncclguard.watching.ladder.actions import Ladder, MainThreadRaiser
from ncclguard.watching.sensors import detect
from ncclguard.watching.sensors.backend_watch import BackendWatch
from ncclguard.watching.sensors.liveness import Liveness
from ncclguard.watching.sensors.rank_state import RankState, WorldArrivals
from ncclguard.watching.sensors.registry import build_sensors
from ncclguard.watching.sensors.sensor import Sensor, SensorSite
from ncclguard.watching.sensors.story import MainThreadTrack, backend_entries
from ncclguard.watching.worlds import rank_and_size, take_over
from ncclguard.world import World

__all__ = ["WorldWatch"]

T = TypeVar("T")
FAILURES_LOGGED = 100  # a failing sensor logs its first failure, then one line per this many


class WorldWatch:
    """The watch of one world (see the module doc); touched by the watchdog's thread only, but for
    the reads of :meth:`peer_heartbeats` and :meth:`peer_beats`.

    Args:
        config: the watchdog's settings.
        world: the world watched.
        ladder: the watchdog's action ladder (the desk climbs it).
        raiser: carries the ``raise`` rung into the main thread (None without one).
        cond: notified whenever an incident changes.
        track: where the main thread was lately (kept across worlds: the pictures span a rebuild).
        hang_s: the hang bound in force when the world starts.
        before: the watch of the world before (its store connection is taken over), or None.
    """

    def __init__(
        self,
        config: WatchdogConfig,
        world: World,
        ladder: Ladder,
        raiser: MainThreadRaiser | None,
        cond: threading.Condition,
        track: MainThreadTrack,
        hang_s: float,
        before: WorldWatch | None = None,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank_and_size(world)
        self.generation = world.generation
        self.state = RankState(self.rank, self.world_size)
        self.liveness = Liveness(
            self.rank, self.world_size, config.watch_peers, config.peer_timeout, config.startup_grace_s
        )
        self.beats = 0  # heartbeats published in this world
        self._ending_counted = False  # this rank is counted among those that know the job is ending
        self.reported_ops: set[tuple[str, int]] = set()  # (group, seq) in ncclguard's numbering
        self.backend = BackendWatch(self.rank, self.state, self.liveness, hang_s, config.heartbeat_s)
        # Built at the first beat, on the watchdog's thread: a sensor's own threads end with it.
        self.sensors: list[Sensor] = []
        self._failures: dict[str, int] = {}  # by sensor name: failures in this world
        self.track = track
        # What this watch found and the store has not taken yet (it timed out): raised again at the
        # next tick, never dropped (a hang found while the store is slow is still a hang).
        self.found = Told()
        self.reads_failing = False  # the last read of the peers' heartbeats timed out
        self.desk = IncidentDesk(config, self.state, self.liveness, ladder, raiser, self.statement, cond, self.story)
        take_over(self.desk, before.desk if before is not None else None, world, config.session)

    # ----------------------------------------------------------------- each tick

    def tick_sensors(self) -> None:
        """Lets each sensor measure (from the first beat on: a straggler window closes at the first
        tick past its end)."""
        for sensor in self.sensors:
            self._guarded(sensor, sensor.tick)

    def learn_hang(self, hang: HangBound, origin: int, now: float) -> float:
        """Feeds ``hang`` this tick's numbers and phases; returns the bound in force (the backend
        watch holds it too).

        Args:
            hang: the watchdog's hang bound (it outlives the world).
            origin: this process's launch rank (the key of what it learned).
            now: ``time.monotonic()``.
        """
        kinds = {phase_kind(main_thread_phase())} | {phase_kind(hb.phase) for hb in self.liveness.heartbeats().values()}
        seqs = self.state.backend_seq()
        desk = self.desk
        if hang.tick(now, sum(seqs.values()) if seqs else None, kinds, len(desk.cases)) and desk.store is not None:
            hang.save(desk.store, origin)  # now, not at the next beat: a rank may die before it
        bound = self.backend.hang_timeout_s = hang.bound(kinds)
        return bound

    def check_hang(self, hang_s: float) -> None:
        """Finds each op of this rank in flight past ``hang_s``, and each backend op the peers'
        numbers (as last read) confirm stuck or out of step; :meth:`raise_found` raises them. No
        store call: a slow store holds up no detection."""
        inflight = self.state.inflight()
        found = detect.find_hangs(self.rank, inflight, time.time(), hang_s, self.reported_ops)
        for hang in found:
            assert hang.op_key is not None
            self.reported_ops.add(hang.op_key)
        if self.desk.store is not None:  # the peers' backend numbers come through the store
            found += self.backend.confirm(self.backend.suspects(inflight))
        for hang in found:
            log.error("watchdog: hang: %s", hang.reason)
            self.found.put(hang)

    def check_peers(self) -> None:
        """Finds the watched peers whose heartbeat stood still past ``peer_timeout_s`` (as last
        read); :meth:`raise_found` raises them."""
        desk = self.desk
        if desk.store is None or self.reads_failing:
            return  # no beat can arrive through a store that does not answer: silence says nothing
        hosts = {r: node_name(hb.host, hb.address) for r, hb in self.liveness.heartbeats().items()}
        lost = detect.find_lost(self.liveness.newly_stale(time.monotonic()), hosts)
        if lost is None:
            return
        log.error("watchdog: peer lost: %s", lost.reason)
        if any(not c.ladder.settled and c.doc.kind is IncidentKind.PEERS_LOST for c in desk.cases):
            return  # an open lost-incident's merge will list these ranks too
        self.found.put(lost)

    def tend(self, told: Told, now: float) -> None:
        """The desk's part of a tick: raises what was found (:meth:`raise_found`) and what another
        thread told, reads the incidents raised (when due), merges and climbs, and asks a store that
        stopped answering again.

        Args:
            told: what the training thread told the watchdog to raise.
            now: ``time.monotonic()``.

        Raises:
            StoreTimeout, StoreUnreachable: the store did not answer; what was not raised waits.
        """
        desk = self.desk
        self.raise_found()
        told.open_in(desk)
        if desk.poll_due(now):
            desk.poll()
        desk.progress()
        desk.store_back()

    def raise_found(self) -> None:
        """Raises what this watch found and the store did not take yet, oldest first.

        Raises:
            StoreTimeout, StoreUnreachable: the store did not answer; what was not raised waits.
        """
        self.found.open_in(self.desk)

    # ----------------------------------------------------------------- each beat

    def publish(self, hang: HangBound, hang_s: float, origin: int) -> None:
        """Publishes this rank's heartbeat, with each sensor's figures, after letting each sensor
        check the peers' last beats.

        Args:
            hang: the watchdog's hang bound (saved with the beat).
            hang_s: the bound in force (in the beat, for ``status``).
            origin: this process's launch rank.
        """
        desk = self.desk
        self.beats += 1
        if self.beats == 1:  # a new world (or start): sensors start afresh (docs/stragglers.md)
            self.sensors = build_sensors(SensorSite(self.rank, self.world_size, self.config, WorldArrivals()))
        if desk.store is None:
            return
        peers = self.liveness.heartbeats()  # as read last beat
        for sensor in self.sensors:
            found = self._guarded(sensor, partial(sensor.check, peers))
            if found is not None:
                self.found.put(found)  # raised by raise_found
        hb = self.state.heartbeat(self.beats)
        for sensor in self.sensors:
            self._guarded(sensor, sensor.tick)
            hb = self._guarded(sensor, partial(sensor.stamp, hb), hb)
        now = time.monotonic()
        self.backend.own_seqs.update(hb.backend_seq, now)
        update: dict[str, object] = {"hang_bound_s": round(hang_s, 3)}
        if hb.backend_seq is not None:
            update["backend_still"] = self.backend.own_seqs.still(now)
        hb = hb.model_copy(update=update)
        try:
            desk.store.publish_heartbeat(hb)
        except StoreTimeout:
            pass  # slow store: the next beat tries again
        hang.save(desk.store, origin)

    def read_peers(self, left: LeftBehind | None) -> None:
        """Reads the watched peers' heartbeats, and fences this rank when it was left behind."""
        desk = self.desk
        if desk.store is None or not self.liveness.watched:
            return
        try:
            beats = desk.store.read_heartbeats(self.liveness.watched)
        except StoreTimeout:
            self.reads_failing = True
            return
        self.reads_failing = False
        for r in self.liveness.observe(beats, now := time.monotonic()):
            log.warning("watchdog: rank %d is beating again", r)
        fence_if_left_behind(left, desk.store, self.rank, self.generation, now, bool(self.liveness.stale(now)))
        if not desk.store_closing and desk.store.has_mark(desk.store.keys.closing):
            desk.store_closing = True
            log.info("watchdog: the store's host finished; the store goes when it ends, and that is no incident")
        if desk.store_closing:
            self.know_ending()  # again next beat if the store did not take it

    # ----------------------------------------------------------------- the job's end

    def leave(self) -> None:
        """Says this rank's watchdog stopped on purpose: a last heartbeat that says so (its watchers
        take its silence for the end, not a loss), and one more rank counted as knowing it.

        Raises:
            StoreTimeout, StoreUnreachable: the store did not take it.
        """
        store = self.desk.store
        if store is None:
            return
        store.publish_heartbeat(self.state.heartbeat(self.beats + 1).model_copy(update={"finished": True}))
        self.know_ending()

    def ending_count(self) -> int:
        """How many ranks know the job is ending (0 without a store).

        Raises:
            StoreTimeout, StoreUnreachable: the store did not answer.
        """
        store = self.desk.store
        return store.count_ending(0) if store is not None else 0

    def know_ending(self) -> None:
        """Counts this rank, once per world, among those that know the job is ending.

        Raises:
            StoreTimeout, StoreUnreachable: the store did not take it (the next call tries again).
        """
        if not self._ending_counted and self.desk.store is not None:
            self.desk.store.count_ending()
            self._ending_counted = True  # once per rank and world, whichever of the two came first

    # ----------------------------------------------------------------- what the desk asks

    def statement(self) -> Statement:
        """This rank's statement now, with each sensor's figures."""
        st = self.state.statement(self.beats, self.liveness.views(time.monotonic()))
        for sensor in self.sensors:
            st = self._guarded(sensor, partial(sensor.stamp, st), st)
        return st

    def story(self) -> tuple[list[TrackSpan], list[BackendEntry]]:
        """Where the main thread was lately, and torch's flight-recorder entries (the pictures)."""
        return self.track.spans(), backend_entries()

    # ----------------------------------------------------------------- read from other threads

    def peer_heartbeats(self) -> dict[int, Heartbeat]:
        """The last heartbeat of each watched peer."""
        return self.liveness.heartbeats()

    def peer_beats(self) -> dict[int, tuple[Heartbeat, float]]:
        """The watched peers' last heartbeats and their ages in seconds."""
        now = time.monotonic()
        peers = list(self.liveness.peers.items())
        return {r: (p.heartbeat, now - p.changed) for r, p in peers if p.heartbeat is not None}

    def sensor(self, name: str) -> Sensor | None:
        """This world's sensor ``name``, or None (before the first beat, or none registered by it)."""
        return next((s for s in list(self.sensors) if s.name == name), None)

    def _guarded(self, sensor: Sensor, call: Callable[[], T], fallback: T | None = None) -> T:
        """``call()``; a sensor's failure returns ``fallback``: a sensor never stops a heartbeat. Its
        first failure is logged with the traceback, then one line every :data:`FAILURES_LOGGED`."""
        try:
            return call()
        except Exception:  # noqa: BLE001 - a user's sensor may fail: the heartbeat goes on without its figures
            name = str(getattr(sensor, "name", sensor))
            count = self._failures[name] = self._failures.get(name, 0) + 1
            if count == 1:
                log.exception("watchdog: the sensor %r failed; going on without its figures this time", name)
            elif count % FAILURES_LOGGED == 0:
                log.warning("watchdog: the sensor %r has failed %d times in this world", name, count)
            return fallback  # type: ignore[return-value]
