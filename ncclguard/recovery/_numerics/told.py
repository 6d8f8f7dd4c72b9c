"""A numerical finding told to the watchdog, which raises it as an incident (docs/numerics.md, "Where
the finding appears"): the ranks, the step, the buckets and their parameters, the finite ranks and
what the engine did, or the drifted replica and whom it was healed from.

Every rank reads the same commit outcome, so every rank tells the same finding under one signature,
and the store's claim raises it once (:func:`~ncclguard.watching.watchdog.tell`). Its report,
``ncclguard status`` and the incident's pictures show it. Without a watchdog running, the finding is
in the log and the engine's ``seen`` only. Before a raise (``on_nonfinite="raise"``,
:class:`~ncclguard.errors.ReplicasDiverged`) the rank waits, bounded, until it handled the incident,
since the process may end with the raise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Literal

from ncclguard._log import log
from ncclguard.incidents.model import (
    DriftReport,
    FlaggedBucket,
    IncidentKind,
    NamedRank,
    NonFiniteReport,
)
from ncclguard.incidents.numerics_model import MAX_NAMED_RANKS, ranks_field
from ncclguard.incidents.numerics_text import numerics_line
from ncclguard.recording.phase import main_thread_phase
from ncclguard.recovery._numerics.drift import ReplicaDrift
from ncclguard.recovery._numerics.findings import BucketFinding
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.watchdog import current_watchdog
from ncclguard.watching.watchdog import tell as tell_watchdog

__all__ = ["MAX_REASON_CHARS", "drift_report", "nonfinite_report", "tell", "tell_drift", "tell_nonfinite"]

MAX_REASON_CHARS = 1500  # the incident's reason, at most (the report holds every detail)
PHASE_CHARS = 200


def _phase() -> str:
    phase = main_thread_phase()
    return phase if len(phase) <= PHASE_CHARS else phase[: PHASE_CHARS - 1] + "…"


def nonfinite_report(
    step: int,
    attempt: int,
    nonfinite: Mapping[int, Sequence[BucketFinding]],
    finite: Sequence[int],
    action: Literal["redo", "skip", "raise"],
    suspects: Sequence[int] = (),
    commit: int = 0,
) -> NonFiniteReport:
    """The incident's report of a commit that named non-finite gradients.

    Args:
        step: the loop's step number.
        attempt: the step's attempt whose commit named them.
        nonfinite: by rank, its flagged buckets (the commit's outcome).
        finite: the ranks whose checked gradient was finite.
        action: what the engine did.
        suspects: the ranks this finding made suspect devices.
        commit: the commit's number in its world (``CommitResult.step``).

    Returns:
        The report, cut to its bounds (the first ranks named with their buckets).
    """
    ranks = sorted(nonfinite)
    named = [
        NamedRank(rank=r, buckets=[FlaggedBucket.model_validate(b.model_dump()) for b in nonfinite[r][:4]])
        for r in ranks[:MAX_NAMED_RANKS]
    ]
    return NonFiniteReport(
        step=step,
        attempt=attempt,
        commit=commit,
        at=time.time(),
        phase=_phase(),
        ranks=ranks_field(ranks),
        named=named,
        finite=ranks_field(list(finite)),
        action=action,
        suspects=sorted(suspects)[:MAX_NAMED_RANKS],
    )


def drift_report(
    step: int,
    attempt: int,
    drift: ReplicaDrift,
    outcome: Literal["healed", "heal failed", "raised"],
    source: int | None = None,
    suspects: Sequence[int] = (),
    commit: int = 0,
) -> DriftReport:
    """The incident's report of a commit that found a replica apart from the others.

    Args:
        step: the loop's step number.
        attempt: the step's attempt whose commit found it.
        drift: the commit's drift.
        outcome: ``"healed"``, ``"heal failed"`` or ``"raised"`` (no majority).
        source: the rank the drifted ones were healed from.
        suspects: the ranks this finding made suspect devices.
        commit: the commit's number in its world (``CommitResult.step``).

    Returns:
        The report.
    """
    return DriftReport(
        step=step,
        attempt=attempt,
        commit=commit,
        at=time.time(),
        phase=_phase(),
        ranks=ranks_field(drift.ranks),
        named=drift.ranks[:MAX_NAMED_RANKS],
        parts={part: ranks_field(odd) for part, odd in drift.parts.items()},
        majority=ranks_field(drift.majority),
        source=source,
        outcome=outcome,
        suspects=sorted(suspects)[:MAX_NAMED_RANKS],
    )


def tell(report: NonFiniteReport | DriftReport, who: str, wait: bool = False) -> None:
    """Tells this process's watchdog the finding, which raises it as a ``numerics`` incident; nothing
    without a watchdog.

    Args:
        report: the finding (the same on every rank).
        who: the adapter's name, for the log.
        wait: wait until this rank handled the incident (before a raise that may end the process):
            at most the watchdog's merge wait and two heartbeats.
    """
    wd = current_watchdog()
    if wd is None:
        return
    reason = numerics_line(report)
    named = [n.rank for n in report.named] if isinstance(report, NonFiniteReport) else list(report.named)
    det = Detection(
        IncidentKind.NUMERICS,
        reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 1] + "…",
        f"numerics/{report.what}/{report.commit}",  # one finding per commit; a loop's steps may repeat
        ranks=tuple(named),
        numerics=report,
    )
    bound = wd.config.merge_wait + 2 * wd.config.heartbeat_s if wait else 0.0
    if not tell_watchdog(det, bound) and wait:
        log.warning("%s: the incident of step %d's finding was not reported within %.3g s", who, report.step, bound)


def tell_nonfinite(
    step: int,
    attempt: int,
    nonfinite: Mapping[int, Sequence[BucketFinding]],
    finite: Sequence[int],
    action: Literal["redo", "skip", "raise"],
    suspects: Sequence[int],
    commit: int,
    who: str,
) -> None:
    """:func:`nonfinite_report` told (:func:`tell`; waited for before a raise); never raises: the
    finding is in the log already.

    Args:
        step, attempt, nonfinite, finite, action, suspects, commit: see :func:`nonfinite_report`.
        who: the adapter's name, for the log.
    """
    try:
        report = nonfinite_report(step, attempt, nonfinite, finite, action, suspects, commit)
        tell(report, who, wait=action == "raise")
    except Exception:  # noqa: BLE001 - the report of a finding must never cost the step
        log.exception("%s: step %d's non-finite gradient is not reported as an incident", who, step)


def tell_drift(
    step: int,
    attempt: int,
    drift: ReplicaDrift,
    outcome: Literal["healed", "heal failed", "raised"],
    source: int | None,
    suspects: Sequence[int],
    commit: int,
    who: str,
) -> None:
    """:func:`drift_report` told (:func:`tell`; waited for before a raise); never raises.

    Args:
        step, attempt, drift, outcome, source, suspects, commit: see :func:`drift_report`.
        who: the adapter's name, for the log.
    """
    try:
        tell(drift_report(step, attempt, drift, outcome, source, suspects, commit), who, wait=outcome == "raised")
    except Exception:  # noqa: BLE001 - the report of a finding must never cost the step
        log.exception("%s: step %d's drifted replica is not reported as an incident", who, step)
