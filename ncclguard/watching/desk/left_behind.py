"""The left-behind fence: a rank whose peers went on to a newer world without it, and whose main
thread never came back to learn it, ends itself with status 0.

The ``fence`` rung ends the rank a merged incident names the culprit. It cannot end a rank that
nobody names: when the group's timeout is not above ``hang_timeout_s``, the waiting ranks leave the
op before the incident is merged, the stuck rank's own merge names the silent peers, and the
survivors rebuild without it (``RecoveringStep(allow_shrink=True)``). That rank's main thread is
stuck for good, so it never reaches ``rebuild_world`` to be told it is left out, and torchrun waits
for it for ever (found by ``benchmarks/failure_drill.py``'s ``stuck`` run).

Its watchdog thread still runs. A member's own ``rebuild_world`` moves its watchdog to the new
generation at once (``ncclguard.world.announce``), so a watchdog that reads a newer generation in
the job's world record (:class:`~ncclguard.store.world_record.WorldRecord`) for ``grace_s`` is in a
process the world went on without. Unless the process was told so (its ``rebuild_world`` came late:
``World.left_behind``; its own code then decides), the watchdog marks the rank fenced in the store,
logs it and exits 0: torchrun leaves a worker that exits 0 alone, and ends the job when the others
are done. The record is read only while a watched peer is silent (the peers of an old generation
stop beating), so a healthy job makes no extra store request.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from ncclguard._log import log
from ncclguard._naming import HOSTNAME, rank_ranges
from ncclguard.errors import StoreTimeout, StoreUnreachable
from ncclguard.exits import exit_now
from ncclguard.incidents.model import FenceNote
from ncclguard.watching.base.watchdog_store import WatchdogStore
from ncclguard.watching.judge.rules import rule_left_behind
from ncclguard.world import current_world

__all__ = ["LeftBehind", "arm", "fence_if_left_behind"]


@dataclass
class LeftBehind:
    """Decides when a rank counts as left behind; pure (the caller reads the store and the clock).

    Args:
        grace_s: how long a newer generation must be seen before acting (``fence_after_s``): covers
            a member whose watchdog has not followed its own rebuild yet, and a late rank whose
            ``rebuild_world`` is about to return.
    """

    grace_s: float
    since: float | None = None  # monotonic time a newer generation was first seen

    def observe(self, recorded: int | None, mine: int, told: bool, member: bool, now: float) -> bool:
        """Takes one reading; True when the rank is to be fenced now.

        Args:
            recorded: the generation in the job's world record (None: none recorded).
            mine: the generation this rank's watchdog follows.
            told: the process learned it is left out (``World.left_behind``).
            member: the process is in a world with a process group (a restarted process waiting to
                rejoin is not, and must not be fenced for being behind).
            now: ``time.monotonic()``.

        Returns:
            True once a newer generation has been seen for ``grace_s`` and nothing excuses it.
        """
        if self.since is None:
            self.since = now
        ruling = rule_left_behind(recorded, mine, told, member, now - self.since, self.grace_s)
        if ruling.kind == "await":  # not behind, or excused: the clock starts afresh
            self.since = None
        return ruling.acts


def arm(watchdog: Any) -> None:
    """Turns the fence on for ``watchdog`` whatever its ladder (the recovery engine does, for a rank
    stuck for good inside a step: :mod:`ncclguard.recovery._step.guards`); idempotent.

    Args:
        watchdog: the running :class:`~ncclguard.watching.watchdog.Watchdog`.
    """
    if watchdog._left is None:
        watchdog._left = LeftBehind(watchdog.config.fence_after)


def fence_if_left_behind(
    watch: LeftBehind | None, store: WatchdogStore, rank: int, generation: int, now: float, peers_silent: bool
) -> None:
    """Reads the job's world record and, when ``watch`` says so, fences this rank: its mark in the
    store (``python -m ncclguard status`` shows it ``fenced``), a critical log line, exit 0.

    Args:
        watch: this watchdog's left-behind state; None on a ladder without ``fence`` (nothing done).
        store: the watchdog's store.
        rank: this rank in the generation it follows.
        generation: that generation.
        now: ``time.monotonic()``.
        peers_silent: a watched peer is silent: only then is the record read (the peers of an old
            world stop beating in it), so a healthy job makes no extra store request.
    """
    import torch.distributed as dist

    if watch is None:
        return
    if not peers_silent:  # peers that beat are in this rank's world: whatever the record says, not behind
        watch.since = None
        return
    record = store.read_world_record()
    world = current_world()
    member = dist.is_available() and dist.is_initialized()
    if not watch.observe(record.generation if record else None, generation, world.left_behind, member, now):
        return
    assert record is not None
    note = FenceNote(rank=rank, host=HOSTNAME, pid=os.getpid(), incident=f"left-behind-g{generation}", time=time.time())
    try:
        store.put_fenced(note)
    except (StoreTimeout, StoreUnreachable) as exc:
        log.warning("watchdog: could not mark this rank fenced in the store: %s", exc)
    log.critical(
        "watchdog: left behind: the job went on to generation %d (launch ranks %s) %.1f s ago while this rank (%d of "
        "generation %d) never left its step; exiting with status 0 so that the job can end",
        record.generation,
        rank_ranges(record.origins),
        watch.grace_s,
        rank,
        generation,
    )
    exit_now(0)
