"""Where a two-tier round's arrivals are (the node tier, docs/scale.md; the round in
:mod:`ncclguard.store.tier_round`): which node each rank is on, the keys of both tiers, a node's
carried arrivals, and the job store's view of them by rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard.store.codec import DecodeError, decode
from ncclguard.store.keys import RoundKeys
from ncclguard.store.rounds import Peek, read_present

__all__ = ["MAX_LOCAL", "Carried", "TierKeys", "TierPeek", "TierPlace"]

MAX_LOCAL = 64  # ranks of a group on one node, at most (torchrun's nproc_per_node)


class TierPlace:
    """Where a rank stands in a two-tier round.

    Args:
        rank: this rank, in the round's group.
        node_of: each group rank's node (``node_of[r]``), numbered from 0.
        near: a client of this node's store; None when the rank has none (it is carried by itself).

    Raises:
        ValueError: ``rank`` outside ``node_of``, a node numbered below 0, or more than
            :data:`MAX_LOCAL` ranks on one node.
    """

    def __init__(self, rank: int, node_of: Sequence[int], near: Any | None) -> None:
        if not 0 <= rank < len(node_of) or min(node_of) < 0:
            raise ValueError(
                f"rank {rank} of {len(node_of)} with nodes {min(node_of)}..{max(node_of)}: not a placement"
            )
        self.rank, self.node_of, self.near = rank, tuple(node_of), near
        self.node, self.nodes = self.node_of[rank], max(self.node_of) + 1
        self.local = tuple(r for r, n in enumerate(self.node_of) if n == self.node)
        if len(self.local) > MAX_LOCAL:
            raise ValueError(f"{len(self.local)} ranks on node {self.node}: at most {MAX_LOCAL}")

    @property
    def size(self) -> int:
        """The round's ranks."""
        return len(self.node_of)


class Carried(BaseModel):
    """One node's arrivals, as its carrier set them in the job's store: each rank's arrival (the
    JSON text it published) by its rank in the group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: int = Field(ge=0)
    arrivals: dict[int, str] = Field(max_length=MAX_LOCAL)


class TierKeys:
    """The keys of a two-tier round: the flat round's, the nodes' carried arrivals, the solos' list
    and the claims.

    Args:
        keys: the round's keys as a flat round would use them (the same names in both stores).
    """

    def __init__(self, keys: RoundKeys) -> None:
        self.round = keys
        self.nodes = RoundKeys(keys.prefix, arrival="node")  # arrival(node): a node's Carried
        self.solos = f"{keys.prefix}/solos"  # "r," appended by each rank carried by itself
        self.claim = f"{keys.prefix}/claim"  # the node's carrier (node's store); the give-up (job's store)

    def node_store_keys(self, local: Sequence[int]) -> list[str]:
        """Every key a round leaves in a node's store (its ranks' arrivals among them)."""
        return [*(self.round.arrival(r) for r in local), self.round.count, self.round.outcome, self.claim]

    def job_keys(self) -> list[str]:
        """The job store's keys of the round but the nodes' and solos' arrivals."""
        return [self.round.count, self.round.outcome, self.round.gone, self.solos, self.claim]


class TierPeek(Peek):
    """The job store's view of a two-tier round: the arrivals every carrier set there, by rank.

    Args:
        store: the job's store.
        keys: the round's keys.
        place: where the ranks are.
        limit: the largest one rank's arrival, in bytes (a node's :class:`Carried` is read under
            twice its ranks' share: JSON inside JSON escapes its quotes).
    """

    def __init__(self, store: Any, keys: TierKeys, place: TierPlace, limit: int) -> None:
        super().__init__(store, keys.round, place.size)
        self._tier, self._place, self._limit = keys, place, limit
        self._warned: set[int] = set()

    def present(self) -> list[int]:
        """The ranks whose arrival some carrier set (sorted)."""
        return sorted(self._read())

    def arrivals(self, ranks: Sequence[int] | None = None, *, complete: bool = False) -> dict[int, bytes]:
        """The raw arrivals of ``ranks`` (default: every rank) carried so far; a node whose
        :class:`Carried` cannot be read gives each of its ranks an empty arrival (unreadable)."""
        found = self._read()
        return found if ranks is None else {r: found[r] for r in ranks if r in found}

    def _read(self) -> dict[int, bytes]:
        tier, place = self._tier, self._place
        out: dict[int, bytes] = {}
        nodes = read_present(self._store, [tier.nodes.arrival(n) for n in range(place.nodes)])
        for key, raw in nodes.items():
            out.update(self.unpack(tier.nodes.rank_of(key), bytes(raw)))
        solos = self.solos()
        if solos:
            for key, raw in read_present(self._store, [tier.round.arrival(r) for r in solos]).items():
                out.setdefault(tier.round.rank_of(key), bytes(raw))
        return out

    def unpack(self, node: int, raw: bytes) -> dict[int, bytes]:
        """The arrivals of ``node``'s ranks in its carried value ``raw``."""
        local = [r for r, n in enumerate(self._place.node_of) if n == node]
        what = f"node {node}'s arrivals ({self._tier.nodes.arrival(node)})"
        try:
            carried = decode(Carried, raw, what, 2 * self._limit * max(1, len(local)) + 4096)
        except DecodeError as exc:
            log.warning("two-tier round: %s; its ranks count as unreadable", exc)
            return dict.fromkeys(local, b"")
        out = {r: text.encode() for r, text in carried.arrivals.items() if r in local and carried.node == node}
        if len(out) < len(carried.arrivals) and node not in self._warned:
            self._warned.add(node)
            log.warning("two-tier round: %s names ranks not on that node; those are left out", what)
        return out

    def solos(self) -> list[int]:
        """The ranks carried by themselves so far (the round's list of solos)."""
        key = self._tier.solos
        if not self._store.check([key]):
            return []
        raw = bytes(self._store.get(key))[: 8 * self.size_hint]
        return sorted(
            {int(p) for p in raw.decode(errors="replace").split(",") if p.isdecimal() and int(p) < self.size_hint}
        )

    @property
    def size_hint(self) -> int:
        """The round's ranks."""
        return self._place.size
