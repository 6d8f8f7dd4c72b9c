"""The meeting of a rebuild, in the job's store: who is still there, settled once for everyone; and
its pure rules: what ranks write to the store, how the meeting is decided, how survivors are
renumbered. The rules (:func:`decide`, :func:`check_arrivals`, :func:`dense_rank_map` and the rest)
are plain functions of their arguments, with no store and no process group: each is testable alone.

A rebuild toward generation ``G`` meets under ``ncclguard/rebuild/g<G>/t<T>`` in the job's store
(the keys: :class:`ncclguard.store.keys.MeetingKeys`, re-exported here), ``T`` being the
attempt: every rank counts its own attempts toward ``G``, so the n-th call of each rank meets the
n-th call of the others, as ncclguard's other rounds do.

The meeting is the store layer's settle-once round (:func:`ncclguard.store.rounds.settle_round`)
with keys from :class:`~ncclguard.store.keys.MeetingKeys`:

1. each rank writes its :class:`Arrival` under ``a<rank>`` and increments ``n``;
2. the rank that makes ``n`` equal the world size settles the outcome ``v`` (everyone arrived)
   with compare-and-set; the others wait for ``v`` until their deadline, then settle it
   themselves from the arrivals present then. compare-and-set makes the first settlement final:
   every rank, late ones included, reads the same outcome, so all agree on the new world;
3. each rank named in the outcome increments ``gone`` when it leaves; the last one deletes the
   attempt's keys but the outcome, which stays (a few bytes) so that a rank arriving late learns
   at once that it was left out. Through the node tier nobody counts itself out: once the new
   world's group is built, each member deletes its share of the keys (:func:`forget_meeting`).

The whole attempt is bounded by its deadline (plus the round's grace): a store whose host is cut
off never answers ``add``/``set``.

The communicator is never touched: the meeting works however broken the old group is.

Beside the meeting, a rebuild keeps in the store the job's current world (:func:`record_new_world`,
which a restarted process reads to find its place) and reads the death count a new world starts
from (:func:`deaths_before`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed import DistStoreError

from ncclguard._log import log
from ncclguard.deadlines import Deadline, to_seconds
from ncclguard.errors import StoreUnreachable
from ncclguard.store.clients import unprefixed
from ncclguard.store.codec import DecodeError, decode, decode_outcome, encode
from ncclguard.store.deaths import STUCK_RC, deaths_so_far, read_deaths
from ncclguard.store.keys import MeetingKeys, world_prefix
from ncclguard.store.rounds import Members, Peek, Rule, settle_round
from ncclguard.store.tier_round import TierKeys, TierPeek, TierPlace, forget_tiered, node_deadline, settle_tiered
from ncclguard.store.world_record import MAX_RECORD_BYTES, WorldRecord, write_world_record
from ncclguard.world import World, current_world

__all__ = [
    "MAX_ARRIVAL_BYTES",
    "MAX_OUTCOME_BYTES",
    "MAX_RECORD_BYTES",
    "Arrival",
    "Meeting",
    "MeetingKeys",
    "MeetingOutcome",
    "Roster",
    "WorldRecord",
    "check_arrivals",
    "deaths_before",
    "decide",
    "dense_rank_map",
    "forget_meeting",
    "handshake_timeout",
    "meet",
    "parse",
    "record_new_world",
    "validate_arguments",
    "with_roster",
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


class Roster(BaseModel):
    """What the members need of each other's arrivals, read once by the settling rank and put in
    the outcome (a meeting through the node tier, where no member reads the arrivals).

    Attributes:
        origins: each arrived rank's launch rank, in the order of ``arrived``.
        rejoined: the arrived ranks that are restarted processes.
        problem: why the members refuse the outcome (:func:`check_arrivals`), or None.
        world_size: the size of the world the arrivals say they leave.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    origins: list[int] = Field(max_length=1 << 20)
    rejoined: list[int] = Field(default_factory=list, max_length=1 << 20)
    problem: str | None = Field(default=None, max_length=2000)
    world_size: int = Field(ge=1)


class MeetingOutcome(BaseModel):
    """The meeting's outcome, settled once by compare-and-set and read by every rank.

    Attributes:
        arrived: old ranks whose arrival was in the store when the outcome was settled (sorted).
        ok: a new world is built, of the ranks in ``arrived``.
        shrunk: the new world leaves out ranks that did not arrive (``allow_shrink``).
        roster: the members' origins and the settling rank's check of the arrivals (a meeting
            through the node tier); None where each member reads the arrivals itself.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrived: list[int] = Field(max_length=1 << 20)
    ok: bool
    shrunk: bool = False
    roster: Roster | None = None

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


# The meeting, in the store.


@dataclass
class Meeting:
    """What one attempt told this rank.

    Attributes:
        outcome: the settled outcome, the same on every rank.
        late: this rank's arrival was not in the store when the outcome was settled.
        problem: why the members refuse a settled ``ok`` outcome (they disagree), or None.
        elapsed_s: seconds spent meeting.
        tiered: through the node tier, its keys, this rank's place and how it went through
            (``settle_tiered``'s path, for :func:`forget_meeting`); None for a flat meeting, whose
            last member deleted its keys.
    """

    outcome: MeetingOutcome
    late: bool
    problem: str | None = None
    elapsed_s: float = 0.0
    tiered: tuple[MeetingKeys, TierPlace, str] | None = None

    @property
    def goes_on(self) -> bool:
        """This rank is in the new world."""
        return self.outcome.ok and not self.late and self.problem is None

    def origins(self) -> list[int]:
        """Each member's launch rank, in the order of ``outcome.arrived`` (from the outcome's roster;
        without one, which no member goes on with, the old ranks themselves)."""
        roster = self.outcome.roster
        return list(roster.origins) if roster is not None else list(self.outcome.arrived)

    def rejoined(self) -> list[int]:
        """The members (old ranks) that are restarted processes."""
        roster = self.outcome.roster
        return list(roster.rejoined) if roster is not None else []


def _stuck_reader(store: dist.Store, size: int) -> Callable[[], set[int]]:
    """A reader of the ranks a peer's outcome judged stuck (their death notices carry
    :data:`~ncclguard.store.deaths.STUCK_RC`), in this world's numbering: the meeting settles without
    waiting its deadline for them. A killed rank's notice does not count here: its restart may rejoin."""
    world = current_world()
    job = unprefixed(store)  # the notices are in the job's store
    seen, stuck = world.deaths_seen, set[int]()
    by_origin = {world.origin(r): r for r in range(size)}

    def known() -> set[int]:
        nonlocal seen
        seen, notices = read_deaths(job, seen)
        stuck.update(by_origin[n.origin] for n in notices if n.returncode == STUCK_RC and n.origin in by_origin)
        return stuck

    return known


def with_roster(outcome: MeetingOutcome, raw: dict[int, bytes], world_size: int) -> MeetingOutcome:
    """``outcome`` with its :class:`Roster`, from the arrivals ``raw`` of its arrived ranks (read once,
    by the settling rank).

    Args:
        outcome: the outcome decided.
        raw: the arrived ranks' arrivals as the store holds them.
        world_size: the size of the world being left, as the settling rank knows it.
    """
    arrivals: dict[int, Arrival] = {}
    for rank, blob in raw.items():
        try:
            arrivals[rank] = decode(Arrival, blob, f"rank {rank}'s arrival", MAX_ARRIVAL_BYTES)
        except DecodeError as exc:
            log.error("rebuild: rank %d's arrival is unreadable (%s)", rank, exc)
    problem = check_arrivals(outcome, arrivals, world_size) if outcome.ok else None
    origins = [a.origin if (a := arrivals.get(r)) is not None and a.origin is not None else r for r in outcome.arrived]
    rejoined = [r for r in outcome.arrived if (a := arrivals.get(r)) is not None and a.rejoined]
    left = next(iter(arrivals.values())).world_size if arrivals else world_size
    roster = Roster(origins=origins, rejoined=rejoined, problem=problem[:2000] if problem else None, world_size=left)
    return outcome.model_copy(update={"roster": roster})


def _rule(
    keys: MeetingKeys, size: int, allow_shrink: bool, stuck: Callable[[], set[int]] | None, peek: Peek, tiered: bool
) -> Rule[MeetingOutcome]:
    """The meeting's rule: the settling rank reads the arrived ranks' arrivals once (through
    ``peek``) and puts their :class:`Roster` in the outcome, so that no member reads them (every
    member reading every arrival was n² bytes: 76 s of the store's CPU at 4,096 ranks,
    benchmarks/commit_tier_scale.py). Flat, the members still count themselves out and the last one
    deletes the keys; through the node tier (``tiered``), nobody does."""

    def read(raw: bytes) -> MeetingOutcome:
        return decode_outcome(MeetingOutcome, raw, "the rebuild's outcome", keys.outcome, MAX_OUTCOME_BYTES)

    def settle(outcome: MeetingOutcome, seen: Peek) -> str:
        return encode(with_roster(outcome, seen.arrivals(outcome.arrived), size))

    def given_up(seen: Peek) -> str:
        return settle(decide(seen.present(), size, allow_shrink), seen)

    def early(seen: Peek) -> str | None:
        assert stuck is not None
        gone = stuck()
        if not gone:  # the usual case: nothing to read (through the tier, a read of every node's value)
            return None
        present = seen.present()
        if any(r not in present for r in range(size) if r not in gone):
            return None
        return settle(decide([r for r in present if r not in gone], size, allow_shrink), seen)

    def members(outcome: MeetingOutcome) -> Members:
        return Members((), True) if tiered else Members(outcome.arrived, complete=True, read=False)

    return Rule(
        everyone=lambda: settle(decide(list(range(size)), size, False), peek),
        given_up=given_up,
        read=read,
        early=early if stuck is not None else None,
        members=members,
        keep_outcome=True,
    )


def meet(store: dist.Store, me: Arrival, attempt: int, deadline: Deadline, tier: TierPlace | None = None) -> Meeting:
    """Runs one attempt of the meeting toward generation ``me.generation + 1``.

    Args:
        store: the job's store (the same server on every rank).
        me: this rank's arrival.
        attempt: this rank's count of earlier attempts toward that generation.
        deadline: when the ranks not there are given up.
        tier: where this rank stands in the node tier (``recovery/_commit/tier.py``), when the
            meeting goes through it: the node's ranks meet in their node's store first, and the
            outcome carries the members' :class:`Roster` (docs/scale.md).

    Returns:
        The meeting as this rank saw it.

    Raises:
        StoreUnreachable: the store did not answer, or wrote a outcome that cannot be read.
    """
    start = time.monotonic()
    keys = MeetingKeys(me.generation + 1, attempt)
    size = me.world_size
    try:
        if tier is not None:
            return _meet_tiered(store, me, keys, tier, deadline, start)
        rule = _rule(keys, size, me.allow_shrink, _stuck_reader(store, size), Peek(store, keys, size), False)
        settled = settle_round(store, keys, me.rank, size, encode(me), deadline, rule, "the rebuild meeting")
    except (DistStoreError, RuntimeError) as exc:  # connection refused / reset surface as RuntimeError
        if isinstance(exc, StoreUnreachable):  # no answer by the deadline, or an unreadable outcome
            raise
        raise StoreUnreachable(f"the job's store did not answer during the rebuild meeting: {exc}") from exc
    return _meeting(settled.outcome, me, settled.arrivals is None, start)


def _meet_tiered(
    store: dist.Store, me: Arrival, keys: MeetingKeys, tier: TierPlace, deadline: Deadline, start: float
) -> Meeting:
    """The meeting through the node tier (:func:`~ncclguard.store.tier_round.settle_tiered`)."""
    size = me.world_size
    peek = TierPeek(store, TierKeys(keys), tier, MAX_ARRIVAL_BYTES)
    rule = _rule(keys, size, me.allow_shrink, _stuck_reader(store, size), peek, True)
    settled, path = settle_tiered(
        store, keys, tier, encode(me), deadline, rule, node_by=node_deadline(deadline, deadline.left()), peek=peek
    )
    log.info("rebuild: the meeting through the node tier (%s): ranks %s arrived", path, settled.outcome.arrived)
    meeting = _meeting(settled.outcome, me, me.rank not in settled.outcome.arrived, start)
    meeting.tiered = (keys, tier, path)
    return meeting


def forget_meeting(store: dist.Store, meeting: Meeting, deadline: Deadline) -> None:
    """Deletes a meeting's keys through the node tier but its outcome, once the new world's group is
    built (every member has read the outcome then): each node's carrier its node's keys, a member
    that went alone its arrival, the first member the job's counters
    (:func:`~ncclguard.store.tier_round.forget_tiered`). A flat meeting's keys are gone already.

    Args:
        store: the job's store.
        meeting: this rank's meeting, which it goes on from.
        deadline: when to stop waiting for the stores (a store that fails leaves its keys).
    """
    if meeting.tiered is None or not meeting.goes_on:
        return
    keys, place, path = meeting.tiered
    forget_tiered(store, keys, place, path, deadline, counters_by=meeting.outcome.arrived[0], keep_outcome=True)


def _meeting(outcome: MeetingOutcome, me: Arrival, late: bool, start: float) -> Meeting:
    """The meeting as this rank saw it, from the outcome's roster: whether its members refuse it
    (the settling rank's check of the arrivals, and this rank's own world size)."""
    if late:  # not in the outcome
        return Meeting(outcome, True, elapsed_s=time.monotonic() - start)
    return Meeting(outcome, False, _refusal(outcome, me), time.monotonic() - start)


def _refusal(outcome: MeetingOutcome, me: Arrival) -> str | None:
    """Why the members refuse an ``ok`` outcome, or None (see :func:`_meeting`)."""
    roster = outcome.roster
    if not outcome.ok:
        return None
    if roster is None:
        return "the meeting's outcome names no roster (a rank of another ncclguard version settled it)"
    if roster.world_size != me.world_size:
        return f"the ranks left a world of {roster.world_size}, this rank one of {me.world_size}"
    return roster.problem


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
