"""The one result base: what every call that returns instead of raising gives back.

A result is truthy when the call succeeded on this rank, carries ``error`` (an exception of
:mod:`ncclguard.errors`) when it did not, says how long the call took, and raises its error on
request. The result classes add what their call knows (the chunks of an all_reduce, the missing
ranks of a barrier, the outcome of a commit): :class:`~ncclguard.collectives.all_reduce.CollectiveResult`,
:class:`~ncclguard.collectives.barrier.BarrierResult`, :class:`~ncclguard.recovery.commit.CommitResult`,
:class:`~ncclguard.recovery.rebuild.RebuildResult`, :class:`~ncclguard.recovery.heal.HealResult`,
:class:`~ncclguard.recovery.records.StepResult`, :class:`~ncclguard.evaluation.guard.EvalReport`.

Example::

    res = ncclguard.safe_all_reduce(t, timeout=120)
    if not res:
        log.warning("skipped: %s", res.error)
    ncclguard.safe_barrier(timeout=300).raise_for_error()
"""

from __future__ import annotations

from typing import TypeVar

from ncclguard.errors import NcclGuardError

__all__ = ["Result"]

R = TypeVar("R", bound="Result")


class Result:
    """The base of every result (a mixin of the result dataclasses; it holds no data itself).

    Attributes:
        ok: the call succeeded on this rank.
        error: why it did not, or None.
        elapsed_s: seconds from the call's entry to its return.
    """

    __slots__ = ()  # a slotted result (CollectiveResult) stays slotted
    ok: bool
    error: NcclGuardError | None
    elapsed_s: float

    def __bool__(self) -> bool:
        return self.ok

    def raise_for_error(self: R) -> R:
        """Raises :attr:`error` if the call failed; returns self otherwise (for chaining).

        Raises:
            NcclGuardError: the result's error.
        """
        if self.error is not None:
            raise self.error
        return self
