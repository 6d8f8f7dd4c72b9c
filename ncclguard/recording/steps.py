"""Step marks: ``ncclguard.mark_step()`` at the top of each training step, so the watchdog can say which
step each rank is in and count the steps of each straggler window. One counter and one int per process."""

from __future__ import annotations

__all__ = ["StepMarks", "mark_step", "steps"]


class StepMarks:
    """The steps this process marked: how many marks, and the step number of the last one."""

    __slots__ = ("count", "step")

    def __init__(self) -> None:
        self.count = 0  # marks so far (the watchdog counts a window's steps from it)
        self.step: int | None = None  # the last step marked; None before the first mark


steps = StepMarks()


def mark_step(step: int | None = None) -> int:
    """Marks the start of a training step (call it once per step, from the training loop).

    Args:
        step: the step's number; default: the last one plus 1 (0 for the first).

    Returns:
        The step's number, as the heartbeat will show it.

    Raises:
        ValueError: ``step`` is negative.
    """
    if step is None:
        step = 0 if steps.step is None else steps.step + 1
    elif step < 0:
        raise ValueError(f"a step number is >= 0, got {step}")
    steps.step = step
    steps.count += 1
    return step
