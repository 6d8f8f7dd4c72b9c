"""The Watchdog: a background thread per process that notices hangs and says who caused them.

Every ``heartbeat_s`` it publishes this rank's state to the rendezvous store (its own client
connection, so the training thread never waits on the store for it): last sequence number per
group, the ops in flight, the main thread's phase and call site, host, pid, time. It raises an
incident when

- an op of this rank has been in flight longer than ``hang_timeout_s`` (kind ``hang``), or
- by the backend's sequence numbers, whoever issued the op (Python or C++), confirmed by torch's
  flight recorder: this rank stands ahead of a still peer (kind ``desync``), or everyone stands
  still at one number with the op open past ``hang_timeout_s`` (kind ``stuck``), or
- a watched peer's heartbeat has not changed for ``peer_timeout_s`` (kind ``lost``), or
- the store itself stops answering (kind ``store``; handled on this rank alone).

Every rank dumps its state for the incident, one merges the statements into a report naming the
culprits apart from the victims, then every rank climbs the action ladder (report, raise, abort,
exit, or your own :class:`~ncclguard.watching.actions.Action` rungs), giving each rung
``escalate_after_s`` to clear the hang. No store call waits longer than ``store_timeout_s``;
nothing waits on a dead peer.

This module holds the thread and its loop; the parts it drives, each with one job:
:mod:`~ncclguard.watching.protocol` (the store protocol), :mod:`~ncclguard.watching.liveness`
(peer heartbeats), :mod:`~ncclguard.watching.detect` (detectors), :mod:`~ncclguard.watching.desk`
(claim, statements, merge), :mod:`~ncclguard.watching.actions` (the ladder),
:mod:`~ncclguard.watching.snapshot` (this rank's state), :mod:`~ncclguard.watching.settings`
(:class:`WatchdogConfig`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from types import FrameType
from typing import Any

from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.incidents.model import BackendEntry, BackendOp, IncidentKind, OpRecord, Statement, TrackSpan
from ncclguard.recording.flight import recorder
from ncclguard.watching import detect
from ncclguard.watching.actions import Action, Ladder, MainThreadRaiser, build_ladder
from ncclguard.watching.desk import IncidentDesk
from ncclguard.watching.left_behind import LeftBehind, fence_if_left_behind
from ncclguard.watching.liveness import Liveness, SeqClock
from ncclguard.watching.protocol import Keys, WatchdogStore, store_addr
from ncclguard.watching.settings import ACTIONS, EXIT_CODE, WatchdogConfig
from ncclguard.watching.snapshot import RECENT, RankState, WorldArrivals, backend_ops
from ncclguard.watching.story import MainThreadTrack, backend_entries
from ncclguard.watching.straggler import from_config
from ncclguard.watching.views import Views
from ncclguard.world import World, WorldChange, current_world, subscribe

__all__ = ["ACTIONS", "EXIT_CODE", "Watchdog", "WatchdogConfig", "current_watchdog", "start_watchdog"]


class _Running:
    """The watchdog running in this process (one per process: its signal handler and its thread
    are the process's), whatever the world; it follows world changes itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watchdog: Watchdog | None = None


_running = _Running()


class _Announced:
    """The newest world announced and not yet followed: the subscriber (the announcing thread) puts
    it, the watchdog's thread takes it at its next tick (it alone touches the per-world members)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: World | None = None

    def put(self, change: WorldChange) -> None:
        with self._lock:
            self._world = change.new

    def take(self) -> World | None:
        if self._world is None:  # the common case, every tick: no lock
            return None
        with self._lock:
            world, self._world = self._world, None
        return world


def current_watchdog() -> Watchdog | None:
    """The watchdog running in this process, or None."""
    return _running.watchdog


class Watchdog:
    """One background thread per process that detects hangs, dumps and names the culprits.

    Use ``Watchdog(...).start()`` (or ``with Watchdog(...):``, or :func:`start_watchdog`) on every
    rank right after ``init_process_group``.

    Args:
        config: the settings; default from the environment (``NCCLGUARD_WATCHDOG_*``).
        store: a c10d Store to use instead of a fresh TCPStore client (it is then used from the
            watchdog's threads only; every call is bounded by ``store_timeout_s``).
        actions: a ladder of your own instead of ``config.action``'s: built-in names
            (``"report"``, ``"raise"``, ``"abort"``, ``"fence"``, ``"exit"``) and
            :class:`~ncclguard.watching.actions.Action` instances, in order (``report`` first).
        **overrides: fields of :class:`WatchdogConfig` applied on top of ``config``.

    Raises:
        pydantic.ValidationError: an unknown field or a value that breaks an invariant.
        TypeError: ``config`` is not a WatchdogConfig, or an entry of ``actions`` is not an action.
    """

    def __init__(
        self,
        config: WatchdogConfig | None = None,
        *,
        store: Any = None,  # a c10d Store, or a proxy or test double with its methods (see WatchdogStore)
        actions: Sequence[Action | str] | None = None,
        **overrides: Any,
    ) -> None:
        if config is not None and not isinstance(config, WatchdogConfig):
            raise TypeError(
                f"config must be a WatchdogConfig, got {type(config).__name__}; pass fields as keywords instead"
            )
        if config is None:
            config = WatchdogConfig(**overrides)
        elif overrides:
            config = WatchdogConfig(**{**config.model_dump(exclude_unset=True), **overrides})
        self.config = config
        self.ladder = Ladder(build_ladder(config.action, actions, config.fence_after), config.escalate_after_s)
        self._left = LeftBehind(config.fence_after) if "fence" in self.ladder.names else None  # left_behind.py
        self._given_store = store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._signum = getattr(signal, config.raise_signal)
        self._raiser: MainThreadRaiser | None = None
        self._handler_installed = False
        self._instrumented = False
        self._desk: IncidentDesk | None = None
        self._retired: list[Any] = []  # cases of earlier worlds' desks, oldest first
        self._announced = _Announced()
        self._unsubscribe: Any = None
        self._track = MainThreadTrack(threading.main_thread().ident)  # where the main thread was (the pictures)

    # ----------------------------------------------------------------- life cycle

    def start(self) -> Watchdog:
        """Starts the thread (returns at once; the store connection is made by the thread).

        Raises:
            RuntimeError: another watchdog runs here, or the ``raise`` rung needs the main thread.
        """
        cfg = self.config
        needs_handler = self.ladder.needs_main_thread
        if needs_handler and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"the ladder {'/'.join(self.ladder.names)} raises into the main thread through {cfg.raise_signal}, whose handler "
                "only the main thread can install: start the watchdog from the main thread, or use action='report'"
            )
        with _running.lock:
            if _running.watchdog is not None:
                raise RuntimeError("a Watchdog already runs in this process; stop() it first (one per process)")
            _running.watchdog = self
        self._raiser = MainThreadRaiser(self._signum, lambda key: self._state.completed(key)) if needs_handler else None
        self._desk, self._retired, self._announced = None, [], _Announced()  # a restarted watchdog starts afresh
        self._track = MainThreadTrack(threading.main_thread().ident)
        self._unsubscribe = subscribe(self._announced.put)  # first: a world announced meanwhile is followed
        self._enter(current_world())
        if cfg.instrument:
            from ncclguard.recording.instrument import instrument, is_instrumented

            if not is_instrumented():
                instrument()
                self._instrumented = True
        if self._raiser is not None:
            self._raiser.install(self._on_signal)
            self._handler_installed = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ncclguard-watchdog", daemon=True)
        self._thread.start()
        log.info(
            "watchdog started: heartbeat %.3g s, hang after %.3g s, peers lost after %.3g s, ladder %s, incidents in %s",
            cfg.heartbeat_s,
            cfg.hang_timeout_s,
            cfg.peer_timeout,
            "/".join(self.ladder.names),
            cfg.incident_dir,
        )
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stops the thread (waits at most ``timeout``, default two store timeouts plus a beat)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stop.set()
        if self._thread is not None:
            cfg = self.config
            self._thread.join(timeout if timeout is not None else 2 * cfg.store_timeout + cfg.heartbeat_s)
            self._thread = None
        in_main = threading.current_thread() is threading.main_thread()  # only it may touch signal handlers
        if self._handler_installed and self._raiser is not None and in_main:
            self._raiser.uninstall()
            self._handler_installed = False
        if self._instrumented:
            from ncclguard.recording.instrument import uninstrument

            uninstrument()
            self._instrumented = False
        with _running.lock:
            if _running.watchdog is self:
                _running.watchdog = None

    def _enter(self, world: World) -> None:
        """Watches ``world`` from now on: its members under their numbers in it, heartbeats and
        incidents under its generation's keys. The cases of the world before are kept (they are
        this rank's history), their ladders as they were."""
        cfg = self.config
        self.rank, self.world_size = rank_and_size(world)
        self.generation = world.generation
        self._state = RankState(self.rank, self.world_size)
        self._liveness = Liveness(self.rank, self.world_size, cfg.watch_peers, cfg.peer_timeout, cfg.startup_grace_s)
        self._beat = 0
        self._reported_ops: set[tuple[str, int]] = set()  # (group, seq) in ncclguard's numbering
        self._backend = BackendWatch(self.rank, self._state, self._liveness, cfg.hang_timeout_s, cfg.heartbeat_s)
        self._slow_store = False
        old = self._desk
        desk = IncidentDesk(
            cfg, self._state, self._liveness, self.ladder, self._raiser, self._statement, self._cond, self._story
        )
        take_over(desk, old, world, cfg.session)
        if old is not None:
            with self._cond:
                self._retired.extend(old.cases)
            log.warning(
                "watchdog: following world generation %d: rank %d of %d", world.generation, self.rank, self.world_size
            )
        self._desk = desk

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The ``raise_signal`` handler (main thread): raises the armed CollectiveTimeout."""
        if self._raiser is not None:
            self._raiser.on_signal(signum, frame)

    @property
    def incidents(self) -> list[dict[str, Any]]:
        """The incidents this rank handled, oldest first: ``id``, ``kind``, ``dir``, ``merger`` (this rank
        merged it), ``actions`` (the rungs taken), ``settled`` (the ladder is over), ``doc``."""
        with self._cond:
            return [c.record() for c in self._all_cases()]

    def wait_for_incident(
        self,
        timeout: float,
        count: int = 1,
        merged: bool = False,
        settled: bool = False,
    ) -> list[dict[str, Any]]:
        """Waits until this rank has handled ``count`` incidents, at most ``timeout`` seconds.

        Args:
            timeout: seconds to wait at most.
            count: incidents to wait for.
            merged: also wait until the ``count``-th one's ``incident.json`` exists (on this host).
            settled: also wait until this rank's ladder for it is over (top rung taken, or cleared).

        Returns:
            :attr:`incidents`, as they are when the wait ends.
        """
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            cases = self._all_cases()
            if len(cases) < count:
                return False
            last = cases[count - 1]
            if settled and not last.ladder.settled:
                return False
            return not merged or (last.dir / INCIDENT_FILE).is_file()

        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
        return self.incidents

    def _all_cases(self) -> list[Any]:
        return self._retired + (self._desk.cases if self._desk is not None else [])

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        cfg = self.config
        assert self._desk is not None
        poll = min(cfg.heartbeat_s / 5, 0.5)
        connect(self._desk, self.config, self.world_size, self._given_store, self.generation)
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
        if hb.backend_seq is not None:
            hb = hb.model_copy(update={"backend_still": self._backend.own_seqs.still(now)})
        try:
            desk.store.publish_heartbeat(hb)
        except StoreTimeout:
            pass  # slow store: the next beat tries again

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
        found = detect.find_hangs(self.rank, inflight, time.time(), self.config.hang_timeout_s, self._reported_ops)
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
        lost = detect.find_lost(self._liveness.newly_stale(time.monotonic()))
        if lost is None:
            return
        log.error("watchdog: peer lost: %s", lost.reason)
        if any(not c.ladder.settled and c.doc.kind is IncidentKind.PEERS_LOST for c in desk.cases):
            return  # an open lost-incident's merge will list these ranks too
        desk.open(lost)


class BackendWatch:
    """The backend's numbers as this rank's watchdog follows them: its own (when each last moved),
    the suspects they raise, and torch's flight recorder read to confirm each suspect once.

    Args:
        rank: this rank.
        state: this rank's state.
        liveness: the watched peers (their numbers come with their heartbeats).
        hang_timeout_s: how long the numbers must stand still.
        heartbeat_s: how old a peer's number may be when read.
    """

    def __init__(
        self, rank: int, state: RankState, liveness: Liveness, hang_timeout_s: float, heartbeat_s: float
    ) -> None:
        self.rank, self.state, self.liveness = rank, state, liveness
        self.hang_timeout_s, self.heartbeat_s = hang_timeout_s, heartbeat_s
        self.own_seqs = SeqClock()
        self.reported: set[tuple[str, int]] = set()  # (group, seq) in the backend's numbering
        self.looked: set[tuple[str, int]] = set()  # read in torch's recorder and found closed

    def suspects(self, inflight: Sequence[OpRecord]) -> list[detect.Detection]:
        """Groups that the backend's numbers make suspect: a desync (this rank ahead of a still
        peer) or a stuck op (everyone still at one number)."""
        now = time.monotonic()
        self.own_seqs.update(self.state.backend_seq(), now)  # every tick: ~0.5 us a group
        own, peers = self.own_seqs.views(now), self.liveness.seq_views(now)
        self.looked = {(g, s) for g, s in self.looked if g in own and own[g].seq == s}  # moved: look again
        busy = {rec.group for rec in inflight if rec.peer is None}
        skip = self.reported | self.looked
        args = (self.rank, own, peers, busy, self.hang_timeout_s, skip, self.heartbeat_s)
        return detect.find_backend_desync(*args) + detect.find_backend_stuck(*args)

    def confirm(self, suspects: Sequence[detect.Detection]) -> list[detect.Detection]:
        """Reads torch's flight recorder once for the suspects (the only place it is read before an
        incident): those that are hangs, with their op named."""
        if not suspects:
            return []
        # The call that issued a newest entry, if Python did, is among this rank's newest records.
        seqs = {h.group: h.seq for h in suspects if h.group is not None and h.seq is not None}
        ops = backend_ops(seqs, self.state.records(RECENT))
        out = []
        for hang in suspects:
            assert hang.group is not None and hang.seq is not None
            op = ops.get(hang.group)
            stuck = hang.kind is IncidentKind.BACKEND_STUCK
            verdict = detect.backend_verdict(op, time.time(), self.hang_timeout_s, unknown_is_open=not stuck)
            if verdict is detect.Verdict.CLOSED:
                self.looked.add((hang.group, hang.seq))  # completed here (the peers' numbers are a beat old)
            if verdict is not detect.Verdict.OPEN or (hang.group, hang.seq) in self.reported:
                continue
            self.reported.add((hang.group, hang.seq))
            out.append(
                hang
                if op is None
                else replace(hang, op=op.name, reason=f"{hang.reason} (in {op.name}{_issued_text(op)})")
            )
        return out


# given: Any, as Watchdog's store (a c10d Store, or a proxy or test double with its methods).
def connect(desk: IncidentDesk, cfg: WatchdogConfig, world_size: int, given: Any = None, generation: int = 0) -> None:
    """Gives ``desk`` its store: ``given``, else a new client of the job's store; none in a world
    of one, or when the store cannot be reached (then incidents are handled on each rank alone)."""
    keys = Keys.from_env(cfg.session, generation=generation)
    if given is not None:
        desk.store = WatchdogStore(given, keys, cfg.store_timeout, cfg.peer_timeout)
        return
    addr = store_addr(cfg.store_addr)
    if addr is None or world_size <= 1:
        log.info("watchdog: no store (world of %d); incidents are handled on this rank only", world_size)
        return
    try:
        store = WatchdogStore.connect(addr, keys, cfg.store_timeout, cfg.peer_timeout)
        desk.seen_count = store.incident_count()
    except Exception as exc:  # noqa: BLE001 - any failure to connect leaves the rank on its own
        desk.store_lost = True
        log.error(
            "watchdog: could not connect to the store at %s (%s); incidents are handled on this rank only",
            addr,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return
    desk.store, desk.store_addr = store, addr


def rank_and_size(world: World) -> tuple[int, int]:
    """This rank and the size of ``world``: its own once rebuilt, else torch's, else torchrun's."""
    import torch.distributed as dist

    if world.rank is not None and world.size is not None:
        return world.rank, world.size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def take_over(desk: IncidentDesk, old: IncidentDesk | None, world: World, session: str) -> None:
    """Makes ``desk`` the desk of ``world``: its incidents say the generation and the renumbering,
    and it takes ``old``'s store connection (if any) over, keyed for this generation."""
    desk.world = {
        "generation": world.generation,
        "rank_map": {str(k): v for k, v in world.rank_map.items()} if world.generation else None,
        "left_out": list(world.left_out) if world.generation else None,
    }
    if old is None:
        return
    desk.store, desk.store_addr, desk.store_lost = old.store, old.store_addr, old.store_lost
    if desk.store is not None:
        desk.store.keys = Keys.from_env(session, generation=world.generation)
        try:
            desk.seen_count = desk.store.incident_count()
        except (StoreTimeout, StoreUnreachable):
            desk.seen_count = 0  # a fresh generation's counter starts at 0 anyway


def start_watchdog(
    config: WatchdogConfig | None = None,
    *,
    store: Any = None,  # a c10d Store, or a proxy or test double with its methods (see WatchdogStore)
    actions: Sequence[Action | str] | None = None,
    **overrides: Any,
) -> Watchdog:
    """Builds and starts a :class:`Watchdog` (see it for the arguments); returns it.

    Example::

        dist.init_process_group("nccl")
        ncclguard.start_watchdog(heartbeat_s=5, hang_timeout_s=300, action="exit")
    """
    return Watchdog(config, store=store, actions=actions, **overrides).start()


def _issued_text(op: BackendOp) -> str:
    """``", issued at eval.py:88 as ncclguard's #12"`` where a Python call issued ``op``, else ``""``."""
    rec = op.record
    return f", issued at {rec.site} as ncclguard's #{rec.seq}" if rec is not None else ""
