"""The job's current world as its store records it: which launch ranks are its members.

Written by the members after each rebuild (``ncclguard/world/current``,
:func:`ncclguard.store.keys.world_record_key`), and read by a restarted process to find its place
(:func:`ncclguard.rejoin_world`) and by the watchdog of a rank the others went on without
(:mod:`ncclguard.watching.left_behind`). It lives in the store layer because both read it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MAX_RECORD_BYTES", "WorldRecord"]

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
