"""The meeting of a rebuild, in the job's store: who is still there, settled once for everyone.

The meeting is the store layer's settle-once round (:func:`ncclguard.store.rounds.settle_round`)
with keys from :class:`~ncclguard.store.keys.MeetingKeys`:

1. each rank writes its :class:`Arrival` under ``a<rank>`` and increments ``n``;
2. the rank that makes ``n`` equal the world size settles the outcome ``v`` (everyone arrived)
   with compare-and-set; the others wait for ``v`` until their deadline, then settle it
   themselves from the arrivals present then. compare-and-set makes the first settlement final:
   every rank, late ones included, reads the same outcome, so all agree on the new world;
3. each rank named in the outcome increments ``gone`` when it leaves; the last one deletes the
   attempt's keys but the outcome, which stays (a few bytes) so that a rank arriving late learns
   at once that it was left out.

The whole attempt is bounded by its deadline (plus the round's grace): a store whose host is cut
off never answers ``add``/``set``.

The communicator is never touched: the meeting works however broken the old group is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import DistStoreError

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.recovery._rebuild.meeting_rules import (
    MAX_ARRIVAL_BYTES,
    MAX_OUTCOME_BYTES,
    Arrival,
    MeetingKeys,
    MeetingOutcome,
    check_arrivals,
    decide,
)
from ncclguard.store.clients import unprefixed
from ncclguard.store.codec import DecodeError, decode, encode
from ncclguard.store.deaths import STUCK_RC, read_deaths
from ncclguard.store.rounds import Members, Peek, Rule, settle_round
from ncclguard.world import current_world

__all__ = ["Meeting", "meet"]


@dataclass
class Meeting:
    """What one attempt told this rank.

    Attributes:
        outcome: the settled outcome, the same on every rank.
        late: this rank's arrival was not in the store when the outcome was settled.
        arrivals: the members' arrivals (empty when ``late``).
        problem: why the members refuse a settled ``ok`` outcome (they disagree), or None.
        elapsed_s: seconds spent meeting.
    """

    outcome: MeetingOutcome
    late: bool
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    problem: str | None = None
    elapsed_s: float = 0.0

    @property
    def goes_on(self) -> bool:
        """This rank is in the new world."""
        return self.outcome.ok and not self.late and self.problem is None


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


def _rule(
    keys: MeetingKeys, size: int, allow_shrink: bool, stuck: Callable[[], set[int]] | None = None
) -> Rule[MeetingOutcome]:
    def read(raw: bytes) -> MeetingOutcome:
        try:
            return decode(MeetingOutcome, raw, f"the outcome under {keys.outcome!r}", MAX_OUTCOME_BYTES)
        except DecodeError as exc:
            raise StoreUnreachable(f"the rebuild's outcome under {keys.outcome!r} cannot be read: {exc}") from exc

    def given_up(peek: Peek) -> str:
        return encode(decide(peek.present(), size, allow_shrink))

    def early(peek: Peek) -> str | None:
        assert stuck is not None
        gone = stuck()
        present = peek.present()
        if not gone or any(r not in present for r in range(size) if r not in gone):
            return None
        return encode(decide([r for r in present if r not in gone], size, allow_shrink))

    return Rule(
        everyone=lambda: encode(decide(list(range(size)), size, False)),
        given_up=given_up,
        read=read,
        early=early if stuck is not None else None,
        # Every rank in the outcome wrote its arrival before it was settled, and nobody deletes
        # before all of them have left: one multi_get finds them all.
        members=lambda outcome: Members(outcome.arrived, complete=True),
        keep_outcome=True,
    )


def meet(store: dist.Store, me: Arrival, attempt: int, deadline: Deadline) -> Meeting:
    """Runs one attempt of the meeting toward generation ``me.generation + 1``.

    Args:
        store: the job's store (the same server on every rank).
        me: this rank's arrival.
        attempt: this rank's count of earlier attempts toward that generation.
        deadline: when the ranks not there are given up.

    Returns:
        The meeting as this rank saw it.

    Raises:
        StoreUnreachable: the store did not answer, or wrote a outcome that cannot be read.
    """
    start = time.monotonic()
    keys = MeetingKeys(me.generation + 1, attempt)
    size = me.world_size
    try:
        settled = settle_round(
            store,
            keys,
            me.rank,
            size,
            encode(me),
            deadline,
            _rule(keys, size, me.allow_shrink, _stuck_reader(store, size)),
            "the rebuild meeting",
        )
    except (DistStoreError, RuntimeError) as exc:  # connection refused / reset surface as RuntimeError
        if isinstance(exc, StoreUnreachable):  # no answer by the deadline, or an unreadable outcome
            raise
        raise StoreUnreachable(f"the job's store did not answer during the rebuild meeting: {exc}") from exc
    outcome = settled.outcome
    if settled.arrivals is None:  # not in the outcome: late
        return Meeting(outcome, True, elapsed_s=time.monotonic() - start)

    arrivals: dict[int, Arrival] = {}
    for rank, blob in settled.arrivals.items():
        try:
            arrivals[rank] = decode(Arrival, blob, f"rank {rank}'s arrival", MAX_ARRIVAL_BYTES)
        except DecodeError as exc:
            log.error("rebuild: rank %d's arrival is unreadable (%s)", rank, exc)
    problem = check_arrivals(outcome, arrivals, size) if outcome.ok else None
    return Meeting(outcome, False, arrivals, problem, time.monotonic() - start)
