"""A job's end, told apart from a failure: what a watchdog stopped on purpose says, and when it stops.

When a rank's work is done its watchdog stops on purpose (the script's end, ``stop()``, a ``with``
block left without an error), and the script may destroy its process group first. Its watchers
must not take what follows for an incident:

- its silence: its last heartbeat says ``finished``, and a finished peer is never lost
  (:mod:`~ncclguard.watching.sensors.liveness`);
- the store's going, where this process hosts it (rank 0 under a plain launcher: its
  ``init_process_group`` starts the server in its own process, and the server stops with the
  process or with ``destroy_process_group()``): at the stop, or before the destroy, it says so in
  the store (``closing``) and waits,
  at most :func:`closing_wait_s`, until every rank knows (``ending`` counts them); a rank that read
  it takes the store's loss for the job's end (:meth:`~ncclguard.watching.desk.desk.IncidentDesk.store_gone`).

Under torchrun the agent hosts the store and outlives the ranks, so only the first holds there.
A rank that dies (a signal, an uncaught exception, an exit rung) says nothing, and is lost as before.

While a watchdog runs, ``destroy_process_group()`` of the world first has the store's host tell the
ranks, before the group, and with it the server, goes (:class:`Closing`): measured under
``ncclguard.testing.launch``, rank 0's ``destroy_process_group()`` broke its peers' store connections
at once, while rank 0 lived on. The hook sits inside torch's function
(:func:`~ncclguard._torch_compat.hook_world_teardown`), not on its name: nanoGPT's ``train.py``
``from torch.distributed import destroy_process_group`` binds the function before any wrapper could
exist, and a wrapper of the name let that script's rank 0 take its peers' work down with it. The
watchdog goes on (a script may make a group again); it says ``finished`` when it stops. ncclguard's
own rebuild destroys the world without the hook (``_torch_compat.destroy_world_quietly``): a
rebuild is no end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.errors import StoreTimeout, StoreUnreachable, TorchCompatError
from ncclguard.store.clients import serves_here, unprefixed
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import store_addr
from ncclguard.watching.world_watch import WorldWatch

__all__ = ["Closing", "announce_closing", "closing_wait_s", "hook_destroy", "leave", "store_port", "unhook_destroy"]


def closing_wait_s(config: WatchdogConfig) -> float:
    """How long the store's host waits at its watchdog's stop for every rank to know that the store
    goes: two heartbeats (each rank reads the mark at its heartbeats; one may come late), a store
    call, and two ticks."""
    return 2 * config.heartbeat_s + config.store_timeout + 2 * min(config.heartbeat_s / 5, 0.5)


def store_port(given: Any, addr: str | None) -> int | None:
    """The port of the store a watchdog talks to.

    Args:
        given: the store the watchdog was given (its ``port``, where it has one), or None.
        addr: the ``host:port`` it connected to otherwise.

    Returns:
        The port, or None when neither says.
    """
    port = getattr(unprefixed(given), "port", None) if given is not None else None
    if isinstance(port, int):
        return port
    raw = addr.rpartition(":")[2] if addr else ""
    return int(raw) if raw.isdigit() else None


def leave(watch: WorldWatch, config: WatchdogConfig, given: Any) -> None:
    """Ends a stop on purpose, on the watchdog's thread: the last heartbeat, and on the store's host
    the closing mark and the wait for every rank to know it. Never raises.

    Args:
        watch: the world watched.
        config: the watchdog's settings.
        given: the store the watchdog was given, or None (it connected to ``desk.store_addr``, or
            to where :func:`~ncclguard.watching.base.watchdog_store.store_addr` says).
    """
    if watch.desk.store is None:
        return
    try:
        watch.leave()
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not say that this rank finished (%s)", exc)
        return
    announce_closing(watch, config, given)


def announce_closing(watch: WorldWatch, config: WatchdogConfig, given: Any) -> None:
    """Where this process hosts the store: the closing mark, and the wait (at most
    :func:`closing_wait_s`) until every rank knows it. On the watchdog's thread; never raises.

    Args:
        watch: the world watched.
        config: the watchdog's settings.
        given: as :func:`leave` takes it.
    """
    desk = watch.desk
    if desk.store is None or desk.store_closing:
        return
    try:
        port = store_port(given, desk.store_addr or store_addr(config.store_addr))
        if port is None or not serves_here(port):
            return
        desk.store.set_mark(desk.store.keys.closing)
        watch.know_ending()  # this rank too: at a destroy it has not counted itself yet
        desk.store_closing = True  # this process's own desk too: it may watch on after the stop
        deadline = time.monotonic() + closing_wait_s(config)
        while (known := watch.ending_count()) < watch.world_size and time.monotonic() < deadline:
            time.sleep(min(0.05, config.heartbeat_s / 5))
        if known < watch.world_size:
            log.warning(
                "watchdog: %d of %d ranks knew the job is ending when this process, the store's host, went on; "
                "the others will see the store gone",
                known,
                watch.world_size,
            )
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not tell the ranks that the store goes (%s)", exc)


class Closing:
    """``destroy_process_group()`` of the world, on a watchdog that goes on: the caller asks, the
    watchdog's thread (the one that talks to the store) tells every rank, where this process hosts
    the store, that the store goes (:func:`announce_closing`), and the caller waits for it, bounded.
    The watchdog is not stopped: the script may make a group again, and a rank that is not the
    store's host loses nothing by the destroy.

    Args:
        config: the watchdog's settings.
        thread: the watchdog's thread, or None (nobody to wait for then, nor when it is the caller).
    """

    def __init__(self, config: WatchdogConfig, thread: Callable[[], threading.Thread | None]) -> None:
        self.config, self.thread = config, thread
        self._lock = threading.Lock()
        self._asked: threading.Event | None = None

    def ask(self) -> None:
        """Asks the watchdog's thread, and waits until it has told every rank (or gave up)."""
        done = threading.Event()
        with self._lock:
            self._asked = done
        thread = self.thread()
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            done.wait(closing_wait_s(self.config) + 2 * self.config.store_timeout)

    def serve(self, watch: WorldWatch, given: Any) -> None:
        """On the watchdog's thread, at each tick: does what was asked, if anything."""
        with self._lock:
            done, self._asked = self._asked, None
        if done is not None:
            try:
                announce_closing(watch, self.config, given)
            finally:
                done.set()  # the caller waits no longer, whatever happened


class _Hook:
    """The undo of the teardown hook set while a watchdog runs (:func:`~ncclguard._torch_compat.hook_world_teardown`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.undo: Callable[[], None] | None = None


_hook = _Hook()


def hook_destroy(before: Callable[[], None]) -> None:
    """Has ``destroy_process_group()`` of the whole world call ``before`` first, before torch lets go
    of the groups and their store, whatever name the caller reached torch's function by; not when
    ncclguard's rebuild destroys the world (``destroy_world_quietly``). Idempotent;
    :func:`unhook_destroy` undoes it. Never raises.

    Args:
        before: what to do first (:meth:`Closing.ask`).
    """

    def at_teardown() -> None:
        try:
            before()
        except Exception as exc:  # noqa: BLE001 - the user's destroy must go on whatever happened here
            log.warning("watchdog: could not tell the ranks before destroy_process_group() (%s)", exc)

    with _hook.lock:
        if _hook.undo is not None:
            return
        try:
            _hook.undo = compat.hook_world_teardown(at_teardown)
        except TorchCompatError as exc:
            log.warning(
                "watchdog: %s; where this process hosts the store, its destroy_process_group() will look to the "
                "other ranks like the store's loss",
                exc,
            )


def unhook_destroy() -> None:
    """Takes the hook of :func:`hook_destroy` away."""
    with _hook.lock:
        undo, _hook.undo = _hook.undo, None
    if undo is not None:
        undo()
