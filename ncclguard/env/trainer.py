"""The timeout order of a Hugging Face Trainer job, for ``doctor`` and the integrations.

A Trainer job's process group gets ``TrainingArguments.ddp_timeout`` as its timeout, not
``init_process_group``'s default; the evaluation deadline and the watchdog's hang timeout must be
below it, or the backend ends the job before ncclguard can skip or report. Nothing here imports a
framework, so ``python -m ncclguard doctor`` works without transformers installed.
"""

from __future__ import annotations

from ncclguard.env.hierarchy import TimeoutHierarchy

__all__ = ["HF_DDP_TIMEOUT_DEFAULT_S", "timeout_problems", "trainer_timeout_notes"]

# TrainingArguments.ddp_timeout's default (transformers 4.x and 5.x): the process-group timeout of
# every Trainer job that does not set it, under DDP and under DeepSpeed.
HF_DDP_TIMEOUT_DEFAULT_S = 1800.0


def timeout_problems(
    group_timeout_s: float | None, eval_timeout_s: float | None = None, hang_timeout_s: float | None = None
) -> list[str]:
    """The broken rules of the timeout order among a process-group timeout, an evaluation
    deadline and the watchdog's hang timeout (each must be below the first).

    Args:
        group_timeout_s: the process group's timeout (None: unknown, nothing to check).
        eval_timeout_s: the evaluation deadline, if any.
        hang_timeout_s: the watchdog's hang timeout, if any.

    Returns:
        One sentence per broken rule (from :class:`ncclguard.TimeoutHierarchy`); empty when the
        order holds.
    """
    if group_timeout_s is None:
        return []
    # model_construct: the problems are what is wanted here, not the validation error.
    order = TimeoutHierarchy.model_construct(
        group_timeout_s=group_timeout_s, eval_timeout_s=eval_timeout_s, watchdog_hang_s=hang_timeout_s
    )
    return order.problems()


def trainer_timeout_notes(
    ddp_timeout_s: float | None = None, eval_timeout_s: float | None = None, hang_timeout_s: float | None = None
) -> list[str]:
    """For ``doctor``: the Hugging Face Trainer's process-group timeout and what breaks its order.

    A Trainer job's process group gets ``TrainingArguments.ddp_timeout`` as its timeout (default
    1800 s), not ``init_process_group``'s default; ``guard_trainer`` warns at ``on_train_begin``
    when the evaluation deadline or the watchdog's hang timeout is not below it.

    Args:
        ddp_timeout_s: the job's ``ddp_timeout``; None for the default (1800 s).
        eval_timeout_s: ``guard_trainer``'s ``eval_timeout_s``, if known.
        hang_timeout_s: the watchdog's hang timeout, if known.

    Returns:
        A first line that names ``ddp_timeout`` and its value, then one line per broken rule.

    Raises:
        ValueError: a value that is not a positive number of seconds.
    """
    given = (("ddp_timeout_s", ddp_timeout_s), ("eval_timeout_s", eval_timeout_s), ("hang_timeout_s", hang_timeout_s))
    for name, value in given:
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    pg = HF_DDP_TIMEOUT_DEFAULT_S if ddp_timeout_s is None else float(ddp_timeout_s)
    source = "the default" if ddp_timeout_s is None else "given"
    head = (
        f"Hugging Face Trainer: the process-group timeout is TrainingArguments.ddp_timeout ({pg:g} s, {source}); "
        "guard_trainer's eval_timeout_s and the watchdog's hang timeout must be below it"
    )
    return [
        head,
        *(f"{p} (TrainingArguments.ddp_timeout={pg:g})" for p in timeout_problems(pg, eval_timeout_s, hang_timeout_s)),
    ]
