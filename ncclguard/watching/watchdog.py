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
exit, or your own :class:`~ncclguard.watching.ladder.actions.Action` rungs), giving each rung
``escalate_after_s`` to clear the hang. No store call waits longer than ``store_timeout_s``;
nothing waits on a dead peer.

This module holds the watchdog's life cycle and public API; the parts it drives, each with one job:
:mod:`~ncclguard.watching.loop` (the thread's loop: what happens at each tick),
:mod:`~ncclguard.watching.sensors.backend_watch` (the backend's numbers), :mod:`~ncclguard.watching.worlds`
(the world watched, the store connection, a rebuild followed), :mod:`~ncclguard.watching.sensors.story`
(where the main thread was, for the pictures), :mod:`~ncclguard.watching.base.watchdog_store` (the store
protocol), :mod:`~ncclguard.watching.sensors.liveness`
(peer heartbeats), :mod:`~ncclguard.watching.sensors.detect` (detectors), :mod:`~ncclguard.watching.desk.desk`
(claim, statements, merge), :mod:`~ncclguard.watching.ladder.actions` (the ladder),
:mod:`~ncclguard.watching.sensors.rank_state` (this rank's state), :mod:`~ncclguard.watching.base.settings`
(:class:`WatchdogConfig`).
"""

from __future__ import annotations

import atexit
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ncclguard._log import log
from ncclguard.incidents.files import INCIDENT_FILE
from ncclguard.incidents.model import Heartbeat
from ncclguard.store.bounded import drain_at_exit
from ncclguard.watching.base.hang_bound import HangBound, given
from ncclguard.watching.base.settings import ACTIONS, EXIT_CODE, WatchdogConfig
from ncclguard.watching.desk.desk import IncidentDesk
from ncclguard.watching.desk.left_behind import LeftBehind
from ncclguard.watching.ladder.actions import Action, Ladder, MainThreadRaiser, build_ladder
from ncclguard.watching.loop import Loop
from ncclguard.watching.sensors.backend_watch import BackendWatch
from ncclguard.watching.sensors.liveness import Liveness
from ncclguard.watching.sensors.rank_state import RankState
from ncclguard.watching.sensors.story import MainThreadTrack
from ncclguard.watching.worlds import Announced, rank_and_size, take_over
from ncclguard.world import World, current_world, subscribe

__all__ = ["ACTIONS", "EXIT_CODE", "Watchdog", "WatchdogConfig", "current_watchdog", "start_watchdog"]


class _Running:
    """The watchdog running in this process (one per process: its signal handler and its thread
    are the process's), whatever the world; it follows world changes itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watchdog: Watchdog | None = None
        self.exit_hook = False  # _stop_at_exit is registered

    def hook_exit(self) -> None:
        """Registers :func:`_stop_at_exit` with atexit, once per process."""
        with self.lock:
            if not self.exit_hook:
                atexit.register(_stop_at_exit)
                self.exit_hook = True


_running = _Running()


def _stop_at_exit() -> None:
    """Stops the running watchdog when the interpreter exits, before daemon threads are killed.

    atexit runs after the main thread is done and before finalization. A daemon thread that is
    inside a torch call that released the GIL (a store request, a read of the flight recorder) when
    finalization starts is ended by ``pthread_exit`` as it takes the GIL back, from the destructor
    of pybind11's ``gil_scoped_release``: ``terminate called without an active exception``, status
    -6 (pytorch/pytorch#38228). Seen at the end of DDP-only runs with the watchdog on, about 1 in 8.
    The store calls its helper threads still make (a connect under way when a short job ends) are
    waited for once it has stopped (:func:`~ncclguard.store.bounded.drain_at_exit`).
    """
    watchdog = _running.watchdog
    if watchdog is not None:
        watchdog.stop()
    drain_at_exit()


def current_watchdog() -> Watchdog | None:
    """The watchdog running in this process, or None."""
    return _running.watchdog


class Watchdog(Loop):
    """One background thread per process that detects hangs, dumps and names the culprits.

    Use ``Watchdog(...).start()`` (or ``with Watchdog(...):``, or :func:`start_watchdog`) on every
    rank right after ``init_process_group`` (``ncclguard run`` and ``NCCLGUARD_AUTO`` start one for
    you). One runs per process; it is stopped when the interpreter exits.

    Attributes:
        gives_way: True for the watchdog that ``ncclguard run`` / ``NCCLGUARD_AUTO`` started: a
            later :meth:`start` of another watchdog in this process stops it and takes its place.

    Args:
        config: the settings; default from the environment (``NCCLGUARD_WATCHDOG_*``).
        store: a c10d Store to use instead of a fresh TCPStore client (it is then used from the
            watchdog's threads only; every call is bounded by ``store_timeout_s``).
        actions: a ladder of your own instead of ``config.action``'s: built-in names
            (``"report"``, ``"raise"``, ``"abort"``, ``"fence"``, ``"exit"``) and
            :class:`~ncclguard.watching.ladder.actions.Action` instances, in order (``report`` first).
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
        # The hang bound in force: learned per phase from the job unless the user set it, or the ladder
        # acts (its rungs act on a hang without progress evidence: a busy rank must not meet them early).
        fixed = given(config.model_fields_set) or self.ladder.names != ("report",)
        self.hang = HangBound(config.hang_timeout_s, config.heartbeat_s, fixed)
        self._hang_s = config.hang_timeout_s
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
        self._announced = Announced()
        self._unsubscribe: Any = None
        # True for the watchdog that ``ncclguard run`` / ``NCCLGUARD_AUTO`` started: a later start()
        # in this process stops it and takes its place (one watchdog per process, the script's).
        self.gives_way = False
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
        running = current_watchdog()
        if running is not None and running is not self and running.gives_way:
            log.info("watchdog: the script starts its own; the one ncclguard run started stops")
            running.stop()
        with _running.lock:
            if _running.watchdog is not None:
                raise RuntimeError("a Watchdog already runs in this process; stop() it first (one per process)")
            _running.watchdog = self
        _running.hook_exit()
        self._raiser = MainThreadRaiser(self._signum, lambda key: self._state.completed(key)) if needs_handler else None
        self._desk, self._retired, self._announced = None, [], Announced()  # a restarted watchdog starts afresh
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
            "watchdog started: heartbeat %.3g s, hang after %.3g s%s, peers lost after %.3g s, ladder %s, incidents in %s",
            cfg.heartbeat_s,
            cfg.hang_timeout_s,
            "" if self.hang.fixed else f" (learned per phase, {self.hang.learner.floor_s:g}-{cfg.hang_timeout_s:g} s)",
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
        self._backend = BackendWatch(self.rank, self._state, self._liveness, self._hang_s, cfg.heartbeat_s)
        self.hang.new_world()  # what was learned stays: the numbers of the new world start again
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

    def peer_beats(self) -> tuple[int, dict[int, tuple[Heartbeat, float]]]:
        """The watched peers' last heartbeats and their ages in seconds, with the generation they are
        of (the recovery engine's verdict, :mod:`ncclguard.recovery._verdict.verdict`, reads them)."""
        live, now = getattr(self, "_liveness", None), time.monotonic()
        if live is None:
            return -1, {}
        peers = list(live.peers.items())
        return self.generation, {r: (p.heartbeat, now - p.changed) for r, p in peers if p.heartbeat is not None}

    def hang_bound_s(self) -> float:
        """The hang bound in force now: the user's ``hang_timeout_s``, or the one learned for the
        phases this rank and its watched peers are in (:mod:`ncclguard.watching.base.hang_bound`)."""
        return self._hang_s

    def _all_cases(self) -> list[Any]:
        return self._retired + (self._desk.cases if self._desk is not None else [])


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
