"""should_commit, the rebuild's meeting and a snapshot take's agreement through the node tier
(docs/scale.md): with the tier on, a step's statements (a meeting's arrivals, a take's accounts)
meet in each node's store first, and one rank a node carries them to the job's store
(:mod:`ncclguard.store.tier_round`). The job's store then takes a few requests a node, not a few a
rank.

Whether a commit goes through the tier is decided once per world, the same on every rank, from
what the launcher and the settings say (torchrun's ``GROUP_RANK``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``,
``NCCLGUARD_WATCHDOG_NODE_TIER``, ``NCCLGUARD_WATCHDOG_NODE_TIER_MIN_RANKS``), never from a store's
state: two ranks of one round must hold the same protocol. Whether a rank has its node's store (its
watchdog linked to it) can differ from rank to rank: a rank without one is carried by itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist
from pydantic import ValidationError

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.store import node_store
from ncclguard.store.keys import RoundKeys
from ncclguard.store.rounds import Rule
from ncclguard.store.tier_round import TierKeys, TierPeek, TierPlace, forget_tiered, node_deadline, settle_tiered
from ncclguard.watching.base.node_layout import NodeLayout, tier_wanted
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.world import Slot, World

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ncclguard.collectives.groups import GroupInfo
    from ncclguard.recovery._commit.statements import CommitOutcome

__all__ = [
    "TierState",
    "forget_commit",
    "meeting_place",
    "nodes_of",
    "settle_commit",
    "settle_on_tier",
    "tier_of",
    "tier_peek",
]

T = TypeVar("T")


class TierState:
    """One world's answer to "through the tier?" (decided at its first commit) and how this rank
    went through the last round (a rank that went alone deletes its own arrival afterwards)."""

    def __init__(self, world: World) -> None:
        self.decided = False
        self.node_of: tuple[int, ...] | None = None
        self.paths: dict[int, str] = {}  # commit number -> how this rank went through it (settle_tiered's)


_TIER: Slot[TierState] = Slot("commit tier", TierState)


def nodes_of(origins: Sequence[int]) -> tuple[int, ...] | None:
    """Each member's node, from its launch rank (``origins[r]``), when the tier is on for a world
    of ``len(origins)``; else None."""
    size = len(origins)
    layout = NodeLayout.from_env()
    if layout is None:
        return None
    try:
        cfg = WatchdogConfig()
    except ValidationError as exc:
        log.warning("should_commit: the watchdog's settings are not valid (%s); no node tier", str(exc).splitlines()[0])
        return None
    if not tier_wanted(cfg.node_tier, size, cfg.node_tier_min_ranks, layout):
        return None
    nodes = tuple(o // layout.local_size for o in origins)
    if not nodes or max(nodes) >= layout.nodes:  # a placement torchrun's numbering does not describe
        return None
    return nodes


def meeting_place(origins: Sequence[int], rank: int, timeout_s: float, deadline: Deadline) -> TierPlace | None:
    """Where a rank stands in a rebuild meeting through the node tier, or None (the meeting is flat).

    Args:
        origins: the launch rank of each member of the world being left.
        rank: this rank in it.
        timeout_s: the client's timeout, for a first connection to the node's store.
        deadline: when that connection must be made.
    """
    nodes = nodes_of(origins)
    if nodes is None or not 0 <= rank < len(nodes):
        return None
    return TierPlace(rank, nodes, node_store.near_client(timeout_s, deadline))


def tier_of(info: GroupInfo, world: World, timeout_s: float, deadline: Deadline) -> tuple[TierPlace, TierState] | None:
    """Where this rank stands in a two-tier commit on ``info``'s group, or None: the commit is flat.

    Args:
        info: the commit's group (only the world's default group goes through the tier).
        world: this process's world.
        timeout_s: the client's timeout, for a first connection to the node's store.
        deadline: when that connection must be made.

    Returns:
        The place (its ``near`` None when this rank has no node's store) and the world's tier state.
    """
    if not dist.is_initialized() or info.group is not compat.default_group():
        return None
    state = world.get(_TIER)
    if not state.decided:
        state.node_of, state.decided = nodes_of([world.origin(r) for r in range(info.size)]), True
        if state.node_of is not None:
            log.info("should_commit: through the node tier, %d nodes", max(state.node_of) + 1)
    if state.node_of is None or len(state.node_of) != info.size:
        return None
    return TierPlace(info.rank, state.node_of, node_store.near_client(timeout_s, deadline)), state


def tier_peek(store: dist.Store, keys: RoundKeys, place: TierPlace, limit: int) -> TierPeek:
    """The job store's view of the round's arrivals, by rank, for the commit's rule."""
    return TierPeek(store, TierKeys(keys), place, limit)


def settle_on_tier(
    store: dist.Store,
    keys: RoundKeys,
    place: TierPlace,
    arrival: str,
    deadline: Deadline,
    timeout_s: float,
    rule: Rule[T],
    peek: TierPeek,
    known_dead: Callable[[], dict[int, str]] | None,
) -> tuple[T, str]:
    """Runs one round through the tier (``rule`` reads the arrivals through ``peek``; ``known_dead``
    is bounded by the caller): a commit's, or a snapshot take's agreement.

    Returns:
        The settled outcome, and how this rank went through the round (``settle_tiered``'s path:
        what it deletes of the round's keys, :func:`~ncclguard.store.tier_round.forget_tiered`).

    Raises:
        StoreUnreachable, DistStoreError, RuntimeError: the job's store failed.
    """
    settled, path = settle_tiered(
        store,
        keys,
        place,
        arrival,
        deadline,
        rule,
        node_by=node_deadline(deadline, timeout_s),
        peek=peek,
        known_dead=known_dead,
    )
    if path in ("solo", "fell_back") and place.near is not None:
        node_store.drop_near_client(place.near)  # connect anew next time (its agent may serve a new one)
    return settled.outcome, path


def settle_commit(
    store: dist.Store,
    keys: RoundKeys,
    tier: tuple[TierPlace, TierState],
    n: int,
    statement: str,
    deadline: Deadline,
    timeout_s: float,
    rule: Rule[CommitOutcome],
    peek: TierPeek,
    known_dead: Callable[[], dict[int, str]] | None,
) -> CommitOutcome:
    """Runs commit ``n``'s round through the tier (:func:`settle_on_tier`).

    Returns:
        The settled outcome.

    Raises:
        StoreUnreachable, DistStoreError, RuntimeError: the job's store failed.
    """
    place, state = tier
    outcome, state.paths[n] = settle_on_tier(store, keys, place, statement, deadline, timeout_s, rule, peek, known_dead)
    return outcome


def forget_commit(
    store: dist.Store, keys: RoundKeys, tier: tuple[TierPlace, TierState], n: int, deadline: Deadline
) -> None:
    """Deletes commit ``n``'s keys in both stores (every rank has left it)."""
    place, state = tier
    forget_tiered(store, keys, place, state.paths.pop(n, ""), deadline)
