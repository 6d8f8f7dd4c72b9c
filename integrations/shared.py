"""What the framework integrations (Hugging Face Trainer, Accelerate, Lightning) share.

The ``watchdog`` argument each takes; the ``recover`` flag and the recovery keywords of the two
callbacks (``guard_trainer``, Lightning's ``NcclGuardCallback``); and the timeout order each checks
when it starts: the evaluation deadline and the watchdog's hang timeout must be below the process
group's timeout (``TrainingArguments.ddp_timeout``, ``InitProcessGroupKwargs(timeout=)``,
``DDPStrategy(timeout=)``), or the backend ends the job before ncclguard can skip or report.
The timeout order itself lives in :mod:`ncclguard.env.trainer` (``doctor`` uses it too); nothing
here imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncclguard import WatchdogConfig, current_watchdog, start_watchdog
from ncclguard.env.trainer import HF_DDP_TIMEOUT_DEFAULT_S, timeout_problems, trainer_timeout_notes
from ncclguard.evaluation.guard import EvalReport
from ncclguard.recovery.options import RecoveryKeywords, RecoveryOptions, check_recovery_keywords, recovery_options
from ncclguard.toolkit import log
from ncclguard.watching.watchdog import Watchdog

__all__ = [
    "HF_DDP_TIMEOUT_DEFAULT_S",
    "SKIPPED",
    "SkippedEvaluation",
    "recovery_for",
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


def watchdog_given(watchdog: WatchdogConfig | dict[str, Any] | bool | None) -> bool:
    """Whether an integration's ``watchdog`` argument names settings of its own (a dict or a
    ``WatchdogConfig``), rather than the defaults read from the environment."""
    return isinstance(watchdog, WatchdogConfig | dict)


def settings_not_used(mine: WatchdogConfig, running: WatchdogConfig, who: str) -> str | None:
    """What to tell the user when an integration keeps the watchdog already running in the process
    (``ncclguard run``'s, or the script's own) although its ``watchdog=`` named other settings.

    Args:
        mine: the settings the integration was given.
        running: the running watchdog's settings.
        who: the integration, as the log names it.

    Returns:
        A warning naming each setting not used, with the running value and how to set it; None
        when the running watchdog already has them.
    """
    a, b = mine.model_dump(), running.model_dump()
    differ = [f"{k}={a[k]!r} (running: {b[k]!r})" for k in sorted(a) if a[k] != b.get(k)]
    if not differ:
        return None
    flags = " ".join(f"--ncclguard-{k.replace('_', '-')}" for k in sorted(a) if a[k] != b.get(k))
    return (
        f"{who}: a watchdog already runs in this process and is kept (one per rank); these settings of "
        f"watchdog= are not used: {', '.join(differ)}. Under ncclguard run, pass them as {flags} (or "
        "NCCLGUARD_WATCHDOG_<FIELD>)"
    )


def start_or_keep(config: WatchdogConfig, given: bool, who: str) -> Watchdog | None:
    """An integration's watchdog: started with ``config``, unless one already runs in this process
    (``ncclguard run``'s, or the script's own), which is kept (one per rank). Settings of ``watchdog=``
    the running one lacks are said at WARNING (:func:`settings_not_used`), never dropped unsaid.

    Args:
        config: the integration's settings.
        given: its ``watchdog=`` named settings of its own (:func:`watchdog_given`).
        who: the integration, as the log names it.

    Returns:
        The watchdog started here, or None when the running one was kept.
    """
    running = current_watchdog()
    if running is None:
        return start_watchdog(config)
    said = settings_not_used(config, running.config, who) if given else None
    if said:
        log.warning("%s", said)
    else:
        log.info("%s: a watchdog already runs in this process; using it", who)
    return None


def recovery_for(recover: bool, keywords: RecoveryKeywords, who: str) -> RecoveryOptions | None:
    """The recovery engine's options a callback's ``recover`` flag asks for, or None without it.

    Args:
        recover: the callback's ``recover`` argument.
        keywords: the recovery keywords it was given (:class:`~ncclguard.recovery.options.RecoveryKeywords`).
        who: the callback's name, for the messages.

    Returns:
        The validated options with ``recover=True``; None with ``recover=False``.

    Raises:
        TypeError: ``recover`` is not a bool, an unknown keyword, or a value of the wrong type.
        ValueError: with ``recover=False``, a keyword that asks for what only recovery does; with
            ``recover=True``, a bad value (``pydantic.ValidationError``).
    """
    if not isinstance(recover, bool):
        raise TypeError(f"{who}'s recover must be a bool, got {recover!r}")
    if recover:
        return recovery_options(**keywords)
    # Without recover the values are not used, so only what would silently do nothing is refused
    # (a plain bound, or heal=False, passed from a config shared with recovering runs, is not).
    check_recovery_keywords(keywords)
    for name in ("allow_shrink", "heal"):
        if keywords.get(name):
            raise ValueError(f"{name} needs recover=True: without it no step is redone, on any world")
    if keywords.get("preempt_dir") is not None:
        raise ValueError("preempt_dir needs recover=True: without it no step is committed, so no stop is agreed")
    for name in ("snapshot_every", "snapshot_keep", "snapshot_spares", "snapshot_max_bytes"):
        if keywords.get(name) is not None:
            raise ValueError(f"{name} needs recover=True and heal=True: snapshots are kept for a heal")
    return None
