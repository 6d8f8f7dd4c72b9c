"""The left-behind fence while a recovery engine runs, whatever the watchdog's ladder.

A rank stuck for good inside a step (a Python loop that never returns, a data stall) never
reaches the rebuild that would tell it the others went on without it, and torchrun waits for it
for ever. The watchdog's left-behind check (:mod:`ncclguard.watching.desk.left_behind`) ends such a
rank, but only on a ladder that fences. So each step of an engine arms it:

- with a watchdog running, :func:`ncclguard.watching.desk.left_behind.arm` turns its check on (it reads the world record only while a peer is silent: no store traffic in a
  healthy job);
- without one, a small thread (``ncclguard-left-behind``) reads the job's world record every
  :data:`POLL_S` seconds on a store connection of its own, and applies the same rule.

Either way the rank exits 0 once the record has shown a newer world for the grace, unless its own
``rebuild_world`` came late and told it (the engine's left-out policy then applies).
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.exits import exit_now
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.world_record import WorldRecord, read_world_record
from ncclguard.watching.desk.left_behind import LeftBehind, arm
from ncclguard.watching.watchdog import current_watchdog
from ncclguard.world import current_world

__all__ = ["POLL_S", "arm_left_behind_fence"]

POLL_S = 5.0  # one store read per rank this often, only while no watchdog runs
GRACE_S = 2 * POLL_S  # a newer world seen this long: covers a member whose rebuild is under way
STORE_BOUND_S = 5.0


class _Monitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def ensure(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ncclguard-left-behind", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        watch = LeftBehind(GRACE_S)
        while True:
            time.sleep(POLL_S)
            wd = current_watchdog()
            if wd is not None:  # the watchdog's check takes over
                arm(wd)
                return
            world = current_world()
            if world.store is None or not (dist.is_available() and dist.is_initialized()):
                continue  # no world yet (a restarted process waiting to rejoin is never fenced)
            record = _read(world.store)
            if not watch.observe(
                record.generation if record else None, world.generation, world.left_behind, True, time.monotonic()
            ):
                continue
            assert record is not None
            log.critical(
                "left behind: the job went on to generation %d (launch ranks %s) while this rank (%s of generation "
                "%d) never left its step; exiting with status 0 so that the job can end",
                record.generation,
                rank_ranges(record.origins),
                world.rank,
                world.generation,
            )
            exit_now(0)


def _read(store: dist.Store) -> WorldRecord | None:
    deadline = Deadline.within(STORE_BOUND_S)
    try:
        return read_world_record(store_for_this_thread(store, deadline), deadline)
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.debug("left-behind fence: the world record is unreadable now (%s)", exc)
        return None


_MONITOR = _Monitor()


def arm_left_behind_fence() -> None:
    """Turns the left-behind fence on for this process (see the module doc); cheap when it is on."""
    wd = current_watchdog()
    if wd is not None:
        arm(wd)
    else:
        _MONITOR.ensure()
