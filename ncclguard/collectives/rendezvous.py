"""A round of JSON exchange over a group's store, bounded by a deadline, that every rank agrees on.

This is the one mechanism behind safe_barrier, the fingerprint check of safe_all_reduce and the
cross-rank agreements of the integrations. It never touches the communicator, so it works on a
group whose NCCL or gloo communicator is broken, and it never unpickles: what a peer wrote is
size-bounded JSON, parsed by a pydantic model.

The round is the store layer's settle-once round (:func:`ncclguard.store.rounds.settle_round`),
with keys below ``ncclguard/<name>`` (:func:`ncclguard.store.keys.round_keys`):

1. each rank sets ``r<rank>`` to its payload and increments ``n``;
2. the rank that makes ``n`` equal the group size settles the outcome ``o`` to ``ok`` with
   compare-and-set; the others wait for ``o`` until the deadline, then try to settle it to
   ``timeout <n>`` (with the arrival count then). compare-and-set makes the first settlement
   final, so every rank, late ones included, reads the same outcome, and a rank whose arrival
   number is above that count knows it came late;
3. each rank increments ``gone`` when it leaves; the last one deletes the round's keys, so a
   loop of rounds leaves the store small.

This module keeps the per-group state (round counts, call counts, learned hostnames); the
store work is in :mod:`ncclguard.store`.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ConfigDict, Field
from torch.distributed import DistStoreError

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.collectives.groups import GroupInfo
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.codec import DecodeError, decode, encode
from ncclguard.store.keys import round_keys
from ncclguard.store.rounds import Members, Peek, Rule, read_present, settle_round
from ncclguard.world import Slot, World, current_world

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "MAX_ARRIVAL_BYTES",
    "RoundResult",
    "StoreUnreachable",
    "exchange",
    "known_hosts",
    "call_count",
    "call_round",
    "next_call",
    "take_number",
    "realign_on_tag",
    "store_for_this_thread",
    "next_round",
    "read_present",
    "COUNTS",
    "CallCount",
    "Counts",
]

# The largest arrival a rank accepts from a peer. Payloads are fingerprints, verdicts and
# environment reports: a few KiB. Anything larger is a bug or hostile, and is not parsed.
MAX_ARRIVAL_BYTES = 256 * 1024


class _Arrival(BaseModel):
    """What one rank writes for a round: its hostname and its payload (any JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(max_length=255)
    payload: Any = None


@dataclass
class RoundResult:
    """What one round told this rank.

    Attributes:
        ok: every rank of the group arrived before the deadline, with a readable payload.
        payloads: payloads by group rank, for every rank that arrived.
        missing: group ranks whose payload this rank did not find (or could not read) after the
            outcome was settled (sorted; empty when ``ok``).
        late: the round had already been given up when this rank arrived.
        elapsed_s: seconds this rank spent in the round.
    """

    ok: bool
    payloads: dict[int, Any] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    late: bool = False
    elapsed_s: float = 0.0


@dataclass
class CallCount:
    """This rank's count of safe_* calls on one group.

    Attributes:
        current: (base, counter): the round names' prefix, which a tag that every rank passed
            changes, and the count since then. Replaced as one tuple, and ``next()`` on an
            ``itertools.count`` is atomic, so taking a number needs no lock (the hot path).
        tag_uses: how often each tag was used.
    """

    current: tuple[str, itertools.count] = field(default_factory=lambda: ("", itertools.count()))
    tag_uses: dict[str, int] = field(default_factory=dict)


class Counts:
    """This world's round counts and the hostnames its rounds taught (one per World: a rebuilt
    world's groups may reuse the old names, and the ranks counted the old rounds unevenly).

    Attributes:
        lock: guards the maps.
        seqs: the next round number per (group name, round kind).
        hosts: hostnames by group rank, per group name, learned from rounds.
        calls: call counts by (group name, this rank's rank in it): one process is one rank, but
            tests run ranks as threads.
    """

    def __init__(self, world: World) -> None:
        self.lock = threading.Lock()
        self.seqs: dict[tuple[str, str], itertools.count] = defaultdict(itertools.count)
        self.hosts: dict[str, dict[int, str]] = defaultdict(dict)
        self.calls: dict[tuple[str, int], CallCount] = defaultdict(CallCount)


COUNTS: Slot[Counts] = Slot("round counts", Counts)


def _counts() -> Counts:
    return current_world().get(COUNTS)


def next_round(info: GroupInfo, kind: str) -> str:
    """Returns the name of this rank's next round of ``kind`` on the group.

    Every rank counts its own calls, so the n-th call of each rank meets the n-th of the others.
    """
    counts = _counts()
    with counts.lock:
        return f"{kind}/{info.name}/{next(counts.seqs[(info.name, kind)])}"


def call_count(info: GroupInfo) -> CallCount:
    """This rank's call count on the group in this world (one object per group name and rank; a
    holder of it, like the hot path's group state, belongs to the same world)."""
    counts = _counts()
    with counts.lock:
        return counts.calls[(info.name, info.rank)]


def take_number(count: CallCount) -> tuple[str, int]:
    """Takes the next number of ``count``: returns (its base, the number)."""
    base, counter = count.current
    return base, next(counter)


def call_round(info: GroupInfo, base: str, n: int) -> str:
    """The round name of call number ``n`` after ``base`` on the group."""
    return f"call/{info.name}/{base}{n}"


def next_call(info: GroupInfo, tag: str | None = None) -> str:
    """Returns the round name of this rank's next safe_* call on the group.

    One count for every kind of safe call, so that a barrier and an all_reduce issued as the
    same call on different ranks meet in one round, where their fingerprints tell them apart.
    Every call takes a number, even one refused before any communication, so that the counts of
    the ranks stay equal when one rank's call is refused and another's is not.

    Args:
        info: the group.
        tag: meet under this name instead (the ranks that pass the same tag meet, however many
            calls each made before); a tag may be reused, each use is its own round.
    """
    if tag is None:
        return call_round(info, *take_number(call_count(info)))
    counts = _counts()
    with counts.lock:
        count = counts.calls[(info.name, info.rank)]
        uses = count.tag_uses.get(tag, 0)
        count.tag_uses[tag] = uses + 1
        return f"call/{info.name}/tag/{tag}#{uses}"


def realign_on_tag(info: GroupInfo, tag_round: str) -> None:
    """Restarts the group's call count from a tagged round that every rank passed.

    Every rank that passed the round restarts from the same point, so the counts agree again
    however they had drifted (a rank that made a call the others did not).
    """
    counts = _counts()
    with counts.lock:
        count = counts.calls[(info.name, info.rank)]
        count.current = (f"{tag_round.rsplit('/tag/', 1)[-1]}/", itertools.count())


def known_hosts(info: GroupInfo) -> dict[int, str]:
    """Hostnames by group rank learned from earlier rounds on this group."""
    return dict(_counts().hosts[info.name])


def _parse(blob: bytes, rank: int, name: str) -> _Arrival | None:
    """The arrival of ``rank``, or None (logged) when it is too large or not the expected JSON."""
    try:
        # finite=False: a payload is the caller's data, and NaN in it is theirs to judge.
        return decode(_Arrival, blob, f"round {name!r}: rank {rank}'s arrival", MAX_ARRIVAL_BYTES, finite=False)
    except DecodeError as exc:
        if exc.reason == "size":
            log.error("round %r: rank %d wrote %d bytes (limit %d); ignored", name, rank, exc.size, exc.limit)
        else:
            log.error("round %r: rank %d wrote an unreadable arrival; ignored (%s)", name, rank, exc.detail)
        return None


def _timed_out(peek: Peek) -> str:
    # The verdict records how many ranks had arrived, so a rank can tell whether it came before
    # the verdict (on time, only slower to notice) or after it (late).
    return f"timeout {peek.count()}"


@functools.lru_cache(maxsize=64)
def _rule(size: int) -> Rule[str]:
    everyone = range(size)
    return Rule(
        everyone=lambda: "ok",
        given_up=_timed_out,
        read=lambda raw: raw.decode(),
        # Every rank reads and counts out; after "ok" every arrival is there.
        members=lambda settled: Members(everyone, complete=settled == "ok"),
    )


def exchange(info: GroupInfo, name: str, payload: Any, deadline: Deadline) -> RoundResult:
    """Runs one round: publishes ``payload`` and collects the others' until ``deadline``.

    Args:
        info: the group (its store carries the round).
        name: the round's name, the same on every rank (see :func:`next_round`).
        payload: JSON-serialisable data for the other ranks.
        deadline: when the round is given up.

    Returns:
        The round's outcome, the same on every rank that took part.

    Raises:
        StoreUnreachable: the store did not answer.
    """
    start = time.monotonic()
    size, me = info.size, info.rank
    try:
        # cast: None only for a group torch does not know, which fails here as it always did.
        store = store_for_this_thread(cast("Store", info.store), deadline)
        # A store whose host is cut off never answers add/set: the round is bounded as a whole.
        settled = settle_round(
            store,
            round_keys(name),
            me,
            size,
            encode({"host": HOSTNAME, "payload": payload}),
            deadline,
            _rule(size),
            f"round {name!r}",
        )
    except (DistStoreError, RuntimeError) as exc:  # connection refused / reset surface as RuntimeError
        if isinstance(exc, StoreUnreachable):
            raise
        raise StoreUnreachable(f"the group's store did not answer during round {name!r}: {exc}") from exc
    outcome, _, arrived_by = settled.outcome.partition(" ")
    late = outcome != "ok" and settled.number > int(arrived_by or size)

    payloads: dict[int, Any] = {}
    hosts = _counts().hosts[info.name]
    for rank, blob in sorted((settled.arrivals or {}).items()):
        arrival = _parse(blob, rank, name)
        if arrival is not None:
            payloads[rank] = arrival.payload
            hosts[rank] = arrival.host
    missing = sorted(set(range(size)) - set(payloads))
    return RoundResult(
        ok=outcome == "ok" and not missing,
        payloads=payloads,
        missing=missing,
        late=late,
        elapsed_s=time.monotonic() - start,
    )
