"""What a rebuild keeps in the job's store beside its meeting: the job's current world
(:func:`record_new_world`, which a restarted process reads to find its place) and the death count
a new world starts from (:func:`deaths_before`).
"""

from __future__ import annotations

import torch.distributed as dist

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.recovery._rebuild.meeting import (
    WorldRecord,
)
from ncclguard.store.deaths import deaths_so_far
from ncclguard.store.world_record import write_world_record
from ncclguard.world import World

__all__ = ["deaths_before", "record_new_world"]


def _record_world(store: dist.Store, record: WorldRecord, deadline: Deadline) -> None:
    """Records ``record`` as the job's current world, for a restarted process to find its place
    (:func:`ncclguard.rejoin_world`). A failure is logged: only a later rejoin needs it."""
    try:
        write_world_record(store, record, deadline)
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.warning("rebuild_world: the job's world record could not be written (%s)", exc)


def deaths_before(store: dist.Store, deadline: Deadline) -> int:
    """The job's death notices posted so far (:mod:`ncclguard.store.deaths`): a world being made
    counts from here, since only later deaths can be of its members. 0 when the store does not say
    in time (a later commit then waits for a dead member's bound, as without a notice)."""
    try:
        return deaths_so_far(store, Deadline.within(max(deadline.left(), 1.0)))
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.info("rebuild_world: the death count is unreadable (%s); commits will wait for a dead member", exc)
        return 0


def record_new_world(world: World, new: World, deadline: Deadline) -> WorldRecord | None:
    """On the lowest-numbered survivor, records ``new`` as the job's world, before the handshake:
    a restarted process in it reads the record to connect, and a later one to find its place.

    Returns:
        The record written (or tried: a failure is only logged), or None on every other rank.
    """
    assert new.size is not None and world.store is not None and world.backend is not None
    if new.rank != min((r for r in range(new.size) if r not in new.joined), default=-1):
        return None
    record = WorldRecord(
        generation=new.generation,
        origins=list(new.origins),
        backend=world.backend,
        timeout_s=world.timeout.total_seconds() if world.timeout is not None else 600.0,
    )
    _record_world(world.store, record, Deadline.within(max(deadline.left(), 1.0)))
    return record
