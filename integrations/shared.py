"""What the framework integrations (Hugging Face Trainer, Accelerate, Lightning) share.

The ``watchdog`` argument each takes, and the timeout order each checks when it starts: the
evaluation deadline and the watchdog's hang timeout must be below the process group's timeout
(``TrainingArguments.ddp_timeout``, ``InitProcessGroupKwargs(timeout=)``,
``DDPStrategy(timeout=)``), or the backend ends the job before ncclguard can skip or report.
The timeout order itself lives in :mod:`ncclguard.env.trainer` (``doctor`` uses it too); nothing
here imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncclguard import WatchdogConfig
from ncclguard.env.trainer import HF_DDP_TIMEOUT_DEFAULT_S, timeout_problems, trainer_timeout_notes
from ncclguard.evaluation.guard import EvalReport

__all__ = [
    "HF_DDP_TIMEOUT_DEFAULT_S",
    "SKIPPED",
    "SkippedEvaluation",
    "skip_record",
    "timeout_problems",
    "trainer_timeout_notes",
    "watchdog_config",
]


SKIPPED = object()  # the fallback handed to the guard: tells a skip apart from any result of the evaluation


@dataclass(frozen=True)
class SkippedEvaluation:
    """An evaluation (a validation, in Lightning) that every rank skipped.

    Attributes:
        step: the training step it was called at (None when not given).
        elapsed_s: seconds from the start of the guarded call to the agreed skip, on this rank.
        reason: why, as the ranks agreed (which rank failed, and how).
    """

    step: int | None
    elapsed_s: float
    reason: str


def skip_record(report: EvalReport | None, step: int | None, elapsed_s: float) -> SkippedEvaluation:
    """A :class:`SkippedEvaluation` from the guard's report (its last agreed reason)."""
    reason = report.reasons[-1] if report is not None and report.reasons else ""
    return SkippedEvaluation(step=step, elapsed_s=elapsed_s, reason=reason)


def watchdog_config(watchdog: WatchdogConfig | dict[str, Any] | bool | None) -> WatchdogConfig | None:
    """The watchdog settings from an integration's ``watchdog`` argument; None means no watchdog.

    Args:
        watchdog: a ``WatchdogConfig``; a dict of its fields; None or True (defaults, read from
            ``NCCLGUARD_WATCHDOG_*``); False (no watchdog).

    Returns:
        The settings, or None for False.

    Raises:
        TypeError: any other type.
        pydantic.ValidationError: an unknown field or a bad value in the dict.
    """
    if watchdog is False:
        return None
    if watchdog is None or watchdog is True:
        return WatchdogConfig()
    if isinstance(watchdog, WatchdogConfig):
        return watchdog
    if isinstance(watchdog, dict):
        return WatchdogConfig(**watchdog)
    raise TypeError(
        "watchdog must be a WatchdogConfig, a dict of its fields, None (defaults) or False (none), "
        f"got {type(watchdog).__name__}"
    )
