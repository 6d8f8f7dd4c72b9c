"""A numerical fault in the incident model: what the recovery engine's commit named (docs/numerics.md).

The commit's outcome is the same on every rank, so the report is too: a gradient that held a NaN or
an infinity before its all-reduce (:class:`NonFiniteReport`), or a replica that drifted from the
others (:class:`DriftReport`, a silent corruption). It travels in the incident as raised
(``IncidentDoc.numerics``), through the store: every field is bounded. Sets of ranks are written as
rank ranges (``"0,2-1023"``: exact, and short for any job), cut with ``…`` past
:data:`RANKS_CHARS`; the first ranks named are also given as numbers (the pictures mark them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from ncclguard._naming import rank_ranges
from ncclguard.incidents.base import Model

__all__ = [
    "MAX_NAMED_RANKS",
    "RANKS_CHARS",
    "DriftReport",
    "FlaggedBucket",
    "NamedRank",
    "NonFiniteReport",
    "NumericsReport",
    "ranks_field",
]

MAX_NAMED_RANKS = 8  # ranks whose buckets a report names (all are in its rank ranges)
MAX_BUCKETS = 4  # buckets named per rank (as a rank states them at the commit)
MAX_PARAMS = 8  # parameter names per bucket
RANKS_CHARS = 512  # a set of ranks as rank ranges, at most (cut with "…")
RanksText = Annotated[str, StringConstraints(max_length=RANKS_CHARS + 1, pattern=r"^[0-9,\-]*…?$")]
ParamName = Annotated[str, StringConstraints(max_length=96)]
PartName = Annotated[str, StringConstraints(max_length=16)]


def ranks_field(ranks: list[int]) -> str:
    """``ranks`` as rank ranges for a report, cut after a whole range with ``…`` past :data:`RANKS_CHARS`.

    Args:
        ranks: the ranks, in any order.

    Returns:
        ``"0,2-5"``; ``""`` for none.
    """
    text = rank_ranges(ranks)
    if len(text) <= RANKS_CHARS:
        return text
    return text[: text.rfind(",", 0, RANKS_CHARS)] + "…"


class FlaggedBucket(Model):
    """A gradient bucket that held a NaN or an infinity before its all-reduce, on one rank.

    Attributes:
        index: DDP's bucket index (0 is the one reduced first).
        kind: ``"NaN"`` or ``"Inf"`` (an infinity, no NaN).
        params: the first names of its parameters, in the bucket's order.
        more_params: its parameters left out of ``params``.
    """

    index: int = Field(ge=0)
    kind: Literal["NaN", "Inf"]
    params: list[ParamName] = Field(default_factory=list, max_length=MAX_PARAMS)
    more_params: int = Field(0, ge=0)


class NamedRank(Model):
    """One rank whose gradient was not finite, and its flagged buckets."""

    rank: int = Field(ge=0)
    buckets: list[FlaggedBucket] = Field(default_factory=list, max_length=MAX_BUCKETS)


class _Step(Model):
    """Where a finding was made: the step, its attempt, when, and the main thread's phase."""

    step: int  # the loop's step number
    attempt: int = Field(1, ge=1)  # the step's attempt whose commit named it
    commit: int = Field(0, ge=0)  # that commit's number in its world, the same on every rank
    at: float = 0.0  # time.time() when the commit named it
    phase: str = Field("", max_length=200)  # the main thread's phase then ("" when none is set)
    suspects: list[int] = Field(default_factory=list, max_length=MAX_NAMED_RANKS)  # ranks named suspect devices by it


class NonFiniteReport(_Step):
    """A step whose commit named non-finite gradients (the ranks, their buckets and parameters).

    Attributes:
        ranks: every rank whose gradient held a NaN or an infinity, as rank ranges.
        named: the first :data:`MAX_NAMED_RANKS` of them with their buckets.
        finite: the ranks whose checked gradient was finite, as rank ranges.
        action: what the engine did, the same on every rank: ``"redo"`` (the step ran again),
            ``"skip"`` (its batch was dropped) or ``"raise"`` (``NonFiniteGradient`` on every rank).
    """

    what: Literal["nonfinite"] = "nonfinite"
    ranks: RanksText
    named: list[NamedRank] = Field(default_factory=list, max_length=MAX_NAMED_RANKS)
    finite: RanksText = ""
    action: Literal["redo", "skip", "raise"]


class DriftReport(_Step):
    """A step whose commit found a replica apart from the others (a silent corruption).

    Attributes:
        ranks: the drifted ranks as rank ranges (every rank compared when no majority).
        named: the first :data:`MAX_NAMED_RANKS` of them.
        parts: by part (``"parameters"``, ``"optimizer"``), the ranks whose digest of it differed.
        majority: the ranks that held the majority's digests; ``""``: no majority.
        source: the majority rank the drifted ones were healed from; None when none was.
        outcome: ``"healed"`` (and the step redone), ``"heal failed"`` (the world is rebuilt), or
            ``"raised"`` (no majority: ``ReplicasDiverged`` on every rank).
    """

    what: Literal["drift"] = "drift"
    ranks: RanksText
    named: list[int] = Field(default_factory=list, max_length=MAX_NAMED_RANKS)
    parts: dict[PartName, RanksText] = Field(default_factory=dict, max_length=4)
    majority: RanksText = ""
    source: int | None = None
    outcome: Literal["healed", "heal failed", "raised"]


NumericsReport = Annotated[NonFiniteReport | DriftReport, Field(discriminator="what")]
