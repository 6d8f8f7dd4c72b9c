"""The settle-once round in two tiers (the node tier, docs/scale.md): a node's ranks meet in their
node's store, and one carrier a node takes their arrivals to the job's store, where the round of
:mod:`ncclguard.store.rounds` is held among the carriers, counted in ranks.

For a round with keys ``K`` among ``size`` ranks placed on nodes (:class:`TierPlace`):

1. each rank sets its arrival in its node's store and counts itself there. The rank whose count
   completes the node, or past the node's deadline (:func:`node_deadline`, a little before the
   round's) the first to claim, carries: it reads the node's arrivals and sets them, as one
   :class:`Carried`, under the node's key in the job's store, then adds their number to the job's count;
2. a rank with no node's store (none named yet, or it failed before the rank was counted there) is
   carried by itself: its arrival under its own key, its rank appended to the round's list of solos;
3. the carrier whose add completes ``size`` settles the outcome (compare-and-set) from every arrival
   carried; the first carrier watches for an early outcome (``rule.early``); the others wait for the
   outcome until the deadline, then one of them, by a claim, settles it given up (the rest read it);
4. each carrier copies the outcome into its node's store, where the node's other ranks read it. A
   rank whose node's store fails after its arrival was sent there looks for it among its node's
   carried arrivals in the job's store: found, it reads the job's outcome; else it goes by itself.
   A rank carried twice (its node's carrier read it, then the store died before that carrier's
   set reached the job's store) would complete the count early, and the outcome would fail
   naming the rank still missing: a rule that needs every rank's arrival (the commit's) never
   settles ok on a count alone.

Job-store requests per node and round: the carrier's ``set``, ``add``, ``wait`` and ``get``; none
from the node's other ranks. Unbounded nowhere: each tier's calls run on the calling thread's
bounded helper (:func:`~ncclguard.store.bounded.bounded_store_call`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed import DistStoreError

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.codec import encode
from ncclguard.store.keys import RoundKeys
from ncclguard.store.rounds import GRACE_S, MAX_SLEEP_S, Rule, Settled, read_present, wait_for
from ncclguard.store.tier_place import Carried, TierKeys, TierPeek, TierPlace
from ncclguard.store.values import delete_keys

__all__ = [
    "Carried",
    "TierKeys",
    "TierPeek",
    "TierPlace",
    "forget_tiered",
    "node_deadline",
    "settle_tiered",
    "tier_counts",
]

T = TypeVar("T")
# When a node's first rank first asks, then how often, whether its missing ranks are known dead or
# went to the job's store by themselves (a rank not linked to its node's store yet): a healthy
# node meets well within the first, so a healthy round asks nothing.
NODE_FIRST_ASK_S, NODE_POLL_S = 0.5, 1.0
GIVE_UP_WAIT_S = 0.5  # past the deadline, how long a carrier waits for the one that claimed the give-up
# A node's ranks give up waiting for each other this long before the round's deadline, so that the
# ranks present are carried in time and the outcome names only the ones missing.
NODE_MARGIN_FRACTION, NODE_MARGIN_MIN_S, NODE_MARGIN_MAX_S = 0.1, 0.05, 2.0
_STORE_ERRORS = (StoreUnreachable, DistStoreError, RuntimeError)


class _Tally:
    """How this process's ranks went through two-tier rounds (see :func:`tier_counts`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(("carried", "waited", "solo", "fell_back"), 0)

    def add(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1


_tally = _Tally()


def tier_counts() -> dict[str, int]:
    """How this process's ranks went through two-tier rounds so far.

    Returns:
        ``carried`` (took its node's arrivals to the job's store), ``waited`` (read the outcome in
        its node's store), ``solo`` (carried by itself: no node's store) and ``fell_back`` (its
        node's store failed after it was counted there: it read the job's outcome).
    """
    with _tally.lock:
        return dict(_tally.counts)


def node_deadline(deadline: Deadline, timeout_s: float) -> Deadline:
    """When a node's ranks stop waiting for each other: a tenth of the round's bound before its
    deadline (0.05 s to 2 s), so that the ranks present are carried in time."""
    margin = min(max(timeout_s * NODE_MARGIN_FRACTION, NODE_MARGIN_MIN_S), NODE_MARGIN_MAX_S)
    return Deadline(deadline.at - margin)


@dataclass(frozen=True)
class _NodeSide:
    """What the node's tier left this rank to do: ``carry`` its node's arrivals (``arrivals``),
    ``wait`` for the outcome in the node's store, read the ``outcome`` already there (``raw``),
    go ``solo`` (no node's store), or find out whether it was carried (``lost``: the node's store
    failed after this rank's arrival was sent there; then ``fell_back`` or ``solo``)."""

    then: str
    arrivals: dict[int, str] | None = None
    raw: bytes | None = None


def _node_side(
    place: TierPlace,
    keys: TierKeys,
    arrival: str,
    node_by: Deadline,
    deadline: Deadline,
    elsewhere: Callable[[], set[int]],
) -> _NodeSide:
    """This rank's part in its node's store (step 1 of the module's doc). ``elsewhere``: the ranks
    that will never arrive in the node's store (known dead, or carried by themselves)."""
    near, local, k = place.near, place.local, keys.round
    if near is None:
        return _NodeSide("solo")

    def claim(complete: bool) -> _NodeSide:
        if int(near.add(keys.claim, 1)) > 1:
            return _NodeSide("wait")  # another rank of the node carries (it may have read this one)
        wanted = [k.arrival(r) for r in local]
        raw = dict(zip(wanted, near.multi_get(wanted), strict=True)) if complete else read_present(near, wanted)
        return _NodeSide("carry", arrivals={k.rank_of(key): bytes(v).decode() for key, v in raw.items()})

    sent = False

    def body() -> _NodeSide:
        nonlocal sent
        near.set(k.arrival(place.rank), arrival)
        sent = True
        number = int(near.add(k.count, 1))
        if number >= len(local):
            return claim(True)
        if number > 1:  # only the node's first rank asks who went elsewhere: the rest wait, woken by the server
            if wait_for(near, k.outcome, node_by):
                return _NodeSide("outcome", raw=bytes(near.get(k.outcome)))
            return claim(False)
        start = time.monotonic()
        ask_at = start + NODE_FIRST_ASK_S
        while (now := time.monotonic()) < node_by.at:
            if near.check([k.outcome]):
                return _NodeSide("outcome", raw=bytes(near.get(k.outcome)))
            if now >= ask_at:
                ask_at = now + NODE_POLL_S
                present = {k.rank_of(key) for key in read_present(near, [k.arrival(r) for r in local])}
                missing = set(local) - present
                if missing and missing <= elsewhere():
                    return claim(False)
            node_by.sleep(max(min((now - start) / 4, MAX_SLEEP_S), 0.001))
        return claim(False)

    try:
        return bounded_store_call(near, body, deadline, "the node's part of a two-tier round")
    except _STORE_ERRORS as exc:
        log.warning("two-tier round: the node's store failed (%s)", str(exc).splitlines()[0])
        return _NodeSide("lost" if sent else "solo")


def _give_up(store: Any, keys: TierKeys, deadline: Deadline, rule: Rule[T], peek: TierPeek) -> bytes:
    """Past the deadline: the outcome, or the one this carrier settles given up. One carrier claims
    the give-up (each would read every node's arrivals); the others wait a little for it, then
    settle it themselves (the claimant may be gone)."""
    outcome = keys.round.outcome
    if store.check([outcome]):
        return bytes(store.get(outcome))
    if int(store.add(keys.claim, 1)) > 1 and wait_for(store, outcome, Deadline.within(GIVE_UP_WAIT_S)):
        return bytes(store.get(outcome))
    return bytes(store.compare_set(outcome, "", rule.given_up(peek)))


def _watch(store: Any, keys: TierKeys, deadline: Deadline, rule: Rule[T], peek: TierPeek) -> bytes:
    """The first carrier's wait: the outcome, or an early one (``rule.early``), looked for with
    sleeps that grow with the wait (as :mod:`ncclguard.store.rounds` polls); given up past the deadline."""
    assert rule.early is not None
    outcome = keys.round.outcome
    start = ask_at = time.monotonic()
    while (now := time.monotonic()) < deadline.at:
        if store.check([outcome]):
            return bytes(store.get(outcome))
        if now >= ask_at:
            early = rule.early(peek)
            if early is not None:
                return bytes(store.compare_set(outcome, "", early))
            ask_at = now + min(rule.poll_s + (now - start) / 10, MAX_SLEEP_S * 4)
        deadline.sleep(max(min((now - start) / 4, MAX_SLEEP_S), 0.001))
    return _give_up(store, keys, deadline, rule, peek)


def _job_side(
    store: Any,
    keys: TierKeys,
    place: TierPlace,
    side: _NodeSide,
    arrival: str,
    deadline: Deadline,
    rule: Rule[T],
    peek: TierPeek,
) -> bytes:
    """A carrier's part in the job's store (steps 2 and 3 of the module's doc): the raw outcome."""
    carried = len(side.arrivals) if side.arrivals is not None else 1
    text = encode(Carried(node=place.node, arrivals=side.arrivals)) if side.arrivals is not None else arrival

    def body() -> bytes:
        if side.arrivals is None:  # alone: under its own key, named in the solos' list
            store.set(keys.round.arrival(place.rank), text)
            store.append(keys.solos, f"{place.rank},")
        else:
            store.set(keys.nodes.arrival(place.node), text)
        number = int(store.add(keys.round.count, carried))
        if number >= place.size:
            return bytes(store.compare_set(keys.round.outcome, "", rule.everyone()))
        if number == carried and rule.early is not None:  # the first carrier watches
            return _watch(store, keys, deadline, rule, peek)
        if wait_for(store, keys.round.outcome, deadline):
            return bytes(store.get(keys.round.outcome))
        return _give_up(store, keys, deadline, rule, peek)

    return bounded_store_call(store, body, deadline.plus(GRACE_S), "the job's part of a two-tier round")


def _outcome_after(
    store: Any, keys: TierKeys, place: TierPlace, deadline: Deadline, rule: Rule[T], peek: TierPeek
) -> tuple[bytes, str]:
    """A rank counted in its node's store that another rank carries: the outcome its carrier copies
    there; the job's, should the node's store fail or stay silent past the deadline."""
    near: Any = place.near
    outcome = keys.round.outcome
    try:
        if bounded_store_call(
            near, lambda: wait_for(near, outcome, deadline.plus(GRACE_S / 2)), deadline.plus(GRACE_S)
        ):
            raw = bounded_store_call(
                near, lambda: bytes(near.get(outcome)), deadline.plus(GRACE_S), "the node's outcome"
            )
            return raw, "waited"
        why = "no outcome by the deadline"
    except _STORE_ERRORS as exc:
        why = str(exc)
    log.warning("two-tier round: no outcome in the node's store (%s); reading the job's", why)
    return _job_outcome(store, keys, deadline, rule, peek), "fell_back"


def _job_outcome(store: Any, keys: TierKeys, deadline: Deadline, rule: Rule[T], peek: TierPeek) -> bytes:
    """The job's outcome, or past the deadline the one settled given up (a rank already carried)."""
    outcome = keys.round.outcome

    def body() -> bytes:
        if wait_for(store, outcome, deadline.plus(GRACE_S / 2)):
            return bytes(store.get(outcome))
        return _give_up(store, keys, deadline, rule, peek)

    return bounded_store_call(store, body, deadline.plus(2 * GRACE_S), "the job's outcome of a two-tier round")


def _was_carried(store: Any, keys: TierKeys, place: TierPlace, peek: TierPeek, deadline: Deadline) -> bool:
    """Whether this rank's node's carrier set its arrival in the job's store already (asked by a
    rank whose node's store failed after it arrived there: never carried twice then)."""
    try:
        found = bounded_store_call(
            store,
            lambda: read_present(store, [keys.nodes.arrival(place.node)]),
            deadline,
            "the node's carried arrivals",
        )
    except _STORE_ERRORS:
        return False
    return any(place.rank in peek.unpack(place.node, bytes(raw)) for raw in found.values())


def settle_tiered(
    store: Any,
    keys: RoundKeys,
    place: TierPlace,
    arrival: str,
    deadline: Deadline,
    rule: Rule[T],
    *,
    node_by: Deadline,
    peek: TierPeek,
    known_dead: Callable[[], dict[int, str]] | None = None,
) -> tuple[Settled[T], str]:
    """Runs one two-tier round (see the module's docstring).

    Args:
        store: the job's store (the same server on every rank).
        keys: the round's keys, the same on every rank, in both stores.
        place: where the ranks are, and this rank's node's store.
        arrival: what this rank publishes (JSON text).
        deadline: when the ranks not there are given up.
        rule: how the outcome is settled and read. Its ``everyone``, ``given_up`` and ``early`` read
            the arrivals through ``peek``; its members are not read.
        node_by: when the node's ranks stop waiting for each other (:func:`node_deadline`).
        peek: the job store's view of the round (the same one the rule reads).
        known_dead: the ranks known dead now (bounded by its caller); a node carries early once its
            missing ranks are all among them or carried by themselves.

    Returns:
        The round as this rank saw it (``arrivals`` None: members are not read), and the way this
        rank went: ``carried``, ``waited``, ``solo`` or ``fell_back`` (see :func:`tier_counts`).

    Raises:
        StoreUnreachable: the job's store did not answer in time.
        DistStoreError, RuntimeError: the job's store failed.
        Whatever ``rule.read`` raises.
    """
    start = time.monotonic()
    tier = TierKeys(keys)

    def elsewhere() -> set[int]:  # asked on the node's store's helper: the job's store's calls bounded here
        try:
            solos = set(bounded_store_call(store, peek.solos, Deadline.within(GRACE_S), "the round's solos"))
        except _STORE_ERRORS:
            solos = set()
        return solos | set(known_dead() if known_dead is not None else ())

    side = _node_side(place, tier, arrival, node_by, deadline, elsewhere)
    if side.then == "lost":  # the node's store failed under this rank: carried already, or alone
        carried = _was_carried(store, tier, place, peek, deadline)
        side = _NodeSide("fell_back" if carried else "solo")
    if side.then == "outcome" and side.raw is not None:
        raw, path = side.raw, "waited"
    elif side.then == "fell_back":
        raw, path = _job_outcome(store, tier, deadline, rule, peek), "fell_back"
    elif side.then == "wait":
        raw, path = _outcome_after(store, tier, place, deadline, rule, peek)
    else:
        raw = _job_side(store, tier, place, side, arrival, deadline, rule, peek)
        path = "solo" if side.then == "solo" else "carried"
        if side.then == "carry":
            _copy_to_node(place, tier, raw, deadline)
    _tally.add(path)
    return Settled(rule.read(raw), 0, None, time.monotonic() - start), path


def _copy_to_node(place: TierPlace, keys: TierKeys, raw: bytes, deadline: Deadline) -> None:
    """The outcome into the node's store, for the node's other ranks (they fall back to the job's
    store should this fail)."""
    near: Any = place.near
    try:
        bounded_store_call(
            near,
            lambda: near.compare_set(keys.round.outcome, "", raw),
            deadline.plus(GRACE_S),
            "the outcome into the node's store",
        )
    except _STORE_ERRORS as exc:
        log.warning("two-tier round: the outcome could not be copied into the node's store (%s)", exc)


def forget_tiered(
    store: Any,
    keys: RoundKeys,
    place: TierPlace,
    path: str,
    deadline: Deadline,
    *,
    counters_by: int = 0,
    keep_outcome: bool = False,
) -> None:
    """Deletes a two-tier round's keys, once every rank has left it: from the node's carrier, the
    round's keys in its node's store and the node's carried arrivals in the job's store; from a
    rank that went alone, its arrival there; from ``counters_by``, the job's counters. Each store's
    deletes are one bounded call; a store that fails leaves its keys.

    The carrier, not the node's first rank: a node's first rank may have gone alone (a restarted
    rank not linked to its node's store yet), or not come at all (a rebuild's meeting).

    Args:
        store: the job's store.
        keys: the round's keys.
        place: where the ranks are.
        path: how this rank went through the round (:func:`settle_tiered`'s: ``carried``, ``waited``,
            ``solo`` or ``fell_back``).
        deadline: when to stop waiting for the stores.
        counters_by: the rank that deletes the job's counters (one that came: rank 0 in a commit).
        keep_outcome: the outcome stays in both stores (a few bytes), for a rank that comes late.
    """
    tier, carrier = TierKeys(keys), path == "carried"
    near_keys = tier.node_store_keys(place.local) if carrier else []
    job_keys = [tier.nodes.arrival(place.node)] if carrier else []
    job_keys += [keys.arrival(place.rank)] if path == "solo" else []
    job_keys += tier.job_keys() if place.rank == counters_by else []
    for client, listed in ((place.near, near_keys), (store, job_keys)):
        wanted = [k for k in listed if not (keep_outcome and k == keys.outcome)]
        if client is None or not wanted:
            continue
        try:
            delete_keys(client, wanted, deadline, f"clean-up of {keys.prefix}")
        except _STORE_ERRORS as exc:
            log.info("two-tier round: keys of %s stay in a store (%s)", keys.prefix, exc)
