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

This module holds the watchdog's life cycle, its thread's loop and its public API. What belongs to
one world (this rank's state, its peers, the sensors, the incident desk) is a
:class:`~ncclguard.watching.world_watch.WorldWatch`, one per world followed; the sensors are listed in
:mod:`~ncclguard.watching.sensors.registry`; the settings are :class:`WatchdogConfig`
(:mod:`~ncclguard.watching.base.settings`).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.exits import stop_pollers
from ncclguard.incidents.model import Heartbeat
from ncclguard.incidents.pictures import finish_drawings
from ncclguard.recording.flight import recorder
from ncclguard.recording.rungs import acted
from ncclguard.store.bounded import drain_at_exit
from ncclguard.watching import ending
from ncclguard.watching.base.hang_bound import HangBound, given
from ncclguard.watching.base.settings import ACTIONS, EXIT_CODE, WatchdogConfig
from ncclguard.watching.desk.casebook import Casebook
from ncclguard.watching.desk.left_behind import LeftBehind
from ncclguard.watching.desk.told import Told
from ncclguard.watching.ladder.actions import Action, Ladder, MainThreadRaiser, build_ladder
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.sensor import Sensor
from ncclguard.watching.sensors.story import MainThreadTrack
from ncclguard.watching.sensors.straggler.clocks import join_tickers
from ncclguard.watching.views import Views
from ncclguard.watching.world_watch import WorldWatch
from ncclguard.watching.worlds import Announced, attach, connect
from ncclguard.world import World, current_world, subscribe

__all__ = ["ACTIONS", "EXIT_CODE", "Watchdog", "WatchdogConfig", "current_watchdog", "start_watchdog", "tell"]


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
    waited for once it has stopped (:func:`~ncclguard.store.bounded.drain_at_exit`), and so are the
    pictures its desk is still drawing (:func:`~ncclguard.incidents.pictures.finish_drawings`).
    """
    stop_pollers()  # the verdict's and the left-behind fence's threads start no store call from here on
    watchdog = _running.watchdog
    if watchdog is not None:
        # An uncaught exception ends the script with sys.last_value set (before atexit runs): a
        # rank that failed did not finish, and its watchers are to see it lost.
        watchdog.stop(finished=getattr(sys, "last_value", None) is None)
    join_tickers()  # its threads that start store calls of their own end before those are waited for
    drain_at_exit()
    finish_drawings()


def _launch_rank(fallback: int) -> int:
    """This process's launch rank (``RANK``; ``fallback`` without it): the key of what its watchdog
    learned, the same after a rebuild."""
    raw = os.environ.get("RANK", "")
    return int(raw) if raw.isdigit() else fallback


def current_watchdog() -> Watchdog | None:
    """The watchdog running in this process, or None."""
    return _running.watchdog


class Watchdog:
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
        self._finished = False  # the stop under way is on purpose (stop()'s ``finished``)
        self._closing = ending.Closing(config, lambda: self._thread)
        self._thread: threading.Thread | None = None
        self._book = Casebook()  # this rank's cases across the worlds followed
        self._told = Told()  # what the training thread tells it to raise (the engine's numerical findings)
        self._signum = getattr(signal, config.raise_signal)
        self._raiser: MainThreadRaiser | None = None
        self._handler_installed = False
        self._instrumented = False
        self.watch: WorldWatch | None = None  # the world watched now (a new one at each world followed)
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
            running.stop(finished=False)  # a hand-over: this rank goes on beating
        with _running.lock:
            if _running.watchdog is not None:
                raise RuntimeError("a Watchdog already runs in this process; stop() it first (one per process)")
            _running.watchdog = self
        _running.hook_exit()
        self._raiser = MainThreadRaiser(self._signum, self._completed) if needs_handler else None
        self.watch, self._announced = None, Announced()  # a restarted watchdog starts afresh
        self._book.clear()
        self._told.clear()
        acted.clear()  # the rungs a commit names are this watchdog's, as its cases are
        self._track = MainThreadTrack(threading.main_thread().ident)
        self._unsubscribe = subscribe(self._announced.put)  # first: a world announced meanwhile is followed
        ending.hook_destroy(self._closing.ask)  # the store's host tells the ranks before a destroy (ending.py)
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
        self._finished = False
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

    def stop(self, timeout: float | None = None, *, finished: bool = True) -> None:
        """Stops the thread, waiting ``timeout`` at most (default: 2 store timeouts, a beat, and the closing
        wait when ``finished``: this rank's work is done, :mod:`~ncclguard.watching.ending`; not a hand-over)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._finished = finished
        ending.unhook_destroy()  # a destroy from now on has no watchdog thread to tell the ranks
        self._stop.set()
        if self._thread is not None:
            cfg = self.config
            bound = 2 * cfg.store_timeout + cfg.heartbeat_s + (ending.closing_wait_s(cfg) if finished else 0.0)
            self._thread.join(bound if timeout is None else timeout)
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
                acted.clear()  # a stopped watchdog's rungs fail no later commit

    def _enter(self, world: World) -> None:
        """Watches ``world`` from now on: its members under their numbers in it, heartbeats and
        incidents under its generation's keys. The cases of the world before are kept (they are
        this rank's history), their ladders as they were."""
        old = self.watch
        self.hang.new_world()  # what was learned stays: the numbers of the new world start again
        watch = WorldWatch(
            self.config, world, self.ladder, self._raiser, self._book.cond, self._track, self._hang_s, old
        )
        self._book.follow(watch.desk)
        if old is not None:
            log.warning(
                "watchdog: following world generation %d: rank %d of %d", world.generation, watch.rank, watch.world_size
            )
        self.watch = watch

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        cfg = self.config
        assert self.watch is not None
        poll = min(cfg.heartbeat_s / 5, 0.5)
        connect(self.watch.desk, cfg, self.watch.world_size, self._given_store)
        next_beat = 0.0
        views = Views(cfg)  # the status index and the metrics, once per beat
        slow_store = False
        while not self._stop.is_set():
            world = self._announced.take()
            if world is not None:
                self._enter(world)
                next_beat = 0.0  # beat at once in the new world
            watch = self.watch
            desk = watch.desk
            store = attach(desk, cfg, watch.world_size)  # the store, once its client is made (worlds.py)
            if store is not None:  # a restarted process goes on from what its predecessor learned
                self.hang.load(store, _launch_rank(self.rank))
            try:
                self._closing.serve(watch, self._given_store)  # a destroy_process_group() waits on it
                now = time.monotonic()
                recorder.sweep()
                self._track.sample()
                watch.tick_sensors()
                self._hang_s = watch.learn_hang(self.hang, _launch_rank(self.rank), now)
                watch.check_hang(self._hang_s)  # before any store call that a slow store holds up
                if now >= next_beat:
                    next_beat = now + cfg.heartbeat_s
                    watch.publish(self.hang, self._hang_s, _launch_rank(self.rank))
                    watch.read_peers(self._left)
                    views.beat(self, desk)
                watch.check_peers()
                watch.tend(self._told, now)
                slow_store = False
            except StoreUnreachable as exc:
                desk.store_gone(exc)
            except StoreTimeout as exc:
                if not slow_store:  # one line per slow spell
                    log.warning("watchdog: the store is slow (%s); trying again every tick", exc)
                slow_store = True
            except Exception:  # noqa: BLE001 - the watchdog must outlive its own bugs
                log.exception("watchdog tick failed; going on")
            self._stop.wait(poll)
        if self._finished:
            ending.leave(self.watch, cfg, self._given_store)
        self.watch.desk.close()  # its store's helper thread ends with the watchdog

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(finished=exc[0] is None)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The ``raise_signal`` handler (main thread): raises the armed CollectiveTimeout."""
        if self._raiser is not None:
            self._raiser.on_signal(signum, frame)

    @property
    def incidents(self) -> list[dict[str, Any]]:
        """The incidents this rank handled, oldest first: ``id``, ``kind``, ``dir``, ``merger`` (this rank
        merged it), ``actions`` (the rungs taken), ``settled`` (the ladder is over), ``doc``."""
        return self._book.records()

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
        self._book.wait(timeout, count, merged, settled)
        return self.incidents

    @property
    def rank(self) -> int:
        """This rank in the world watched now (-1 before start)."""
        return self.watch.rank if self.watch is not None else -1

    @property
    def world_size(self) -> int:
        """The size of the world watched now (0 before start)."""
        return self.watch.world_size if self.watch is not None else 0

    @property
    def generation(self) -> int:
        """The generation of the world watched now (-1 before start)."""
        return self.watch.generation if self.watch is not None else -1

    def peer_heartbeats(self) -> dict[int, Heartbeat]:
        """The last heartbeat of each watched peer (its host and address among them); empty before start."""
        watch = self.watch
        return watch.peer_heartbeats() if watch is not None else {}

    def peer_beats(self) -> tuple[int, dict[int, tuple[Heartbeat, float]]]:
        """The generation, and the watched peers' last heartbeats with their ages in seconds (the verdict's)."""
        watch = self.watch
        if watch is None:
            return -1, {}
        return watch.generation, watch.peer_beats()

    def sensor(self, name: str) -> Sensor | None:
        """The sensor ``name`` of the world watched now (:mod:`ncclguard.watching.sensors.registry`),
        or None (before the world's first beat, or none registered by that name)."""
        watch = self.watch
        return watch.sensor(name) if watch is not None else None

    def hang_bound_s(self) -> float:
        """The hang bound in force: the user's, or learned (:mod:`ncclguard.watching.base.hang_bound`)."""
        return self._hang_s

    def _completed(self, key: tuple[str, int]) -> bool:
        """Whether this rank's op ``key`` completed, in the world watched now (the raise rung asks)."""
        watch = self.watch
        return watch is not None and watch.state.completed(key)


def tell(det: Detection, wait_s: float = 0.0) -> bool:
    """Raises ``det`` from another thread through the watchdog running here (the recovery engine's
    numerical findings, docs/numerics.md): its thread opens it at its next tick, claimed once across
    ranks by its signature; nothing without a watchdog.

    Args:
        det: the detection.
        wait_s: wait this long at most until this rank has handled its incident: its dump written and
            its statement published, and the report merged when this rank merges it.

    Returns:
        Whether it was handled within ``wait_s`` (False without a watchdog, or with no wait).
    """
    wd = current_watchdog()
    if wd is None:
        return False
    wd._told.put(det)
    return wait_s > 0 and wd._book.wait_handled(det, wait_s)


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
