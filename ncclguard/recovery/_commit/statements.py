"""What the ranks say at a step's commit, and the outcome settled from it: pure functions.

Each rank publishes a :class:`CommitStatement` (its step count, world generation, group, the backend's
sequence number on the group, and what went wrong on it since its last commit); the first rank
able to settle the round turns the statements present into one :class:`CommitOutcome` with
:func:`decide`, and every rank reads that outcome (:mod:`ncclguard.recovery.commit`). Nothing
here touches a store or a process group, so the outcome logic is tested without processes.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ncclguard._naming import rank_ranges
from ncclguard.recovery._numerics.drift import MAX_REPLICA_PARTS, PartName, ReplicaDrift, drift_reason, replica_drift
from ncclguard.recovery._numerics.findings import (
    MAX_FLAGGED_BUCKETS,
    MAX_PARAM_NAME_CHARS,
    MAX_PARAM_NAMES,
    BucketFinding,
    NumericsSaid,
    describe,
)
from ncclguard.store.keys import RoundKeys

__all__ = [
    "MAX_DIGEST_CHARS",
    "MAX_GENERATORS",
    "MAX_GENERATOR_NAME_CHARS",
    "MAX_GROUPS",
    "MAX_GROUP_NAME_CHARS",
    "MAX_PROBLEMS",
    "MAX_REASON_CHARS",
    "MAX_STATEMENT_BYTES",
    "STEP_DIFFERS",
    "CommitOutcome",
    "CommitStatement",
    "commit_keys",
    "decide",
    "flag_nonfinite",
    "generators_apart",
    "only_nonfinite",
    "outcome_limit",
    "refused_text",
]

MAX_PROBLEMS = 8  # problems one rank states at most (the rest are summed up in the last)
MAX_REASON_CHARS = 300  # characters of one stated problem
MAX_GROUPS = 16  # other groups whose sequence numbers one rank states at most
MAX_GROUP_NAME_CHARS = 64  # torch names groups "0", "1", ... or by a 40-character hash
GroupName = Annotated[str, StringConstraints(max_length=MAX_GROUP_NAME_CHARS)]
MAX_GENERATORS = 8  # generators one rank states a digest of (torch, CUDA, random, NumPy)
MAX_GENERATOR_NAME_CHARS, MAX_DIGEST_CHARS = 16, 64  # a generator's name, its digest (16 hex digits now)
GeneratorName = Annotated[str, StringConstraints(max_length=MAX_GENERATOR_NAME_CHARS)]
Digest = Annotated[str, StringConstraints(max_length=MAX_DIGEST_CHARS)]
STEP_DIFFERS = "passed step="  # how a rank whose step number differs is worded (_step.guards.diverged reads it)
MAX_STATEMENT_BYTES = 16 * 1024  # a statement's JSON, bounded by the bounds above and the numerics'
# What one rank's numerics take at most in JSON (flagged buckets, their names and keys).
_NUMERICS_BYTES = 128 + MAX_FLAGGED_BUCKETS * (96 + MAX_PARAM_NAMES * (MAX_PARAM_NAME_CHARS + 4))


class CommitStatement(BaseModel):
    """One rank's account of its step.

    Attributes:
        rank: this rank in the group.
        step: this rank's commit count in its world (0 for the first).
        user_step: the step number the caller passed, or None.
        generation: the world generation the rank is in.
        group: the group's name.
        group_size: the group's size as this rank sees it.
        seq: the backend's sequence number on the group (every collective it ran, whoever issued
            it), or None where it cannot be read.
        other_seqs: the same for each other group this rank is a member of, by group name.
        p2p_groups: the groups on which this rank's flight recorder saw point-to-point ops: gloo
            counts a send or recv in the sequence number of the two ranks it joins only, so those
            numbers differ between healthy ranks and are not compared. ``"*"``: every group.
        problems: what went wrong on this rank since its last commit (empty: a clean step).
        stop: this rank was asked to stop (SIGTERM; :mod:`ncclguard.recovery.preempt`).
        generators: a digest of each random generator as the step found it, by generator name,
            stated where a heal from a live peer hands over the peer's generators (empty: not
            stated); compared, never failing the step (see CommitOutcome.generators_apart).
        numerics: what the recovery engine's check saw of this rank's gradient before the
            reduction (:mod:`ncclguard.recovery._numerics`); None: not checked. A flagged bucket
            fails the step, this rank named.
        replicas: a digest of this rank's replica by part (``"parameters"``, ``"optimizer"``) as the
            step found it, at the replica check's steps (empty: not stated); a rank whose digest
            differs from the majority's fails the step (CommitOutcome.drift).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    user_step: int | None = Field(default=None, ge=0)
    generation: int = Field(ge=0)
    group: str = Field(max_length=255)
    group_size: int = Field(ge=1)
    seq: int | None = Field(default=None, ge=0)
    other_seqs: dict[GroupName, Annotated[int, Field(ge=0)]] = Field(default_factory=dict, max_length=MAX_GROUPS)
    p2p_groups: list[GroupName] = Field(default_factory=list, max_length=MAX_GROUPS)
    problems: list[str] = Field(default_factory=list, max_length=MAX_PROBLEMS)
    stop: bool = False
    generators: dict[GeneratorName, Digest] = Field(default_factory=dict, max_length=MAX_GENERATORS)
    numerics: NumericsSaid | None = None
    replicas: dict[PartName, Digest] = Field(default_factory=dict, max_length=MAX_REPLICA_PARTS)


class CommitOutcome(BaseModel):
    """A step's outcome, settled once for every rank.

    Attributes:
        ok: every rank arrived with a clean step, and they agree on what they did.
        step: the commit count the round was held for.
        arrived: the ranks whose statement was in the store when it was settled (sorted).
        failed: why each failed rank failed (rank -> reasons); empty when ``ok``.
        early: settled before the deadline, the ranks missing being known dead.
        stop: a rank whose statement arrived was asked to stop: every rank stops after this step.
        generators_apart: by generator name, the ranks whose generator differs from the one most
            ranks hold (every stating rank where no state is held by most): ranks seeded apart.
            Empty when the stated generators agree or none were stated.
        nonfinite: by rank, the gradient buckets that held a NaN or an infinity before the
            reduction (each such rank is in ``failed`` too); empty when none did.
        finite: the ranks that stated a checked gradient with no such bucket (sorted).
        drift: the ranks whose stated replica digest differs from the majority's (each in
            ``failed`` too) and the majority; None when the stated digests agree or none were stated.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool
    step: int = Field(ge=0)
    arrived: list[int]
    failed: dict[int, list[str]] = Field(default_factory=dict)
    early: bool = False
    stop: bool = False
    generators_apart: dict[GeneratorName, list[int]] = Field(default_factory=dict, max_length=MAX_GENERATORS)
    nonfinite: dict[int, list[BucketFinding]] = Field(default_factory=dict)
    finite: list[int] = Field(default_factory=list)
    drift: ReplicaDrift | None = None


def outcome_limit(size: int) -> int:
    """The most bytes a outcome among ``size`` ranks may take (every rank failed, at length)."""
    return 4096 + size * (16 + MAX_GENERATORS * 8 + (MAX_PROBLEMS + 6) * (MAX_REASON_CHARS + 8) + _NUMERICS_BYTES)


def commit_keys(group: str, generation: int, step: int, restart: str | None = None) -> RoundKeys:
    """The round keys of step ``step``'s commit on ``group`` in world ``generation``.

    Args:
        group: the group's name.
        generation: the world generation.
        step: the commit count.
        restart: the launcher's restart count (default ``TORCHELASTIC_RESTART_COUNT``, else
            ``"0"``): a restarted job's rounds never meet the keys its previous run left.

    Returns:
        Keys under ``ncclguard/commit/<restart>/<group>/g<generation>/s<step>``.
    """
    if restart is None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return RoundKeys(f"ncclguard/commit/{restart}/{group}/g{generation}/s{step}")


def clip(text: str) -> str:
    """``text`` cut to :data:`MAX_REASON_CHARS` characters."""
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _odd_ones(values: Mapping[int, Any]) -> tuple[dict[int, Any], Any]:
    """The ranks whose value differs from the one most ranks hold, and that value.

    With no single most common value (two ranks, two values), every rank is odd and the second
    element is None.
    """
    counts = Counter(values.values()).most_common()
    if len(counts) <= 1:
        return {}, counts[0][0] if counts else None
    if counts[0][1] == counts[1][1]:
        return dict(values), None
    common = counts[0][0]
    return {r: v for r, v in values.items() if v != common}, common


def _name(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def _note_odd(
    held: Mapping[int, Any],
    failed: dict[int, list[str]],
    alone: Callable[[Any, str], str],
    odd: Callable[[Any, Any, str], str],
) -> None:
    """Adds to ``failed`` a reason for each rank whose value in ``held`` differs from the common one.

    ``odd(value, common, like)`` words it when most ranks agree (``like`` names them);
    ``alone(value, theirs)`` when no value is held by most (``theirs`` lists the others' values).
    """
    odd_ranks, common = _odd_ones(held)
    for r in sorted(odd_ranks):
        if common is None:
            theirs = ", ".join(f"rank {q}: {held[q]!r}" for q in sorted(held) if q != r)
            text = alone(held[r], theirs)
        else:
            text = odd(held[r], common, _name(sorted(q for q, v in held.items() if v == common)))
        failed.setdefault(r, []).append(clip(text))


def _sequence_texts(group: str | None) -> tuple[Callable[[Any, str], str], Callable[[Any, Any, str], str]]:
    """How a differing sequence number is worded: on the committed group (None) or on ``group``."""
    where = "the group" if group is None else f"group {group!r}"

    def alone(seq: int, theirs: str) -> str:
        return f"the backend ran {seq} collectives on {'its group' if group is None else where}, the others differ ({theirs})"

    def odd(seq: int, common: int, like: str) -> str:
        diff = seq - common
        return (
            f"issued {abs(diff)} collective(s) {'more' if diff > 0 else 'fewer'} than {like} on {where} "
            f"(backend sequence number {seq}, theirs {common})"
        )

    return alone, odd


def _disagreements(statements: Mapping[int, CommitStatement], failed: dict[int, list[str]]) -> None:
    """Adds to ``failed`` the ranks that disagree with the others on what they did."""

    def note(field: str, what: Callable[[Any], str], others: Callable[[Any], str]) -> None:
        _note_odd(
            {r: getattr(s, field) for r, s in statements.items()},
            failed,
            lambda v, theirs: f"{what(v)}; the others differ ({theirs})",
            lambda v, common, like: f"{what(v)}, where {like} {others(common)}",
        )

    note("generation", lambda v: f"is in world generation {v}", lambda v: f"are in generation {v}")
    note("group", lambda v: f"committed on group {v!r}", lambda v: f"committed on group {v!r}")
    note("group_size", lambda v: f"sees a group of {v} ranks", lambda v: f"see {v}")
    note("step", lambda v: f"is at commit {v} of its world", lambda v: f"are at commit {v}")
    if any(s.user_step is not None for s in statements.values()):
        note("user_step", lambda v: f"{STEP_DIFFERS}{v}", lambda v: f"{STEP_DIFFERS}{v}")
    p2p = {g for s in statements.values() for g in s.p2p_groups}
    if "*" in p2p:
        return
    if not any(s.group in p2p for s in statements.values()):
        _note_odd({r: s.seq for r, s in statements.items() if s.seq is not None}, failed, *_sequence_texts(None))
    for name in sorted({g for s in statements.values() for g in s.other_seqs} - p2p):
        held = {r: s.other_seqs[name] for r, s in statements.items() if name in s.other_seqs}
        _note_odd(held, failed, *_sequence_texts(name))


def decide(
    statements: Mapping[int, CommitStatement | None],
    size: int,
    step: int,
    timeout_s: float,
    dead: Mapping[int, str] | None = None,
    early: bool = False,
) -> CommitOutcome:
    """The outcome of step ``step``'s commit from the statements present when it is settled.

    Args:
        statements: by rank, the statements found in the store (None: there but unreadable).
        size: the group's size: a rank in ``0..size-1`` not in ``statements`` did not arrive.
        step: the commit count the round was held for.
        timeout_s: the commit's deadline, for the missing ranks' reason.
        dead: missing ranks known dead, with how it is known (the reason given instead).
        early: the outcome is settled before the deadline because of them.

    Returns:
        The outcome: ok only when every rank arrived with a readable, clean statement and the
        statements agree on generation, group, step and the backend's sequence number.
    """
    failed: dict[int, list[str]] = {}
    for r in range(size):
        if r not in statements and dead and r in dead:
            failed[r] = [clip(dead[r])]
        elif r not in statements:
            failed[r] = [f"did not reach should_commit for commit {step} within {timeout_s:g} s"]
        elif statements[r] is None:
            failed[r] = ["its statement could not be read"]
    readable = {r: s for r, s in statements.items() if s is not None and 0 <= r < size}
    for r, s in readable.items():
        if s.problems:
            failed[r] = [clip(p) for p in s.problems]
    nonfinite, finite = flag_nonfinite({r: s.numerics for r, s in readable.items()}, failed)
    drift = replica_drift({r: s.replicas for r, s in readable.items()})
    if drift is not None:
        for r in drift.ranks:
            failed.setdefault(r, []).append(clip(drift_reason(r, drift)))
    if len(readable) > 1:
        _disagreements(readable, failed)
    arrived = sorted(r for r in statements if 0 <= r < size)
    stop = any(s.stop for s in readable.values())  # one rank asked: all stop at the same step
    return CommitOutcome(
        ok=not failed,
        step=step,
        arrived=arrived,
        failed=dict(sorted(failed.items())),
        early=early,
        stop=stop,
        generators_apart=generators_apart(readable),
        nonfinite=nonfinite,
        finite=finite,
        drift=drift,
    )


def flag_nonfinite(
    said: Mapping[int, NumericsSaid | None], failed: dict[int, list[str]]
) -> tuple[dict[int, list[BucketFinding]], list[int]]:
    """The ranks whose stated gradient held a NaN or an infinity, each added to ``failed`` with its
    buckets in words, and those whose checked gradient was finite (pure).

    Args:
        said: by rank, what its check stated (None: not checked).
        failed: the outcome's reasons by failed rank, added to.

    Returns:
        The flagged buckets by rank, and the finite ranks (sorted).
    """
    nonfinite: dict[int, list[BucketFinding]] = {}
    finite: list[int] = []
    for r in sorted(said):
        numerics = said[r]
        if numerics is None or numerics.checked == 0:
            continue
        if numerics.nonfinite:
            nonfinite[r] = list(numerics.nonfinite)
            failed.setdefault(r, []).append(clip(describe(numerics.nonfinite, numerics.more_buckets)))
        else:
            finite.append(r)
    return nonfinite, finite


def only_nonfinite(failed: Mapping[int, list[str]], nonfinite: Mapping[int, object]) -> bool:
    """Whether a failed outcome failed for non-finite gradients alone: every failed rank flagged a
    bucket and gave no other reason (pure; the engine then acts on the values, not the world).

    Args:
        failed: the outcome's reasons by failed rank.
        nonfinite: the outcome's flagged ranks.

    Returns:
        True when there is a finding and nothing else failed.
    """
    return bool(nonfinite) and all(r in nonfinite and len(reasons) == 1 for r, reasons in failed.items())


def generators_apart(statements: Mapping[int, CommitStatement]) -> dict[str, list[int]]:
    """By generator name, the ranks whose stated generator differs from the one most ranks state.

    Args:
        statements: by rank, the readable statements.

    Returns:
        Each generator stated differently, with its odd ranks (sorted; every stating rank where no
        state is held by most); empty when they agree, or fewer than two ranks stated it.
    """
    names = sorted({g for s in statements.values() for g in s.generators})[:MAX_GENERATORS]
    apart: dict[str, list[int]] = {}
    for name in names:
        held = {r: s.generators[name] for r, s in statements.items() if name in s.generators}
        odd, _ = _odd_ones(held)
        if odd:
            apart[name] = sorted(odd)
    return apart


def refused_text(outcome: CommitOutcome, gen: int, step: int | None, first: int, late: bool, values: bool) -> str:
    """What a refused commit says: the caller's step (where it gave one: the commit's own count also
    counts redone attempts), the ranks that failed it, the first one's reasons, and what to do.

    Args:
        outcome: the refused outcome.
        gen: the world's generation.
        step: the caller's step number, or None.
        first: the rank whose reasons are quoted.
        late: this rank came after the outcome.
        values: only a NaN or a drifted replica refused it (the world is whole).
    """
    which = f"commit {outcome.step} (" if step is None else f"step {step} (commit {outcome.step}, "
    why = "; ".join(outcome.failed.get(first, ["?"]))
    then = (
        "redo the step or skip its batch (docs/numerics.md)"
        if values
        else "recover (ncclguard.rebuild_world, then redo the step)"
    )
    return (
        f"{which}world generation {gen}) may not be applied: ranks {rank_ranges(sorted(outcome.failed))} "
        f"failed it (rank {first}: {why}){'; this rank came after the outcome' if late else ''}. Skip the "
        f"optimizer step and {then}"
    )
