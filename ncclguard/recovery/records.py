"""What the recovery engine tells its caller: a step's :class:`StepResult` and the :class:`Recovered`
record of a step applied after a redo. (A change of world, a rebuild or this rank left out, is told
through the world's one hook: :func:`ncclguard.world.subscribe`.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ncclguard._naming import rank_ranges
from ncclguard.errors import CommitFailed, NcclGuardError
from ncclguard.recovery.commit import CommitResult
from ncclguard.recovery.heal import HealResult
from ncclguard.recovery.snapshots.restore import Restored
from ncclguard.results import Result

__all__ = ["Recovered", "StepResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class Recovered:
    """A step that failed and was applied after a redo on a rebuilt world, as this rank saw it.

    Attributes:
        step: the caller's step number (the count of steps applied when it passes none).
        attempts: times the step ran (2 after one failure).
        generation: the world generation it was applied in.
        world_size: that world's size.
        failed_ranks: the ranks the failed commits named (their worlds' numbering).
        healed_ranks: the restarted ranks healed at its rebuilds (the new world's numbering).
        elapsed_s: seconds from the first attempt's start to the commit that was ok.
        timings: where those seconds went, summed over the attempts: ``attempt`` (the first
            attempt, its collectives' wait for the failed rank included), ``commit``, ``rebuild``
            (with a restarted rank: waiting for its process to come), ``heal``, ``rewrap``, ``redo``.
    """

    step: int
    attempts: int
    generation: int
    world_size: int
    failed_ranks: list[int]
    healed_ranks: list[int]
    elapsed_s: float
    timings: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        """The ``ncclguard_recover_*`` values every adapter logs (one builder for all of them)."""
        return {
            "ncclguard_recover_s": round(self.elapsed_s, 4),
            "ncclguard_recover_generation": self.generation,
            "ncclguard_recover_world_size": self.world_size,
            "ncclguard_recover_attempts": self.attempts,
            "ncclguard_recover_failed_ranks": rank_ranges(self.failed_ranks) if self.failed_ranks else "",
        }


@dataclass
class StepResult(Result, Generic[T]):
    """One step's transaction on this rank; truthy when the step may be applied (it committed).

    Attributes:
        ok: the step committed on every rank.
        attempts: times the step ran (1 without a failure).
        generation: the world generation it ended in.
        rebuilds: rebuilds it took.
        output: what the step returned in the last attempt (None if it raised).
        commits: every attempt's commit.
        elapsed_s: seconds from the transaction's start to its end.
        error: why the step may not be applied (:class:`~ncclguard.errors.CommitFailed` after the
            last attempt, :class:`~ncclguard.errors.RebuildFailed` when no world could be rebuilt,
            :class:`~ncclguard.errors.HealFailed` when restarted ranks joined and were not healed).
        healed: this rank's part in healing the restarted ranks that joined (None when none did):
            a :class:`~ncclguard.recovery.heal.HealResult` (a replicated model), or a
            :class:`~ncclguard.recovery.snapshots.restore.Restored` (sharded state, from snapshots).
        rewound_to: the snapshot's step every rank went back to when it is older than this step
            (falsy result): the loop must run again from there (``RecoveringStep.steps`` does).
        pending: a micro-batch of a gradient-accumulation window that commits at the window's last
            micro-batch: recorded, nothing settled or applied yet (truthy; the window's last result
            is the outcome).
        timings: with ``rewound_to``, where the seconds of the failed step went, as
            :attr:`Recovered.timings` (no :class:`Recovered` is made: the step was not applied);
            empty otherwise.
        skipped: a gradient held a NaN or an infinity on some rank and the step was skipped
            (``on_nonfinite``; falsy, ``error`` the :class:`~ncclguard.errors.NonFiniteGradient`
            that names it): its batch left no trace, and the loop goes on with the next.
    """

    ok: bool
    attempts: int
    generation: int
    rebuilds: int = 0
    output: T | None = None
    commits: list[CommitResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    error: NcclGuardError | None = None
    healed: HealResult | Restored | None = None
    rewound_to: int | None = None
    pending: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    skipped: bool = False

    def raise_for_error(self) -> StepResult[T]:
        """Raises :attr:`error` if the step may not be applied; returns self otherwise (for chaining)."""
        if self.error is not None:
            raise self.error
        if not self.ok:
            raise CommitFailed(f"the step was not applied after {self.attempts} attempt(s)")
        return self
