"""A round of JSON exchange over a group's store, bounded by a deadline, that every rank agrees on.

This is the one mechanism behind safe_barrier, the fingerprint check of safe_all_reduce and the
cross-rank agreements of the integrations. It never touches the communicator, so it works on a
group whose NCCL or gloo communicator is broken, and it never unpickles: what a peer wrote is
size-bounded JSON, parsed by a pydantic model.

Protocol for a round named ``P`` (all keys below ``ncclguard/P``):

1. each rank sets ``r<rank>`` to its payload and increments ``n``;
2. the rank that makes ``n`` equal the group size settles the outcome ``o`` to ``ok`` with
   compare-and-set; the others wait for ``o`` until the deadline, then try to settle it to
   ``timeout <n>`` (with the arrival count then). compare-and-set makes the first settlement
   final, so every rank, late ones included, reads the same outcome, and a rank whose arrival
   number is above that count knows it came late;
3. each rank increments ``gone`` when it leaves; the last one deletes the round's keys, so a
   loop of rounds leaves the store small.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.distributed import DistStoreError

from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.collectives.groups import GroupInfo
from ncclguard.errors import StoreUnreachable
from ncclguard.store.bounded import bounded_store_call
from ncclguard.world import Slot, World, current_world

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


# Past the round's deadline, the time left for the verdict and the clean-up (a few store calls).
_STORE_GRACE_S = 1.0


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


def read_present(store: Any, keys: Sequence[str]) -> dict[str, bytes]:
    """Reads those of ``keys`` that exist: one ``check`` per key, then one ``multi_get``.

    ``multi_get`` fails as a whole on a missing key, hence the checks. The caller makes sure no
    key it checked can be deleted before the read (here: only the last rank out deletes).

    Returns:
        The raw values by key, for the keys present.
    """
    present = [k for k in keys if store.check([k])]
    if not present:
        return {}
    return dict(zip(present, store.multi_get(present), strict=True))


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    try:
        # A zero timedelta would mean "the store's default"; a millisecond is "now".
        store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        return True
    except DistStoreError:
        return False


_local = threading.local()


def store_for_this_thread(store: Any, deadline: float) -> Any:
    """The group's store as the calling thread should use it: itself on the main thread, a clone
    of it (made once per thread and store) on any other.

    A ``TCPStore`` client runs one request at a time and keeps its connection for the whole of a
    ``wait``: measured on torch 2.13, a ``set`` from a second thread waited 1.8 s behind another
    thread's 2 s ``wait`` on the same client, so two threads in rounds on two groups (whose
    stores share the job's client) stalled each other until their deadlines.
    ``Store.clone()`` gives a thread its own connection, which is what torch provides it for.

    Raises:
        StoreUnreachable: the clone could not connect by ``deadline``.
    """
    if threading.current_thread() is threading.main_thread() or not hasattr(store, "clone"):
        return store
    cache: dict[int, tuple[Any, Any]] | None = getattr(_local, "stores", None)
    if cache is None:
        cache = _local.stores = {}
    entry = cache.get(id(store))
    if entry is None or entry[0] is not store:  # (the id of a store that is gone may come back)
        clone = bounded_store_call(store, store.clone, max(deadline - time.monotonic(), 0.0) + _STORE_GRACE_S, "clone")
        entry = cache[id(store)] = (store, clone)
    return entry[1]


def _parse(blob: bytes, rank: int, name: str) -> _Arrival | None:
    """The arrival of ``rank``, or None (logged) when it is too large or not the expected JSON."""
    if len(blob) > MAX_ARRIVAL_BYTES:
        log.error("round %r: rank %d wrote %d bytes (limit %d); ignored", name, rank, len(blob), MAX_ARRIVAL_BYTES)
        return None
    try:
        return _Arrival.model_validate_json(blob)
    except ValidationError as exc:
        log.error("round %r: rank %d wrote an unreadable arrival; ignored (%s)", name, rank, exc.errors()[0]["msg"])
        return None


def exchange(info: GroupInfo, name: str, payload: Any, deadline: float) -> RoundResult:
    """Runs one round: publishes ``payload`` and collects the others' until ``deadline``.

    Args:
        info: the group (its store carries the round).
        name: the round's name, the same on every rank (see :func:`next_round`).
        payload: JSON-serialisable data for the other ranks.
        deadline: ``time.monotonic()`` value after which the round is given up.

    Returns:
        The round's outcome, the same on every rank that took part.

    Raises:
        StoreUnreachable: the store did not answer.
    """
    start = time.monotonic()
    size, me = info.size, info.rank
    try:
        store = store_for_this_thread(info.store, deadline)
    except (DistStoreError, RuntimeError) as exc:
        if isinstance(exc, StoreUnreachable):
            raise
        raise StoreUnreachable(f"the group's store did not answer during round {name!r}: {exc}") from exc
    p = f"ncclguard/{name}"
    outcome_key = f"{p}/o"
    keys = [f"{p}/r{r}" for r in range(size)]

    def talk() -> tuple[str, int, dict[str, bytes]]:
        store.set(keys[me], json.dumps({"host": HOSTNAME, "payload": payload}))
        arrived = store.add(f"{p}/n", 1)
        if arrived >= size:
            settled = store.compare_set(outcome_key, "", "ok").decode()
        elif _wait(store, outcome_key, deadline - time.monotonic()):
            settled = store.get(outcome_key).decode()
        else:
            # The verdict records how many ranks had arrived, so a rank can tell whether it came
            # before the verdict (on time, only slower to notice) or after it (late).
            settled = store.compare_set(outcome_key, "", f"timeout {store.add(f'{p}/n', 0)}").decode()
        outcome = settled.partition(" ")[0]
        raw = dict(zip(keys, store.multi_get(keys), strict=True)) if outcome == "ok" else read_present(store, keys)
        if store.add(f"{p}/gone", 1) >= size:
            for key in [*keys, f"{p}/n", outcome_key, f"{p}/gone"]:
                store.delete_key(key)
        return settled, arrived, raw

    try:
        # A store whose host is cut off never answers add/set: bound the round as a whole.
        settled, arrived, raw = bounded_store_call(
            store, talk, max(deadline - time.monotonic(), 0.0) + _STORE_GRACE_S, f"round {name!r}"
        )
    except (DistStoreError, RuntimeError) as exc:  # connection refused / reset surface as RuntimeError
        if isinstance(exc, StoreUnreachable):
            raise
        raise StoreUnreachable(f"the group's store did not answer during round {name!r}: {exc}") from exc
    outcome, _, arrived_by = settled.partition(" ")
    late = outcome != "ok" and arrived > int(arrived_by or size)

    payloads: dict[int, Any] = {}
    hosts = _counts().hosts[info.name]
    for key, blob in raw.items():
        rank = int(key.rsplit("/r", 1)[1])
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
