"""What a rank says at a step's commit about its gradient's values, and how it is worded: pure.

A rank under the recovery engine's check (:mod:`ncclguard.recovery._numerics.hook`) states, in its
commit statement, how many of its gradient buckets were checked in the attempt and which of them
held a NaN or an infinity before the all-reduce, with the first names of the parameters in each
(:class:`NumericsSaid`). Everything is bounded: the statement goes through the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ncclguard._naming import rank_ranges

__all__ = [
    "MAX_FLAGGED_BUCKETS",
    "MAX_PARAM_NAMES",
    "MAX_PARAM_NAME_CHARS",
    "NONFINITE",
    "BucketFinding",
    "NumericsSaid",
    "bucket_finding",
    "describe",
    "numerics_said",
    "outcome_words",
]

MAX_FLAGGED_BUCKETS = 4  # buckets one rank names at most (the rest are counted)
MAX_PARAM_NAMES = 8  # parameter names given per bucket at most (the rest are counted)
MAX_PARAM_NAME_CHARS = 96  # a name's length at most (a longer one is cut, its end kept)
NONFINITE = "non-finite gradient"  # how the reason a commit gives starts
ParamName = Annotated[str, StringConstraints(max_length=MAX_PARAM_NAME_CHARS)]


class BucketFinding(BaseModel):
    """One gradient bucket that held a NaN or an infinity before its all-reduce.

    Attributes:
        index: DDP's bucket index (0 is the one reduced first).
        kind: ``"NaN"`` (a NaN among its values) or ``"Inf"`` (an infinity, no NaN).
        params: the first names of the parameters in it, in the bucket's order.
        more_params: parameters in it whose names were left out.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0)
    kind: Literal["NaN", "Inf"]
    params: list[ParamName] = Field(default_factory=list, max_length=MAX_PARAM_NAMES)
    more_params: int = Field(0, ge=0)


class NumericsSaid(BaseModel):
    """What one rank says of its gradient's values in one attempt of a step.

    Attributes:
        checked: buckets whose values were checked (0: nothing was: the attempt failed before
            its backward, or no bucket could be checked).
        passed: buckets passed through unchecked (an integer dtype, empty, sparse), each reason
            logged once where it happened.
        nonfinite: the checked buckets that held a NaN or an infinity, by index, the first
            :data:`MAX_FLAGGED_BUCKETS`.
        more_buckets: further flagged buckets left out of ``nonfinite``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    checked: int = Field(0, ge=0)
    passed: int = Field(0, ge=0)
    nonfinite: list[BucketFinding] = Field(default_factory=list, max_length=MAX_FLAGGED_BUCKETS)
    more_buckets: int = Field(0, ge=0)


def _clip_name(name: str) -> str:
    # A name's end says which tensor it is ("...layers.11.attn.q_proj.weight"): that part is kept.
    return name if len(name) <= MAX_PARAM_NAME_CHARS else "..." + name[-(MAX_PARAM_NAME_CHARS - 3) :]


def bucket_finding(index: int, kind: Literal["NaN", "Inf"], names: Sequence[str]) -> BucketFinding:
    """A flagged bucket, its names cut to the bounds.

    Args:
        index: the bucket's index.
        kind: ``"NaN"`` or ``"Inf"``.
        names: every parameter name in the bucket, in its order.

    Returns:
        The :class:`BucketFinding`.
    """
    kept = [_clip_name(n) for n in names[:MAX_PARAM_NAMES]]
    return BucketFinding(index=index, kind=kind, params=kept, more_params=max(0, len(names) - MAX_PARAM_NAMES))


def numerics_said(checked: int, passed: int, flagged: Sequence[BucketFinding]) -> NumericsSaid:
    """A rank's statement, its flagged buckets in index order and cut to the bound.

    Args:
        checked: buckets checked.
        passed: buckets passed through unchecked.
        flagged: the flagged buckets, in any order.

    Returns:
        The :class:`NumericsSaid`.
    """
    ordered = sorted(flagged, key=lambda b: b.index)
    kept = ordered[:MAX_FLAGGED_BUCKETS]
    return NumericsSaid(checked=checked, passed=passed, nonfinite=kept, more_buckets=len(ordered) - len(kept))


def _bucket_words(bucket: BucketFinding) -> str:
    names = ", ".join(bucket.params)
    more = f" and {bucket.more_params} more" if bucket.more_params else ""
    return (
        f"{bucket.kind} in bucket {bucket.index} ({names}{more})"
        if names
        else f"{bucket.kind} in bucket {bucket.index}"
    )


def describe(buckets: Sequence[BucketFinding], more_buckets: int = 0) -> str:
    """A rank's flagged buckets in words, as its commit reason starts: ``"non-finite gradient: NaN in
    bucket 0 (fc.weight, fc.bias)"``.

    Args:
        buckets: the flagged buckets.
        more_buckets: flagged buckets left out.

    Returns:
        The reason (the commit cuts it to its length bound).
    """
    more = f"; {more_buckets} more bucket(s)" if more_buckets else ""
    return f"{NONFINITE}: " + "; ".join(_bucket_words(b) for b in buckets) + more


def outcome_words(step: int, nonfinite: Mapping[int, Sequence[BucketFinding]], finite: Sequence[int]) -> str:
    """A step's finding in one sentence, the same on every rank (pure).

    Args:
        step: the loop's step number.
        nonfinite: by rank, its flagged buckets.
        finite: the ranks whose checked buckets were all finite.

    Returns:
        ``"step 5: non-finite gradient on rank 1 (NaN in bucket 0 (...)); ranks 0,2 were finite"``.
    """
    ranks = sorted(nonfinite)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"

    def of(rank: int) -> str:
        return "; ".join(_bucket_words(b) for b in nonfinite[rank])

    parts = of(ranks[0]) if len(ranks) == 1 else "; ".join(f"rank {r}: {of(r)}" for r in ranks)
    if finite:
        others = f"rank {finite[0]} was finite" if len(finite) == 1 else f"ranks {rank_ranges(finite)} were finite"
    else:
        others = "no other rank's gradient was checked"
    return f"step {step}: {NONFINITE} on {who} ({parts}); {others}"
