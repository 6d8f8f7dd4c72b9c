"""The settle-once round: every rank publishes, and one outcome, settled once, holds for all.

This is the one protocol behind the collectives' rounds (:func:`ncclguard.collectives.rendezvous.exchange`:
safe_barrier, the fingerprint check of safe_all_reduce, the integrations' agreements) and the
recovery meeting (:func:`ncclguard.recovery._rebuild.meeting.meet`). It never touches a communicator, so it
works on a group whose NCCL or gloo communicator is broken. For a round with keys ``K``
(:class:`~ncclguard.store.keys.RoundKeys`) among ``size`` ranks:

1. each rank sets its arrival ``K.arrival(rank)`` and increments ``K.count``; the value ``add``
   returns is its arrival number;
2. the rank whose number reaches ``size`` settles the outcome ``K.outcome`` to
   ``rule.everyone()`` with compare-and-set; the others wait for the outcome until the deadline,
   then try to settle it to ``rule.given_up(peek)`` (which may look at the count or the arrivals
   present then). compare-and-set makes the first settlement final, so every rank, late ones
   included, reads the same outcome; a rank whose arrival number is above the count the outcome
   records (or who is not among the members it names) knows it came late;
3. the outcome names its members (``rule.members``): the ranks that read the arrivals and count
   themselves out under ``K.gone``. The last member out deletes the round's keys (the outcome
   too, unless ``rule.keep_outcome``: a kept outcome tells a rank arriving after everyone left
   what was settled), so a loop of rounds leaves the store small.

The whole round runs on the calling thread's store helper (:func:`~ncclguard.store.bounded.bounded_store_call`),
bounded by the deadline plus :data:`GRACE_S`: a store whose host is cut off never answers
``add``/``set``, and a round must still end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.distributed as dist
from torch.distributed import DistStoreError

from ncclguard.deadlines import Deadline
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.keys import RoundKeys

__all__ = ["GRACE_S", "Members", "Peek", "Rule", "Settled", "read_present", "settle_round", "wait_for"]

T = TypeVar("T")

# Past the round's deadline, the time left for the outcome and the clean-up (a few store calls).
GRACE_S = 1.0
MAX_SLEEP_S = 0.5  # the longest sleep between two looks at a round's outcome (with an early rule)


def wait_for(store: dist.Store, key: str, deadline: Deadline) -> bool:
    """Waits until ``key`` exists in ``store``, until ``deadline`` at most.

    Args:
        store: the store.
        key: the key.
        deadline: when to stop waiting (a millisecond is given at least: a zero timedelta would
            mean the store's default).

    Returns:
        True when the key exists, False when the wait timed out.

    Raises:
        RuntimeError: the store failed otherwise (connection refused or reset).
    """
    try:
        store.wait([key], deadline.as_timedelta())
        return True
    except DistStoreError:
        return False


def read_present(store: dist.Store, keys: Sequence[str]) -> dict[str, bytes]:
    """Reads those of ``keys`` that exist: one ``check`` of them all (true when every one exists, the
    usual case), else one ``check`` per key; then one ``multi_get``.

    ``multi_get`` fails (or waits) as a whole on a missing key, hence the checks. The caller makes
    sure no key it checked can be deleted before the read (in a round: only the last member out
    deletes). Unbounded: call it inside a bounded call (:func:`~ncclguard.store.bounded.bounded_store_call`).

    Args:
        store: the store.
        keys: the keys to read.

    Returns:
        The raw values by key, for the keys present.
    """
    if keys and store.check(list(keys)):
        present = list(keys)
    else:
        present = [k for k in keys if store.check([k])]
    if not present:
        return {}
    return dict(zip(present, store.multi_get(present), strict=True))


class Peek:
    """What a rank whose deadline passed may look at before settling the outcome.

    Args:
        store: the round's store.
        keys: the round's keys.
        size: the round's group size.
    """

    def __init__(self, store: dist.Store, keys: RoundKeys, size: int) -> None:
        self._store, self._keys, self._size = store, keys, size

    def count(self) -> int:
        """The number of ranks that have arrived so far.

        Returns:
            The arrival count.
        """
        return int(self._store.add(self._keys.count, 0))

    def present(self) -> list[int]:
        """The ranks whose arrival is in the store now (sorted).

        Returns:
            The ranks.
        """
        keys = [self._keys.arrival(r) for r in range(self._size)]
        return sorted(self._keys.rank_of(k) for k in read_present(self._store, keys))

    def arrivals(self, ranks: Sequence[int] | None = None, *, complete: bool = False) -> dict[int, bytes]:
        """The raw arrivals of ``ranks`` (default: every rank) that are in the store now.

        Args:
            ranks: whose arrivals to read.
            complete: every one of them is known to be there (one ``multi_get``, no checks).

        Returns:
            The raw arrivals by rank.
        """
        wanted = list(range(self._size)) if ranks is None else list(ranks)
        keys = [self._keys.arrival(r) for r in wanted]
        if complete:
            return dict(zip(wanted, self._store.multi_get(keys), strict=True))
        return {self._keys.rank_of(k): v for k, v in read_present(self._store, keys).items()}


@dataclass(frozen=True)
class Members:
    """The ranks an outcome names as the round's members.

    Attributes:
        ranks: the members: they read the arrivals, and the last of them out cleans up. A rank not
            among them leaves at once, reading nothing.
        complete: every member's arrival was in the store when the outcome was settled, so all of
            them are read in one ``multi_get``; otherwise each is checked first.
        read: the members read the arrivals (False: the outcome says what they need of them, and
            they only count themselves out; every member reading every arrival is n² bytes).
    """

    ranks: Sequence[int]
    complete: bool
    read: bool = True


@dataclass(frozen=True)
class Rule(Generic[T]):
    """How a round settles and reads its outcome.

    Attributes:
        everyone: the outcome to settle when every rank arrived (JSON or plain text).
        given_up: the outcome to settle when this rank's deadline passed first.
        read: the outcome's raw value into what the caller uses (may raise: the round ends with it).
        members: the members the outcome names.
        keep_outcome: the last member out leaves the outcome in the store.
        early: while a rank waits, the outcome to settle before the deadline, or None to wait on
            (a commit settles at once when the ranks missing are known dead). Asked every
            ``poll_s`` at first, less often the longer the wait.
        poll_s: how often ``early`` is asked at first.
    """

    everyone: Callable[[], str]
    given_up: Callable[[Peek], str]
    read: Callable[[bytes], T]
    members: Callable[[T], Members]
    keep_outcome: bool = False
    early: Callable[[Peek], str | None] | None = None
    poll_s: float = 0.1


@dataclass(frozen=True)
class Settled(Generic[T]):
    """One round as this rank saw it.

    Attributes:
        outcome: the settled outcome, read by ``rule.read``: the same on every rank.
        number: this rank's arrival number (1 for the first to arrive).
        arrivals: raw arrivals by rank, of the members whose arrival was there; None when this rank
            is not a member (it read nothing).
        elapsed_s: seconds spent in the round.
    """

    outcome: T
    number: int
    arrivals: dict[int, bytes] | None
    elapsed_s: float


def _wait_outcome(store: dist.Store, keys: RoundKeys, size: int, deadline: Deadline, rule: Rule[T]) -> bytes:
    """The outcome once another rank settles it; else, past the deadline or as soon as ``rule.early``
    has one, the outcome this rank settles (compare-and-set: the first settlement stands)."""
    peek = Peek(store, keys, size)
    if rule.early is None:
        if wait_for(store, keys.outcome, deadline):
            return bytes(store.get(keys.outcome))
        return bytes(store.compare_set(keys.outcome, "", rule.given_up(peek)))
    # Polled with check: a wait that times out logs two warning lines in torch 2.13's TCPStore
    # client, and a wait in slices would log them at every slice. The sleeps grow with the time
    # waited (a quarter of it, 1 ms to MAX_SLEEP_S): the outcome is seen at most a quarter late, in
    # a few dozen requests a minute; ``early`` is asked every ``poll_s`` at first, then less often.
    start = time.monotonic()
    ask_at = start
    while (now := time.monotonic()) < deadline.at:
        if store.check([keys.outcome]):
            return bytes(store.get(keys.outcome))
        if now >= ask_at:
            outcome = rule.early(peek)
            if outcome is not None:
                return bytes(store.compare_set(keys.outcome, "", outcome))
            ask_at = now + min(rule.poll_s + (now - start) / 10, MAX_SLEEP_S * 4)
        deadline.sleep(max(min((now - start) / 4, MAX_SLEEP_S), 0.001))
    return bytes(store.compare_set(keys.outcome, "", rule.given_up(peek)))


def settle_round(
    store: dist.Store,
    keys: RoundKeys,
    rank: int,
    size: int,
    arrival: str,
    deadline: Deadline,
    rule: Rule[T],
    what: str,
    grace_s: float = GRACE_S,
) -> Settled[T]:
    """Runs one settle-once round (see the module's docstring).

    Args:
        store: the store that carries the round (the same server on every rank).
        keys: the round's keys, the same on every rank.
        rank: this rank, in ``0..size-1``.
        size: the number of ranks of the round.
        arrival: what this rank publishes (JSON text; see :func:`ncclguard.store.codec.encode`).
        deadline: when the ranks not there are given up.
        rule: how the outcome is settled and read.
        what: how to name the round in a timeout error (``round 'barrier/g/3'``).
        grace_s: seconds past ``deadline`` left for settling, reading and cleaning up.

    Returns:
        The round as this rank saw it.

    Raises:
        StoreUnreachable: the store did not answer by ``deadline + grace_s``, or an earlier call on
            it is still stuck.
        DistStoreError, RuntimeError: the store failed (connection refused or reset).
        Whatever ``rule.read`` raises.
    """
    start = time.monotonic()

    def body() -> Settled[T]:
        store.set(keys.arrival(rank), arrival)
        number = int(store.add(keys.count, 1))
        if number >= size:
            raw = store.compare_set(keys.outcome, "", rule.everyone())
        else:
            raw = _wait_outcome(store, keys, size, deadline, rule)
        outcome = rule.read(bytes(raw))
        members = rule.members(outcome)
        if rank not in members.ranks:
            return Settled(outcome, number, None, time.monotonic() - start)
        wanted = [keys.arrival(r) for r in members.ranks]
        if not members.read:
            arrivals: dict[int, bytes] = {}
        elif members.complete:
            arrivals = dict(zip(members.ranks, store.multi_get(wanted), strict=True))
        else:
            arrivals = {keys.rank_of(k): v for k, v in read_present(store, wanted).items()}
        if int(store.add(keys.gone, 1)) >= len(members.ranks):
            for key in keys.transient(size) if rule.keep_outcome else keys.every(size):
                store.delete_key(key)
        return Settled(outcome, number, arrivals, time.monotonic() - start)

    return bounded_store_call(store, body, deadline.plus(grace_s), what)
