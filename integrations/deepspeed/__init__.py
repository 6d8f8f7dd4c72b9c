"""patch_trainer: the guarded evaluation on a DeepSpeed trainer, and the guard's old import path.

The seeds' job died at its first evaluation: one rank was still evaluating while the others
waited for it in a collective, until NCCL's 10-minute watchdog killed the job. The guard that
prevents it, :func:`guarded_evaluate`, is framework-neutral and lives in
:mod:`ncclguard.evaluation.guard` (the HF Trainer, Accelerate and Lightning integrations use
it too); its names are re-exported here, so ``from ncclguard.integrations.deepspeed import
guarded_evaluate`` keeps working. What is DeepSpeed-shaped is :func:`patch_trainer`, which wraps a
trainer whose ``model`` is the engine.

Nothing here imports DeepSpeed: the engine is used as the ``torch.nn.Module`` it is.

:class:`~ncclguard.integrations.deepspeed.commit.CommittedEngineStep` (re-exported here) commits
every training step on every rank; a failed one is redone in process on a new engine (with
``rebuild_engine``) or ends in ``engine.save_checkpoint`` and exit 75.
:class:`~ncclguard.integrations.deepspeed.state.DeepSpeedState` (re-exported here) takes one rank's
ZeRO state out of an engine and puts it back, in memory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Unpack

import torch

from ncclguard.evaluation.guard import FAILED_METRIC, EvalReport, EvalSums, guarded_evaluate, last_report, run_guarded
from ncclguard.evaluation.options import EvalKeywords, GuardOptions, eval_options, python_deadline_guard

from .commit import EX_TEMPFAIL, CommittedEngineStep, EngineStepResult
from .state import DeepSpeedState, OwnState

__all__ = [
    "EX_TEMPFAIL",
    "CommittedEngineStep",
    "DeepSpeedState",
    "EngineStepResult",
    "OwnState",
    "FAILED_METRIC",
    "EvalKeywords",
    "EvalSums",
    "EvalReport",
    "GuardOptions",
    "guarded_evaluate",
    "patch_trainer",
    "unpatch_trainer",
    "last_report",
    "python_deadline_guard",
]

_ORIGINAL = "__ncclguard_original__"


def patch_trainer(trainer: Any, **evaluation: Unpack[EvalKeywords]) -> Any:
    """Wraps ``trainer.evaluate(step=None)`` in place with :func:`guarded_evaluate`.

    The trainer has the seeds' shape: ``trainer.model`` is the DeepSpeed engine, an optional
    ``trainer.monitor`` has ``log_metrics(dict, step)`` (used unless ``monitor=`` is given),
    and ``evaluate`` returns ``(loss, accuracy)``. Patching again replaces the options; the
    original ``evaluate`` is wrapped once. The report of the last call is
    ``trainer.last_eval_report``.

    Args:
        trainer: the trainer object.
        **evaluation: the evaluation keywords of :func:`guarded_evaluate`
            (:class:`~ncclguard.evaluation.options.EvalKeywords`; ``eval_timeout_s`` needed, its old
            name ``timeout_s`` works with a DeprecationWarning).

    Returns:
        ``trainer``.

    Raises:
        TypeError: the trainer has no callable ``evaluate`` or no ``model`` module.
        ValueError: invalid options.
    """
    original = getattr(getattr(trainer, "evaluate", None), _ORIGINAL, None) or getattr(trainer, "evaluate", None)
    if not callable(original):
        raise TypeError(f"{type(trainer).__name__} has no evaluate() method to guard")
    if not isinstance(getattr(trainer, "model", None), torch.nn.Module):
        raise TypeError(f"{type(trainer).__name__}.model must be the DeepSpeed engine (a torch.nn.Module)")
    opts = eval_options(stacklevel=3, **evaluation)
    takes_step = _takes_step(original)

    def evaluate(step: int | None = None) -> Any:
        # The trainer's monitor is looked up per call: trainers often attach it after construction.
        run = opts
        if opts.monitor is None:
            run = opts.model_copy(update={"monitor": getattr(trainer, "monitor", None)})
        value = run_guarded(trainer.model, (lambda: original(step=step)) if takes_step else original, run, step)
        trainer.last_eval_report = last_report()
        return value

    setattr(evaluate, _ORIGINAL, original)
    evaluate.__doc__ = f"guarded_evaluate around {getattr(original, '__qualname__', 'evaluate')}"
    trainer.evaluate = evaluate
    return trainer


def unpatch_trainer(trainer: Any) -> Any:
    """Undoes :func:`patch_trainer`; an unpatched trainer is returned unchanged."""
    original = getattr(getattr(trainer, "evaluate", None), _ORIGINAL, None)
    if original is None:
        return trainer
    if getattr(original, "__self__", None) is trainer and "evaluate" in vars(trainer):
        delattr(trainer, "evaluate")  # the class's method shows through again
    else:
        trainer.evaluate = original
    return trainer


def _takes_step(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "step" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
