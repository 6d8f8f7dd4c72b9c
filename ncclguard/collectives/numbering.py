"""The numbers of rounds and calls: every rank counts its own, so the n-th of each rank meets the
n-th of the others.

One count per group for every kind of safe_* call (:func:`next_call`; a tag that every rank passed
restarts it, :func:`realign_on_tag`), and one per round kind for the other rounds
(:func:`next_round`). The counts are per World (:data:`COUNTS`): a rebuilt world's groups may reuse
the old names, and the ranks counted the old calls unevenly.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from ncclguard.collectives.groups import GroupInfo
from ncclguard.world import Slot, World, current_world

__all__ = [
    "COUNTS",
    "CallCount",
    "Counts",
    "call_count",
    "call_round",
    "next_call",
    "next_round",
    "realign_on_tag",
    "take_number",
]


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
    """This world's round and call counts (one per World: a rebuilt world's groups may reuse the old
    names, and the ranks counted the old rounds unevenly).

    Attributes:
        lock: guards the maps.
        seqs: the next round number per (group name, round kind).
        calls: call counts by (group name, this rank's rank in it): one process is one rank, but
            tests run ranks as threads.
    """

    def __init__(self, world: World) -> None:
        self.lock = threading.Lock()
        self.seqs: dict[tuple[str, str], itertools.count] = defaultdict(itertools.count)
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
