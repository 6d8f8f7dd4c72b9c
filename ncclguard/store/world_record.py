"""The job's current world as its store records it: which launch ranks are its members.

Written by the members after each rebuild (``ncclguard/world/current``,
:func:`ncclguard.store.keys.world_record_key`), and read by a restarted process to find its place
(:func:`ncclguard.rejoin_world`) and by the watchdog of a rank the others went on without
(:mod:`ncclguard.watching.desk.left_behind`). It lives in the store layer because both read it.
"""

from __future__ import annotations

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ncclguard.deadlines import Deadline
from ncclguard.errors import DecodeError, StoreUnreachable
from ncclguard.store.keys import world_record_key
from ncclguard.store.values import poll_value, read_value, write_value

__all__ = ["MAX_RECORD_BYTES", "WorldRecord", "read_world_record", "wait_world_record", "write_world_record"]

MAX_RECORD_BYTES = 16 * 1024 * 1024  # a world record lists each member's launch rank


class WorldRecord(BaseModel):
    """The job's current world, kept in the store (:func:`ncclguard.store.keys.world_record_key`)
    for a restarted process to find its place: written by the members after each rebuild, and by
    ``RecoveringStep(heal=True)`` for generation 0.

    Attributes:
        generation: the world's generation.
        origins: the launch rank of each member, by rank in that world.
        backend: its default group's backend.
        timeout_s: its collectives' timeout, in seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int = Field(ge=0)
    origins: list[int] = Field(min_length=1, max_length=1 << 20)
    backend: str = Field(min_length=1, max_length=64)
    timeout_s: float = Field(gt=0)

    def rank_of(self, origin: int) -> int | None:
        """The rank, in this world, of the member launched as ``origin`` (None: not a member)."""
        try:
            return self.origins.index(origin)
        except ValueError:
            return None


def read_world_record(store: dist.Store, deadline: Deadline) -> WorldRecord | None:
    """The job's current world as the store records it, or None before the first rebuild.

    Args:
        store: the job's store (unprefixed).
        deadline: when to stop waiting for the store.

    Returns:
        The record, or None.

    Raises:
        StoreUnreachable: no answer by ``deadline``, or a record that cannot be read (over its
            size bound, not JSON, not a record).
        RuntimeError, DistStoreError: the store failed.
    """
    try:
        return read_value(store, world_record_key(), WorldRecord, MAX_RECORD_BYTES, deadline, "the world record")
    except DecodeError as exc:
        raise StoreUnreachable(f"the job's world record cannot be read: {exc}") from exc


def wait_world_record(store: dist.Store, generation: int, deadline: Deadline) -> WorldRecord | None:
    """Waits for the record of a generation ``generation`` or newer.

    Args:
        store: the job's store (unprefixed).
        generation: the oldest generation waited for.
        deadline: when to give up.

    Returns:
        The record, or None at the deadline.

    Raises:
        StoreUnreachable: the store did not answer, or the record cannot be read.
        RuntimeError, DistStoreError: the store failed.
    """
    try:
        return poll_value(
            store,
            world_record_key(),
            WorldRecord,
            MAX_RECORD_BYTES,
            deadline,
            "the world record",
            accept=lambda rec: rec.generation >= generation,
        )
    except DecodeError as exc:
        raise StoreUnreachable(f"the job's world record cannot be read: {exc}") from exc


def write_world_record(store: dist.Store, record: WorldRecord, deadline: Deadline) -> None:
    """Records ``record`` as the job's current world.

    Args:
        store: the job's store (unprefixed).
        record: the world now in force.
        deadline: when to stop waiting for the store.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    write_value(store, world_record_key(), record, deadline, "the world record")
