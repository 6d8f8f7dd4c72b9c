"""Which rank's replica drifted, from the digests the ranks stated at a commit: pure.

Under DDP every rank holds the same parameters and optimizer state before a step is applied. A
rank under the replica check (:mod:`ncclguard.recovery._numerics.replicas`) states a digest of each
part (:func:`~ncclguard.recovery._numerics.digest.replica_digests`); :func:`replica_drift` names the
ranks whose digest of some part differs from the one most ranks hold. Where no digest is held by a
strict majority (two ranks that differ, or three that all differ), every stating rank is odd and no
rank can be named: :attr:`ReplicaDrift.majority` is empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ncclguard._naming import rank_ranges

__all__ = [
    "DRIFTED",
    "MAX_REPLICA_PARTS",
    "PART_CHARS",
    "PartName",
    "ReplicaDrift",
    "drift_reason",
    "only_drift",
    "replica_drift",
]

MAX_REPLICA_PARTS = 4  # parts one rank digests at most ("parameters", "optimizer")
PART_CHARS = 16  # a part's name, at most
DRIFTED = "replica drifted"  # how a drifted rank's reason at the commit starts
PartName = Annotated[str, StringConstraints(max_length=PART_CHARS)]


class ReplicaDrift(BaseModel):
    """The replicas a commit found apart (:func:`replica_drift`), the same on every rank.

    Attributes:
        ranks: the ranks whose digest of some part differs from the majority's (sorted); every
            stating rank when there is no majority.
        majority: the ranks that hold the majority's digest of every part (sorted): the peers a
            drifted rank can be healed from. Empty: no majority, no rank can be named.
        parts: by part, the ranks whose digest of it is odd.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ranks: list[int]
    majority: list[int] = Field(default_factory=list)
    parts: dict[PartName, list[int]] = Field(default_factory=dict, max_length=MAX_REPLICA_PARTS)


def _odd(held: Mapping[int, str]) -> tuple[list[int], bool]:
    """The ranks whose value differs from the one a strict majority holds, and whether one does."""
    counts = Counter(held.values()).most_common()
    if len(counts) <= 1:
        return [], True
    if 2 * counts[0][1] <= len(held):  # no strict majority: every rank is suspect
        return sorted(held), False
    common = counts[0][0]
    return sorted(r for r, v in held.items() if v != common), True


def replica_drift(said: Mapping[int, Mapping[str, str]]) -> ReplicaDrift | None:
    """The ranks whose replica differs from the majority's (pure).

    Args:
        said: by rank, the digests it stated by part (empty: it stated none; left out).

    Returns:
        The drift, or None when the stated digests agree (or fewer than two ranks stated one).
    """
    stating = {r: d for r, d in said.items() if d}
    if len(stating) < 2:
        return None
    parts: dict[str, list[int]] = {}
    named = True
    for part in sorted({p for d in stating.values() for p in d})[:MAX_REPLICA_PARTS]:
        held = {r: d[part] for r, d in stating.items() if part in d}
        odd, held_by_most = _odd(held)
        if odd:
            parts[part] = odd
            named = named and held_by_most
    if not parts:
        return None
    ranks = sorted({r for odd in parts.values() for r in odd})
    return ReplicaDrift(
        ranks=ranks, majority=sorted(r for r in stating if r not in ranks) if named else [], parts=parts
    )


def drift_reason(rank: int, drift: ReplicaDrift) -> str:
    """Why ``rank`` fails the commit, in words."""
    parts = " and ".join(p for p, odd in drift.parts.items() if rank in odd)
    if not drift.majority:
        return (
            f"{DRIFTED}? its {parts} digest differs from ranks {rank_ranges([r for r in drift.ranks if r != rank])}'s "
            "and no digest is held by a majority: which replica drifted cannot be told"
        )
    return (
        f"{DRIFTED}: its {parts} digest differs from ranks {rank_ranges(drift.majority)}'s before the step "
        "(a silent data corruption)"
    )


def only_drift(
    failed: Mapping[int, list[str]], drift: ReplicaDrift | None, nonfinite: Mapping[int, object] | None = None
) -> bool:
    """Whether a failed outcome failed for drifted replicas alone: every failed rank is a drifted
    one with no other reason but a non-finite gradient of its own (the engine then heals in the same
    world, no rebuild). A drifted value can make that rank's gradient NaN (a flipped exponent bit):
    healed from the majority, the redo computes it again; a rebuild instead would copy rank 0's
    parameters to every rank, a drifted rank 0's too (found by benchmarks/nan_detection_drill.py).

    Args:
        failed: the outcome's reasons by failed rank.
        drift: the outcome's drift, or None.
        nonfinite: the outcome's ranks with a non-finite gradient (their one other reason), or None.

    Returns:
        True when there is a drift and nothing else failed.
    """
    if drift is None or not failed:
        return False
    for r, reasons in failed.items():
        drifted = [x for x in reasons if x.startswith(DRIFTED)]
        allowed = 2 if nonfinite is not None and r in nonfinite else 1
        if r not in drift.ranks or len(drifted) != 1 or len(reasons) > allowed:
            return False
    return True
