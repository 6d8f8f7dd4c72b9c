"""guard_trainer and TrainerGuardCallback: phases, the watchdog and a guarded evaluation for ``transformers.Trainer``.

``guard_trainer(trainer, eval_timeout_s=600)`` on every rank, before ``trainer.train()``. What it
uses (transformers 5.x; docs/integrations.md has the table):

- :class:`TrainerGuardCallback` (a ``TrainerCallback``, added to the trainer): the watchdog from
  ``on_train_begin`` (the process group exists by then: ``TrainingArguments`` set it up, through
  Accelerate or DeepSpeed) to ``on_train_end``; the phase ``train step=<global_step>`` from
  ``on_step_begin``, kept open between steps with the next step's number (``on_step_end``), so
  that the logging, evaluation and saving the Trainer does between two steps nest inside it.
- ``TrainerCallback`` has no hook before an evaluation, a save or a log, only after
  (``on_evaluate``, ``on_save``, ``on_log``). So ``guard_trainer`` wraps, on the trainer
  instance: ``trainer.evaluate`` (phase ``eval step=<n>``, and the guard), ``trainer._save_checkpoint``
  and ``trainer.callback_handler.on_save`` (phase ``save step=<n>``: the save and the ``on_save``
  callbacks that follow it, where uploads usually run), and ``trainer.log`` (phase ``log``,
  covering the ``on_log`` callbacks, i.e. every ``report_to`` backend).
- With ``eval_timeout_s``, ``trainer.evaluate`` runs inside
  :func:`~ncclguard.evaluation.guard.guarded_evaluate`: it completes on every rank or is
  skipped on every rank by the deadline. A skip is logged through ``trainer.log`` as
  ``<prefix>_evaluation_failed`` (``eval_evaluation_failed``: it reaches ``state.log_history``,
  and the ``report_to`` integrations that rewrite ``eval_x`` as ``eval/x`` show
  ``eval/evaluation_failed``), and the Accelerate dataloader state an interrupted evaluation
  leaves behind is put back (:mod:`ncclguard.integrations.accelerate`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Unpack

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ncclguard.integrations.hf needs transformers: pip install 'ncclguard[hf]'") from exc

import torch

from ncclguard import WatchdogConfig, phase
from ncclguard.evaluation.guard import EvalReport, guarded_evaluate, last_report
from ncclguard.evaluation.options import GuardOptions, eval_options
from ncclguard.recovery.options import RecoveryKeywords
from ncclguard.toolkit import log
from ncclguard.watching.watchdog import Watchdog

from ..accelerate import dataloaders_restored_on_skip
from ..shared import (
    SKIPPED,
    SkippedEvaluation,
    recovery_for,
    skip_record,
    start_or_keep,
    timeout_problems,
    watchdog_given,
)
from ..shared import watchdog_config as _watchdog_config
from .deepspeed import deepspeed_refusal
from .recovery import TrainerRecovery

__all__ = [
    "FAILED_SUFFIX",
    "TrainerGuardCallback",
    "SkippedEvaluation",
    "find_guard",
    "guard_trainer",
    "timeout_warnings",
]

FAILED_SUFFIX = "evaluation_failed"
_ORIGINAL = "__ncclguard_original__"


def timeout_warnings(
    args: TrainingArguments,
    *,
    eval_timeout_s: float | timedelta | None = None,
    hang_timeout_s: float | None = None,
) -> list[str]:
    """What breaks the timeout hierarchy with ``TrainingArguments.ddp_timeout`` as the process
    group's timeout: the evaluation deadline and the watchdog's hang timeout must be below it.

    ``ddp_timeout`` is the timeout the Trainer gives the process group, under DDP and under
    DeepSpeed (``TrainingArguments._setup_devices``). ``python -m ncclguard doctor --ddp-timeout
    <ddp_timeout>`` (or ``--training-args args.json``) checks the same order with the rest of the hierarchy.

    Args:
        args: the trainer's arguments.
        eval_timeout_s: the evaluation deadline (``guard_trainer``'s ``eval_timeout_s``).
        hang_timeout_s: the watchdog's hang timeout.

    Returns:
        One sentence per broken rule; empty when the order holds.

    Raises:
        TypeError: ``args`` has no numeric ``ddp_timeout``.
    """
    pg = getattr(args, "ddp_timeout", None)
    if not isinstance(pg, (int, float)) or isinstance(pg, bool):
        raise TypeError(f"args must be TrainingArguments with a ddp_timeout in seconds, got {type(args).__name__}")
    deadline = None if eval_timeout_s is None else eval_options(eval_timeout_s=eval_timeout_s).eval_timeout_s
    return [
        f"{p} (TrainingArguments.ddp_timeout={pg:g})" for p in timeout_problems(float(pg), deadline, hang_timeout_s)
    ]


class TrainerGuardCallback(TrainerCallback):
    """The callback part of :func:`guard_trainer` alone: the watchdog and the train phases.

    ``Trainer(..., callbacks=[TrainerGuardCallback(watchdog={"hang_timeout_s": 300})])``. Phases for
    evaluation, saving and logging need the wrapping that :func:`guard_trainer` adds.

    Args:
        watchdog: the watchdog's settings: a ``WatchdogConfig``, a dict of its fields, None
            (defaults) or False (no watchdog). A watchdog already running in the process is used
            as it is and left running.

    Raises:
        TypeError, pydantic.ValidationError: a bad ``watchdog`` (when the callback is built).

    Attributes:
        watchdog: the watchdog this callback started (None when it started none).
        eval_timeout_s: the evaluation deadline (set by :func:`guard_trainer`).
        last_eval_report: the report of the last guarded evaluation on this rank.
        skipped: the evaluations skipped on every rank, oldest first.
        recovery: the step recovery of ``guard_trainer(recover=True)``, or None (its
            ``recoveries`` list the steps redone).
    """

    def __init__(self, watchdog: WatchdogConfig | dict[str, Any] | bool | None = None) -> None:
        self.watchdog_config = _watchdog_config(watchdog)
        self._watchdog_given = watchdog_given(watchdog)
        self.watchdog: Watchdog | None = None
        self.eval_timeout_s: float | None = None
        self.last_eval_report: EvalReport | None = None
        self.skipped: list[SkippedEvaluation] = []
        self.recovery: TrainerRecovery | None = None
        self._train: phase | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Warns about the timeout order and starts the watchdog (unless one runs already).

        Raises:
            ValueError: ``recover=True`` and the Trainer wrapped the model in something other than DDP.
        """
        if self.recovery is not None:
            _check_recoverable(self.recovery.trainer)
        hang = self.watchdog_config.hang_timeout_s if self.watchdog_config is not None else None
        for problem in timeout_warnings(args, eval_timeout_s=self.eval_timeout_s, hang_timeout_s=hang):
            log.warning("TrainerGuardCallback: %s", problem)
        if self.watchdog_config is None or self.watchdog is not None:
            return
        self.watchdog = start_or_keep(self.watchdog_config, self._watchdog_given, "TrainerGuardCallback")

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """After a rebuild that changed the world, re-shards the training data loader (``recover=True``)."""
        if self.recovery is not None:
            self.recovery.on_epoch_begin(kw.get("train_dataloader"))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Phase ``train step=<global_step>``."""
        self._open_train(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """The train phase goes on with the next step's number: what the Trainer does between
        two steps (log, evaluate, save) nests inside it."""
        self._open_train(state.global_step)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Closes the train phase and stops the watchdog this callback started."""
        self._close_train()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def _open_train(self, step: int) -> None:
        self._close_train()
        self._train = phase("train", step=step)
        self._train.__enter__()

    def _close_train(self) -> None:
        if self._train is not None:
            self._train.__exit__(None, None, None)
            self._train = None


def find_guard(trainer: Trainer) -> TrainerGuardCallback | None:
    """The :class:`TrainerGuardCallback` of ``trainer`` (its ``skipped``, ``last_eval_report``), or None."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TrainerGuardCallback):
            return callback
    return None


def guard_trainer(
    trainer: Trainer,
    *,
    eval_timeout_s: float | timedelta | None = None,
    retries: int = 0,
    watchdog: WatchdogConfig | dict[str, Any] | bool | None = None,
    recover: bool = False,
    **recovery: Unpack[RecoveryKeywords],
) -> Trainer:
    """Adds phases, the watchdog and (with ``eval_timeout_s``) a guarded evaluation to ``trainer``;
    with ``recover=True``, a training step that fails is redone on a rebuilt world.

    Call it on every rank before ``trainer.train()``. The module doc lists the hooks and the
    wrapped methods; :mod:`ncclguard.integrations.hf.recovery` says how a step is redone.

    Args:
        trainer: a ``transformers.Trainer`` (DDP or DeepSpeed through ``TrainingArguments``).
        eval_timeout_s: deadline of one evaluation (seconds or timedelta); None leaves it unguarded.
        retries: further attempts after a failed evaluation.
        watchdog: a ``WatchdogConfig``, a dict of its fields, None (defaults) or False (none).
        recover: commit every optimizer step on every rank, and redo a failed one (DDP, or DeepSpeed
            ZeRO 1, 2 or 3: the step redone on a new engine, :mod:`ncclguard.integrations.hf.deepspeed`):
            the recovery engine's adapter for the Trainer (:mod:`ncclguard.integrations.hf.recovery`).
        **recovery: with ``recover``, the recovery keywords every adapter takes
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`; what each bounds: docs/recovery.md,
            "The settings"); without it, ``allow_shrink``, ``heal``, ``preempt_dir`` and
            ``snapshot_every`` are refused. For the Trainer: ``collective_timeout`` bounds a step
            whatever ``ddp_timeout`` left on the group (1,800 s by default); past ``max_attempts``
            every rank raises :class:`~ncclguard.errors.CommitFailed` out of ``trainer.train()``, and
            ``left_out="raise"`` raises ``RebuildFailed`` there; ``allow_shrink`` is DDP only. With
            ``heal`` (on every rank) a rank killed and restarted by ``ncclguard run
            --ncclguard-restarts`` joins the survivors in ``trainer.train()`` and receives a live peer's
            model, optimizer, scheduler, Trainer state and generators, and every rank enters the loop
            again at the step the join redoes (under DeepSpeed each rank's ZeRO state comes from
            snapshots on a buddy rank, every ``snapshot_every`` optimizer steps). ``preempt_dir``
            receives the Trainer's own ``checkpoint-N`` on SIGTERM, after the step every rank agreed
            to stop at; resume with ``trainer.train(resume_from_checkpoint=...)``.

    Returns:
        ``trainer``, guarded (:func:`find_guard` gives its callback).

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``, an unknown keyword, or a bad
            argument type.
        ValueError, pydantic.ValidationError: a bad value, the trainer is guarded already, or
            ``recover=True`` with what cannot be recovered (FSDP; DeepSpeed without ZeRO 1-3, with
            NVMe offload, tensor or sequence parallelism, ``allow_shrink``, or a model that is
            neither a ``PreTrainedModel`` nor made by ``model_init``).
    """
    _check_unguarded(trainer)
    opts = _eval_options(eval_timeout_s, retries)
    steps = _recovery(trainer, recover, recovery)  # every argument is checked before anything is wrapped
    callback = TrainerGuardCallback(watchdog=watchdog)
    callback.eval_timeout_s = opts.eval_timeout_s if opts is not None else None
    callback.recovery = steps
    trainer.add_callback(callback)
    _wrap_methods(trainer, callback, opts)
    return trainer


def _check_unguarded(trainer: Trainer) -> None:
    """Refuses what is not a Trainer, and a Trainer guarded already (its methods are wrapped once)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    if find_guard(trainer) is not None or hasattr(trainer.evaluate, _ORIGINAL):
        raise ValueError("this trainer is guarded already (guard_trainer was called on it)")


def _eval_options(eval_timeout_s: float | timedelta | None, retries: int) -> GuardOptions | None:
    """The guard of each evaluation, or None when ``eval_timeout_s`` leaves it unguarded."""
    opts = None if eval_timeout_s is None else eval_options(eval_timeout_s=eval_timeout_s, retries=retries)
    if opts is None and retries:
        raise ValueError("retries needs eval_timeout_s: without a deadline the evaluation is not guarded")
    return opts


def _wrap_methods(trainer: Trainer, callback: TrainerGuardCallback, opts: GuardOptions | None) -> None:
    """Wraps, on the instance, what ``TrainerCallback`` has no hook before (the module doc): the
    training step (with recovery), the evaluation, the save with its ``on_save`` callbacks, the log."""
    if callback.recovery is not None:
        _wrap(trainer, "training_step", _recovering(callback.recovery))
    _wrap(trainer, "evaluate", _evaluating(trainer, callback, opts))
    _wrap(trainer, "_save_checkpoint", _in_phase(trainer, trainer._save_checkpoint, "save"))
    handler = trainer.callback_handler
    _wrap(handler, "on_save", _in_phase(trainer, handler.on_save, "save"))
    _wrap(trainer, "log", _in_phase(trainer, trainer.log, "log", with_step=False))


def _recovery(trainer: Trainer, recover: bool, keywords: RecoveryKeywords) -> TrainerRecovery | None:
    """The step recovery ``recover=True`` asks for, its arguments checked (before anything is wrapped)."""
    checked = recovery_for(recover, keywords, "guard_trainer")
    if checked is None:
        return None
    if getattr(trainer.args, "torch_compile", False):
        raise ValueError(
            "recover=True re-points the Trainer's DDP wrapper after a rebuild; with torch_compile=True the Trainer "
            "wraps it in a compiled module whose graphs may hold the old world. Set torch_compile=False, or recover=False"
        )
    if trainer.is_fsdp_enabled:
        raise ValueError(
            "recover=True cannot recover the Trainer's FSDP: Accelerate wraps the model in FSDP only on GPU-like "
            "devices (accelerate/state.py sets DistributedType.FSDP for multi-GPU types only), so ncclguard has no "
            "way to run and test its redo here, and its shards are not re-pointed. For sharded state that heals "
            "from memory, train FSDP2 in a loop of your own with ncclguard.RecoveringStep(model, optimizer, "
            "wrap=ncclguard.FSDP2(...), heal=True), or use the Trainer with deepspeed= (ZeRO 1, 2 or 3), which "
            "recover=True and heal=True cover (docs/recovery.md)"
        )
    if getattr(trainer.args, "fsdp", None) and not trainer.is_fsdp_enabled:
        log.warning(
            "guard_trainer: TrainingArguments(fsdp=...) is not in force here (Accelerate applies FSDP on GPU-like "
            "devices only): the Trainer trains under %s, and recover=True recovers that",
            trainer.accelerator.distributed_type,
        )
    if trainer.is_deepspeed_enabled:
        problem = deepspeed_refusal(trainer, checked.allow_shrink, checked.on_nonfinite)
        if problem is not None:
            raise ValueError(problem)
    return TrainerRecovery(trainer, checked)


def _recovering(recovery: TrainerRecovery) -> Callable[..., Any]:
    def training_step(model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        return recovery.training_step(model, inputs, num_items_in_batch)

    training_step.__doc__ = "Trainer.training_step, committed on every rank and redone on a failure (ncclguard)"
    return training_step


def _check_recoverable(trainer: Trainer) -> None:
    """At train begin: the model the Trainer trains is DDP-wrapped or a DeepSpeed engine, or there is
    one process."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = trainer.model_wrapped
    if isinstance(wrapped, DistributedDataParallel) or trainer.args.world_size <= 1:
        return
    if trainer.is_deepspeed_enabled and callable(getattr(wrapped, "zero_optimization_stage", None)):
        return
    raise ValueError(
        f"recover=True needs the Trainer's model in DistributedDataParallel; it is {type(wrapped).__name__} "
        f"(world size {trainer.args.world_size})"
    )


def _wrap(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Sets ``owner.<name>`` (an instance attribute) to ``wrapper``, keeping the original on it."""
    setattr(wrapper, _ORIGINAL, getattr(owner, name))
    setattr(owner, name, wrapper)


def _in_phase(trainer: Trainer, original: Callable[..., Any], name: str, with_step: bool = True) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        labels = {"step": trainer.state.global_step} if with_step else {}
        with phase(name, **labels):
            return original(*args, **kwargs)

    wrapped.__doc__ = f"{getattr(original, '__qualname__', name)} in phase {name!r} (ncclguard)"
    return wrapped


def _evaluating(trainer: Trainer, callback: TrainerGuardCallback, opts: GuardOptions | None) -> Callable[..., Any]:
    original = trainer.evaluate
    inside = [False]  # evaluate() calls itself once per dataset of a dict: guard the outer call only

    def evaluate(
        eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        if inside[0]:
            return original(eval_dataset, ignore_keys, metric_key_prefix)
        step = trainer.state.global_step
        inside[0] = True
        try:
            with phase("eval", step=step):
                if opts is None:
                    return original(eval_dataset, ignore_keys, metric_key_prefix)
                return _guarded(
                    trainer,
                    callback,
                    opts,
                    step,
                    lambda: original(eval_dataset, ignore_keys, metric_key_prefix),
                    metric_key_prefix,
                )
        finally:
            inside[0] = False

    evaluate.__doc__ = "Trainer.evaluate in phase 'eval', guarded by ncclguard when a deadline is set"
    return evaluate


def _guarded(
    trainer: Trainer,
    callback: TrainerGuardCallback,
    opts: GuardOptions,
    step: int,
    run: Callable[[], dict[str, float]],
    prefix: str,
) -> dict[str, float]:
    wrapped = trainer.model_wrapped if isinstance(trainer.model_wrapped, torch.nn.Module) else trainer.model
    start = time.monotonic()
    with dataloaders_restored_on_skip(trainer.accelerator.gradient_state) as restore:
        value = guarded_evaluate(
            wrapped, run, eval_timeout_s=opts.eval_timeout_s, retries=opts.retries, step=step, fallback=SKIPPED
        )
        callback.last_eval_report = last_report()
        if value is not SKIPPED:
            return value
        restore()
    skip = skip_record(callback.last_eval_report, step, time.monotonic() - start)
    callback.skipped.append(skip)
    log.warning(
        "guard_trainer: evaluation at step %d skipped on every rank after %.2f s: %s", step, skip.elapsed_s, skip.reason
    )
    report = callback.last_eval_report
    metrics: dict[str, float] = {
        f"{prefix}_{FAILED_SUFFIX}": 1.0,
        f"{prefix}_attempts": float(report.attempts if report is not None else 1),
    }
    trainer.log(dict(metrics))  # every rank, as Trainer.evaluate logs; log() adds the epoch
    return {**metrics, **_not_a_new_best(trainer.args)}


def _not_a_new_best(args: TrainingArguments) -> dict[str, float]:
    """With ``metric_for_best_model`` set, the Trainer looks the metric up in what evaluate()
    returns (``Trainer._determine_best_metric``, a KeyError when missing): a skip returns the
    worst value, so it is never a new best. Not logged."""
    name = args.metric_for_best_model
    if name is None:
        return {}
    key = name if name.startswith("eval_") else f"eval_{name}"  # as _determine_best_metric reads it
    return {key: -math.inf if args.greater_is_better else math.inf}


def __getattr__(name: str) -> Any:
    """``NcclGuardCallback``, this callback's old name (Lightning's callback has it): a
    DeprecationWarning, then :class:`TrainerGuardCallback`."""
    if name == "NcclGuardCallback":
        import warnings

        warnings.warn(
            "ncclguard.integrations.hf.NcclGuardCallback is TrainerGuardCallback now (one name per class: "
            "Lightning's callback is NcclGuardCallback); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return TrainerGuardCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
