"""A numerical fault in words, for the report, ``status`` and the timeline (pure).

:func:`numerics_line` is the one line (the incident's reason and summary, the picture's title);
:func:`seen_lines`, :func:`done_lines` and :func:`advice` are the report's sections
(:mod:`ncclguard.incidents.render`); :func:`marks` names what each flagged rank held, for the
pictures (:mod:`ncclguard.incidents.pictures`).
"""

from __future__ import annotations

from ncclguard.incidents.numerics_model import DriftReport, FlaggedBucket, NonFiniteReport

__all__ = ["advice", "bucket_text", "done_lines", "marks", "numerics_line", "seen_lines"]

Report = NonFiniteReport | DriftReport


def _who(ranks: str) -> str:
    """``"1"`` -> ``"rank 1"``; ``"0,2"`` -> ``"ranks 0,2"``."""
    return f"rank {ranks}" if ranks.isdigit() else f"ranks {ranks}"


def _count(ranks: str) -> int:
    """How many ranks rank ranges hold (a cut set: those written)."""
    n = 0
    for part in ranks.rstrip("…").split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            n += int(hi) - int(lo) + 1 if hi.isdigit() else 1
    return n


def _holds(ranks: str, rank: int) -> bool:
    """Whether rank ranges hold ``rank``."""
    for part in ranks.rstrip("…").split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and int(lo) <= rank <= (int(hi) if hi.isdigit() else int(lo)):
            return True
    return False


def bucket_text(bucket: FlaggedBucket) -> str:
    """``"NaN in bucket 1 (fc2.bias, fc2.weight and 3 more)"``."""
    names = ", ".join(bucket.params)
    more = f" and {bucket.more_params} more" if bucket.more_params else ""
    return f"{bucket.kind} in bucket {bucket.index}" + (f" ({names}{more})" if names else "")


def _where(report: Report) -> str:
    """``"step 5"``, ``"step 5 (attempt 2, phase train)"``."""
    notes = ([f"attempt {report.attempt}"] if report.attempt > 1 else []) + (
        [f"phase {report.phase}"] if report.phase else []
    )
    return f"step {report.step}" + (f" ({', '.join(notes)})" if notes else "")


def _suspects(report: Report) -> str:
    if not report.suspects:
        return ""
    who = ", ".join(str(r) for r in report.suspects)
    many = len(report.suspects) > 1
    return (
        f"; rank{'s' if many else ''} {who} {'are' if many else 'is'} now a suspect device (flagged again soon after)"
    )


def _nonfinite_line(report: NonFiniteReport) -> str:
    named = {n.rank: "; ".join(bucket_text(b) for b in n.buckets) for n in report.named}
    left = _count(report.ranks) - len(named)
    if report.ranks.isdigit() and named:
        held = f"{_who(report.ranks)}'s gradient held {next(iter(named.values()))}"
    else:
        parts = [f"rank {r}: {text}" for r, text in named.items()] + ([f"{left} more ranks"] if left > 0 else [])
        held = f"{_who(report.ranks)}'s gradients were not finite ({'; '.join(parts)})"
    finite = f"{_who(report.finite)} finite" if report.finite else "no other rank's gradient was checked"
    done = {
        "redo": "the step was redone",
        "skip": "the step was skipped (not applied)",
        "raise": "the step was not applied: NonFiniteGradient raised on every rank",
    }[report.action]
    return f"{_where(report)}: {held}; {finite}; {done}{_suspects(report)}"


def _drift_parts(report: DriftReport) -> str:
    return "; ".join(f"{part}: {_who(ranks)}" for part, ranks in report.parts.items())


def _drift_line(report: DriftReport) -> str:
    head = f"{_where(report)}: a silent corruption was seen: "
    if not report.majority:
        return (
            head + f"the replicas of {_who(report.ranks)} differ ({_drift_parts(report)}) and no digest is held by a "
            "majority, so which one drifted cannot be told; the step was not applied: ReplicasDiverged raised on "
            f"every rank{_suspects(report)}"
        )
    many = not report.ranks.isdigit()
    seen = (
        f"{_who(report.ranks)}'s {'replicas' if many else 'replica'} drifted from {_who(report.majority)}'s "
        f"({_drift_parts(report)}); the step was not applied"
    )
    source = f"rank {report.source}" if report.source is not None else "a majority rank"
    if report.outcome == "healed":
        then = (
            f"{_who(report.ranks)} {'were' if many else 'was'} healed from {source} in this world and the step redone"
        )
    else:
        then = f"healing {_who(report.ranks)} from {source} failed: the world is rebuilt"
    return f"{head}{seen}; {then}{_suspects(report)}"


def numerics_line(report: Report) -> str:
    """The finding in one line: the incident's reason and summary.

    Args:
        report: the finding.

    Returns:
        ``"step 5: rank 1's gradient held NaN in bucket 0 (fc.weight, fc.bias); ranks 0,2 finite; the
        step was redone"``, or for a drift ``"step 8: a silent corruption was seen: rank 2's replica
        drifted from ranks 0-1's (parameters: rank 2); ..."``.
    """
    return _nonfinite_line(report) if isinstance(report, NonFiniteReport) else _drift_line(report)


def seen_lines(report: Report) -> list[str]:
    """The report's section on what the commit saw: a heading and a line per rank (or part).

    Args:
        report: the finding.

    Returns:
        The lines, the first a heading, the others indented by two spaces.
    """
    phase = f"phase {report.phase}" if report.phase else "no phase set"
    where = f"step {report.step}, attempt {report.attempt}, {phase}"
    if isinstance(report, NonFiniteReport):
        out = [f"NON-FINITE GRADIENT ({where}; each bucket checked in the backward, before its all-reduce)"]
        out += [f"  rank {n.rank}: {'; '.join(bucket_text(b) for b in n.buckets)}" for n in report.named]
        left = _count(report.ranks) - len(report.named)
        if left > 0:
            out.append(f"  {left} more of {_who(report.ranks)}: not detailed")
        out.append(f"  {_who(report.finite)}: finite" if report.finite else "  no other rank's gradient was checked")
        return out
    out = [f"SILENT CORRUPTION ({where}; the replicas' digests compared at the commit, before the step was applied)"]
    out += [f"  {part}: {_who(ranks)} differed" for part, ranks in report.parts.items()]
    if report.majority:
        out.append(f"  {_who(report.majority)}: the majority (the same digests)")
    else:
        out.append("  no digest is held by a majority: which replica drifted cannot be told")
    return out


def done_lines(report: Report) -> list[str]:
    """The report's section on what the engine did (the same on every rank)."""
    head = "WHAT WAS DONE (the same on every rank; the step was not applied on any rank)"
    if isinstance(report, NonFiniteReport):
        text = {
            "redo": "its state was put back and the step ran again on the same world (no rebuild; on_nonfinite='redo')",
            "skip": "its state was put back and its batch skipped: the loop went on with the next (on_nonfinite='skip')",
            "raise": "NonFiniteGradient was raised on every rank (on_nonfinite='raise')",
        }[report.action]
    elif report.outcome == "healed":
        text = f"{_who(report.ranks)} healed from rank {report.source} in this world (no rebuild), the step redone"
    elif report.outcome == "heal failed":
        text = (
            f"healing {_who(report.ranks)} from rank {report.source} failed: the world is rebuilt, as after any failure"
        )
    else:
        text = "ReplicasDiverged was raised on every rank; nothing was healed"
    suspects = [
        f"  rank {r}: named a suspect device (flagged again soon after an earlier finding)" for r in report.suspects
    ]
    return [head, f"  {text}", *suspects]


def advice(report: Report) -> list[str]:
    """What to do about it, each tip one line (the report's WHAT TO DO)."""
    tips: list[str] = []
    if isinstance(report, NonFiniteReport):
        if not report.finite:
            tips.append(
                "no rank's gradient was finite: the cause is shared (the learning rate, a loss scale, the state "
                "of the model), not one rank's batch or device"
            )
        tips.append(
            {
                "redo": "a one-off (an overflow, a flipped bit): nothing to do while it stays rare",
                "skip": f"look at {_who(report.ranks)}'s batch of step {report.step} and at the layers of the "
                "parameters named; a batch that overflows again is skipped again",
                "raise": f"resume from your last checkpoint; look first at {_who(report.ranks)}'s batch of step "
                f"{report.step} and at the layers of the parameters named",
            }[report.action]
        )
    elif report.outcome == "raised":
        tips.append("resume from a checkpoint; with three or more ranks the drifted replica is named and healed")
    elif not report.suspects:
        tips.append(
            f"{_who(report.ranks)}'s copy of the model changed with no error raised (most often a bit flipped in "
            "its GPU's memory): if it drifts again it is named a suspect device"
        )
    if report.suspects:
        tips.append(
            f"suspect device on {', '.join(f'rank {r}' for r in report.suspects)}: check its GPU "
            "(nvidia-smi -q -d ECC, dcgmi diag) and take its host out of the job if it comes back"
        )
    return tips


def marks(report: Report) -> dict[int, str]:
    """What each named rank held, for the pictures: ``{1: "NaN in bucket 1 (fc2.bias, ...)"}``."""
    if isinstance(report, NonFiniteReport):
        return {n.rank: "; ".join(bucket_text(b) for b in n.buckets) for n in report.named}
    return {
        r: f"replica drifted ({', '.join(p for p, ranks in report.parts.items() if _holds(ranks, r))})"
        for r in report.named
    }
