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

This module keeps the hostnames rounds teach; the rounds' and calls' numbers are in
:mod:`ncclguard.collectives.numbering`; the store work is in :mod:`ncclguard.store`.
"""

from __future__ import annotations

import functools
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
    "HOSTS",
    "LearnedHosts",
    "store_for_this_thread",
    "read_present",
]

# The largest arrival a rank accepts from a peer. Payloads are fingerprints, outcomes and
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


class LearnedHosts:
    """The hostnames this world's rounds taught, by group rank, per group name (one per World: a
    rebuilt world's groups may reuse the old names)."""

    def __init__(self, world: World) -> None:
        self.by_group: dict[str, dict[int, str]] = defaultdict(dict)


HOSTS: Slot[LearnedHosts] = Slot("hosts learned from rounds", LearnedHosts)


def known_hosts(info: GroupInfo) -> dict[int, str]:
    """Hostnames by group rank learned from earlier rounds on this group."""
    return dict(current_world().get(HOSTS).by_group[info.name])


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
    # The outcome records how many ranks had arrived, so a rank can tell whether it came before
    # the outcome (on time, only slower to notice) or after it (late).
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
        # cast: None only for a group torch does not know (an abandoned world's): the round then
        # fails at its first store call (AttributeError).
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
    hosts = current_world().get(HOSTS).by_group[info.name]
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
