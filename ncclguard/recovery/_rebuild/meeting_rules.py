"""The pure logic of a rebuild: what ranks write to the store, how the meeting is decided, and
how survivors are renumbered. No store, no process group: everything here is testable alone.

A rebuild toward generation ``G`` meets under ``ncclguard/rebuild/g<G>/t<T>`` in the job's store
(the keys: :class:`ncclguard.store.keys.MeetingKeys`, re-exported here), ``T`` being the
attempt: every rank counts its own attempts toward ``G``, so the n-th call of each rank meets the
n-th call of the others, as ncclguard's other rounds do.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ncclguard.deadlines import to_seconds
from ncclguard.store.codec import decode
from ncclguard.store.keys import MeetingKeys, world_prefix
from ncclguard.store.world_record import MAX_RECORD_BYTES, WorldRecord

__all__ = [
    "MAX_ARRIVAL_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_OUTCOME_BYTES",
    "Arrival",
    "MeetingKeys",
    "MeetingOutcome",
    "WorldRecord",
    "check_arrivals",
    "decide",
    "dense_rank_map",
    "handshake_timeout",
    "parse",
    "validate_arguments",
    "world_prefix",
]

# An arrival is a few hundred bytes; a outcome lists ranks (about 7 bytes each), so 8 MiB covers
# a million ranks. Anything larger is a bug or hostile and is not parsed.
MAX_ARRIVAL_BYTES = 4 * 1024
MAX_OUTCOME_BYTES = 8 * 1024 * 1024


class Arrival(BaseModel):
    """What one rank writes when it reaches the meeting.

    Attributes:
        rank: its rank in the world being left.
        world_size: the size of the world being left.
        generation: the generation being left (the meeting builds ``generation + 1``).
        backend: the backend of the world being left; the new world uses the same.
        allow_shrink: what the rank passed to ``rebuild_world``.
        host: its hostname, for messages.
        pid: its process id, for messages.
        origin: its rank in generation 0 (its launch rank), which a restarted process keeps.
        rejoined: a restarted process taking the place of rank ``rank``, which died: it holds no
            state and is healed from a live peer (:func:`ncclguard.heal_from_peer`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    generation: int = Field(ge=0)
    backend: str = Field(min_length=1, max_length=64)
    allow_shrink: bool
    host: str = Field(max_length=255)
    pid: int = Field(ge=0)
    origin: int | None = Field(default=None, ge=0)
    rejoined: bool = False


class MeetingOutcome(BaseModel):
    """The meeting's outcome, settled once by compare-and-set and read by every rank.

    Attributes:
        arrived: old ranks whose arrival was in the store when the outcome was settled (sorted).
        ok: a new world is built, of the ranks in ``arrived``.
        shrunk: the new world leaves out ranks that did not arrive (``allow_shrink``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrived: list[int] = Field(max_length=1 << 20)
    ok: bool
    shrunk: bool = False

    def missing(self, world_size: int) -> list[int]:
        """The old ranks that had not arrived when the outcome was settled (sorted)."""
        there = set(self.arrived)
        return [r for r in range(world_size) if r not in there]


def decide(arrived: list[int], world_size: int, allow_shrink: bool) -> MeetingOutcome:
    """The outcome of a meeting given who had arrived when it was settled.

    Args:
        arrived: old ranks present (any order, no duplicates).
        world_size: the size of the world being left.
        allow_shrink: the settling rank's choice.

    Returns:
        ``ok`` when every rank arrived, or when shrinking is allowed (the arrived ranks go on).
    """
    ranks = sorted(set(arrived))
    if any(r < 0 or r >= world_size for r in ranks):
        raise ValueError(f"arrived ranks {ranks} outside a world of {world_size}")
    everyone = len(ranks) == world_size
    return MeetingOutcome(arrived=ranks, ok=everyone or (allow_shrink and bool(ranks)), shrunk=not everyone)


def dense_rank_map(members: list[int]) -> dict[int, int]:
    """Old rank to new rank: the survivors keep their order and are numbered 0, 1, 2, ..."""
    return {old: new for new, old in enumerate(sorted(members))}


def check_arrivals(outcome: MeetingOutcome, arrivals: dict[int, Arrival], world_size: int) -> str | None:
    """What makes a settled meeting unusable, or None. Every member computes the same answer
    from the same arrivals, so all of them refuse together or go on together.

    Args:
        outcome: the settled outcome.
        arrivals: the parsed arrival of each rank in ``outcome.arrived`` (unreadable ones absent).
        world_size: the size of the world being left, as this rank knows it.
    """
    unreadable = [r for r in outcome.arrived if r not in arrivals]
    if unreadable:
        return f"ranks {unreadable} wrote an arrival that could not be read"
    wrong_rank = [r for r, a in arrivals.items() if a.rank != r]
    if wrong_rank:
        return f"ranks {wrong_rank} wrote under another rank's key"
    for name in ("world_size", "backend", "generation"):
        # A restarted process may not know the backend before it joins: it takes the world's.
        seen = {getattr(a, name) for a in arrivals.values() if not (name == "backend" and a.rejoined)}
        if len(seen) > 1:
            listing = ", ".join(f"rank {r}: {getattr(a, name)!r}" for r, a in sorted(arrivals.items()))
            return f"the ranks disagree on the {name.replace('_', ' ')} they leave ({listing})"
    if arrivals and next(iter(arrivals.values())).world_size != world_size:
        return f"the ranks left a world of {next(iter(arrivals.values())).world_size}, this rank one of {world_size}"
    if outcome.shrunk and outcome.ok:
        # A restarted process never objects to the others going on without someone else.
        refused = [r for r, a in sorted(arrivals.items()) if not a.allow_shrink and not a.rejoined]
        if refused:
            return (
                f"ranks {refused} passed allow_shrink=False but another rank settled a shrink; "
                "pass the same allow_shrink on every rank"
            )
    return None


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes | str, limit: int) -> M:
    """Parses a peer's JSON into ``model``, refusing anything over ``limit`` bytes: the store
    layer's codec (:func:`ncclguard.store.codec.decode`), its errors naming "a peer's value".

    Raises:
        ValueError: too large, not JSON, not the model's shape, or holding a non-finite number
            (a :class:`~ncclguard.store.codec.DecodeError`).
    """
    return decode(model, raw, "a peer's value", limit)


def validate_arguments(timeout: Any, allow_shrink: Any) -> float:
    """Checks ``rebuild_world``'s arguments; returns the timeout in seconds.

    Raises:
        TypeError: ``timeout`` is not a number or timedelta, or ``allow_shrink`` not a bool.
        ValueError: ``timeout`` is not a positive, finite duration.
    """
    if not isinstance(allow_shrink, bool):
        raise TypeError(f"allow_shrink must be True or False, got {allow_shrink!r}")
    return to_seconds(timeout, "timeout")


def handshake_timeout(timeout_s: float, remaining_s: float) -> float:
    """The bound on building the new group once the members are known: what is left of the
    caller's timeout, and at least a quarter of it (never under 2 s), because a shrink settles
    only when the timeout has run out and the members still have to connect."""
    return max(remaining_s, timeout_s / 4, 2.0)
