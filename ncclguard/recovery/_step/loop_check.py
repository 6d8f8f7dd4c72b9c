"""Whether the ranks' loops are at one step: a loop that does not follow a rewind is told so.

After a restore that sent every rank back to a snapshot's step (``StepResult.rewound_to``), a loop
written ``for step in range(...)`` goes on from where it was while the restarted rank starts at the
snapshot's step. Their collectives still match, so nothing but the step numbers shows it, and a
rebuild cannot mend it: each new world would fail the same way. So the first commit that shows it
ends the loop on every rank with the line to write instead (:class:`~ncclguard.errors.LoopDiverged`).
"""

from __future__ import annotations

from ncclguard.errors import LoopDiverged
from ncclguard.recovery._commit.statements import STEP_DIFFERS
from ncclguard.recovery.commit import CommitResult

__all__ = ["FIX", "diverged", "not_rewound"]

FIX = (
    "write the loop as `for step in stepper.steps(STOP):` (it starts a restarted process at "
    "stepper.resume_step and goes back when StepResult.rewound_to says so), or go back by hand to "
    "the step StepResult.rewound_to names"
)


def not_rewound(step: int, rewind_to: int) -> LoopDiverged:
    """This rank's failure when its loop passes ``step`` after every rank went back to ``rewind_to``."""
    return LoopDiverged(f"this rank's loop passed step={step} after every rank went back to step {rewind_to}")


def diverged(res: CommitResult) -> LoopDiverged | None:
    """The error every rank raises when a failed commit shows the ranks' loops at different steps
    (the same outcome on every rank, so the same answer), or None."""
    if res:
        return None
    mark = f"{LoopDiverged.__name__}: "  # a rank's own failure, as its statement words it
    why = {r: [t for t in texts if t.startswith(STEP_DIFFERS) or mark in t] for r, texts in res.reasons.items()}
    why = {r: texts for r, texts in why.items() if texts}
    if not why:
        return None
    said = "; ".join(f"rank {r} {', '.join(texts)}" for r, texts in sorted(why.items()))
    return LoopDiverged(
        f"the ranks' loops are at different steps ({said}): no rebuild can mend that; {FIX}",
        step=res.step,
        failed_ranks=sorted(why),
        reasons=why,
    )
