"""NcclGuardCallback: phases, the watchdog and a guarded validation for ``lightning.pytorch.Trainer``.

What it hooks (Lightning 2.x, ``lightning.pytorch``; docs/integrations.md has the table):

- ``setup`` / ``teardown``: starts the watchdog (unless one runs already) and stops the one it
  started. The process group exists by ``setup`` (the strategy's ``setup_environment`` runs first).
- ``on_train_batch_start`` / ``_end``: phase ``train step=<global_step>``, kept open between
  batches with the next step's number: Lightning's loop runs collectives of its own there (2.6
  broadcasts a SIGTERM flag from rank 0 before every batch), and a rank waiting in one is training.
- ``on_validation_start`` / ``_end`` and ``on_validation_batch_start`` / ``_end``: phases
  ``eval step=<global_step>`` and, nested, ``batch=<i>`` (``sanity_check`` in the sanity check);
  the train phase is closed during validation and reopened after it. ``on_train_end`` closes it.
- Checkpoints: Lightning's ``on_save_checkpoint`` runs while the checkpoint dict is built, before
  the file is written and before the barrier that follows, so no hook spans a save. The callback
  wraps ``trainer.save_checkpoint`` on the trainer instance instead (phase ``save step=<n>``);
  ``ModelCheckpoint`` saves through it. Undone at teardown.
- With ``eval_timeout_s``: Lightning has no hook around a validation run either, so the
  callback wraps the ``run`` of the trainer's validation loop (``trainer.fit_loop.epoch_loop
  .val_loop`` for ``fit``, also used by the sanity check; ``trainer.validate_loop`` for
  ``validate``) with :func:`~ncclguard.evaluation.guard.guarded_evaluate`: it completes on
  every rank or is skipped on every rank by the deadline. A skip is logged to every logger as
  ``eval/evaluation_failed`` and put in ``trainer.callback_metrics``; the loop state a skipped
  run leaves behind is reset so that training and the next validation go on.
- With ``recover=True``: the strategy's ``optimizer_step`` is wrapped so that every rank commits
  each step before the optimizer steps, and a failed step is redone on a rebuilt world
  (:mod:`ncclguard.integrations.lightning.recovery`). Each recovery is logged to every logger as
  ``ncclguard_recover_s``, ``ncclguard_recover_attempts``, ``ncclguard_recover_generation``,
  ``ncclguard_recover_world_size`` (the keys every adapter logs). SIGTERM then stops every rank at
  one agreed step with Lightning's own checkpoint (``preempt_dir=``; Lightning's SIGTERM handler
  is set aside during ``fit``: :mod:`ncclguard.integrations.lightning.preempt`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Unpack

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ncclguard.integrations.lightning needs Lightning 2.x (lightning.pytorch): pip install 'ncclguard[lightning]'"
    ) from exc

import torch

from ncclguard import WatchdogConfig, phase
from ncclguard.evaluation.guard import FAILED_METRIC, EvalReport, guarded_evaluate, last_report
from ncclguard.evaluation.options import eval_options
from ncclguard.recovery.options import RecoveryKeywords
from ncclguard.recovery.records import Recovered
from ncclguard.toolkit import awaiting_join, log
from ncclguard.watching.watchdog import Watchdog

from ..shared import (
    SKIPPED,
    SkippedEvaluation,
    recovery_for,
    skip_record,
    start_or_keep,
    timeout_problems,
    watchdog_config,
    watchdog_given,
)
from .preempt import preempt_wrappers
from .recovery import StepRecovery, check_recoverable
from .sharded import install_stand_in_mesh

__all__ = ["NcclGuardCallback", "SkippedEvaluation", "watchdog_config", "timeout_problems"]

_PATCHED = "__ncclguard_original__"


class NcclGuardCallback(Callback):
    """Phases, the watchdog and (with ``eval_timeout_s``) a guarded validation for a Lightning Trainer.

    ``Trainer(callbacks=[NcclGuardCallback(eval_timeout_s=600)])``; the module doc says which hooks
    and which wrapped methods it uses.

    Args:
        eval_timeout_s: deadline of one validation run (seconds or timedelta); None leaves
            validation unguarded.
        watchdog: the watchdog's settings: a ``WatchdogConfig``, a dict of its fields, None
            (defaults) or False (no watchdog). A watchdog already running in the process is used
            as it is and left running.
        recover: commit every training step on every rank and redo a failed one on a rebuilt
            world (the DDP strategy, or ``ModelParallelStrategy`` with FSDP2 applied in
            ``configure_model``; automatic optimization; with ``accumulate_grad_batches`` the step
            is the window of micro-batches, all redone): the recovery engine's adapter for
            Lightning (:mod:`ncclguard.integrations.lightning.recovery`).
        **recovery: with ``recover``, the recovery keywords every adapter takes
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`; what each bounds: docs/recovery.md,
            "The settings"); without it, ``allow_shrink``, ``heal``, ``preempt_dir`` and
            ``snapshot_every`` are refused. For Lightning: ``collective_timeout`` bounds a step
            whatever timeout the strategy gave the group; past ``max_attempts`` fit raises
            ``CommitFailed``, and ``left_out="raise"`` raises ``RebuildFailed`` out of ``fit``. With
            ``heal`` (on every rank) a rank killed and restarted by ``ncclguard run
            --ncclguard-restarts`` comes back: its strategy stands in for the world until the fit
            loop starts, where it joins the survivors and receives a live peer's module, optimizer,
            LR schedulers, fit-loop state and generators; then every rank enters the fit loop again
            at the step the join redoes (Lightning's own resume logic; a data loader without a
            ``state_dict`` starts its epoch again and its batches up to the loop's position are
            drawn and dropped). Under ``ModelParallelStrategy`` (FSDP2) each rank's shards come
            from snapshots replicated on a buddy rank instead (every ``snapshot_every`` steps), and
            every rank goes back to the newest snapshot's step. ``preempt_dir`` receives
            Lightning's checkpoint when the job is told to stop (SIGTERM;
            :mod:`.preempt`).

    Raises:
        TypeError, ValueError, pydantic.ValidationError: a bad ``eval_timeout_s``, ``watchdog``,
            ``recover`` or recovery keyword (when the callback is built, before any rank talks to another).

    Attributes:
        watchdog: the watchdog this callback started (None when it started none).
        last_eval_report: the report of the last guarded validation on this rank.
        skipped: the validations skipped on every rank, oldest first.
        recoveries: the steps redone on a rebuilt world, oldest first.
    """

    def __init__(
        self,
        eval_timeout_s: float | timedelta | None = None,
        watchdog: WatchdogConfig | dict[str, Any] | bool | None = None,
        *,
        recover: bool = False,
        **recovery: Unpack[RecoveryKeywords],
    ) -> None:
        options = recovery_for(recover, recovery, "NcclGuardCallback")
        self.recovery = StepRecovery(options, self._log_recovery) if options is not None else None
        # Before the strategy makes its device mesh on the stand-in world.
        if options is not None and awaiting_join(options.heal):
            install_stand_in_mesh()
        self.recoveries: list[Recovered] = []
        self.eval_timeout_s = (
            None if eval_timeout_s is None else eval_options(eval_timeout_s=eval_timeout_s).eval_timeout_s
        )
        self.watchdog_config = watchdog_config(watchdog)
        self._watchdog_given = watchdog_given(watchdog)
        self.watchdog: Watchdog | None = None
        self.last_eval_report: EvalReport | None = None
        self.skipped: list[SkippedEvaluation] = []
        self._phases: dict[str, phase] = {}
        self._patched: list[tuple[Any, str]] = []

    # ------------------------------------------------------------------ life cycle

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Starts the watchdog, wraps ``save_checkpoint`` and, with a deadline, the validation loop."""
        pg = getattr(trainer.strategy, "_timeout", None)  # DDPStrategy(timeout=...), a timedelta
        hang = self.watchdog_config.hang_timeout_s if self.watchdog_config is not None else None
        for problem in timeout_problems(
            pg.total_seconds() if isinstance(pg, timedelta) else None, self.eval_timeout_s, hang
        ):
            log.warning("NcclGuardCallback: %s", problem)
        if self.watchdog_config is not None and self.watchdog is None:
            self.watchdog = start_or_keep(self.watchdog_config, self._watchdog_given, "NcclGuardCallback")
        self._wrap(trainer, "save_checkpoint", _saving(trainer))
        if self.recovery is not None and stage == "fit":
            check_recoverable(trainer, pl_module, allow_shrink=self.recovery.engine.options.allow_shrink)
            if isinstance(trainer.strategy, ModelParallelStrategy):
                self.recovery.use_sharded(trainer, pl_module)  # before configure_model shards the module
            self._wrap(trainer.strategy, "optimizer_step", self.recovery.optimizer_step(trainer))
            automatic = trainer.fit_loop.epoch_loop.automatic_optimization
            self._wrap(automatic, "run", self.recovery.automatic_run(trainer))
            if self.recovery.engine.options.heal:
                self._wrap(trainer.fit_loop, "run", self.recovery.fit_loop_run(trainer))
            for owner, name, wrapper in preempt_wrappers(trainer, self.recovery):  # SIGTERM: the engine's
                self._wrap(owner, name, wrapper)
        if self.eval_timeout_s is not None and stage in ("fit", "validate"):
            loop = trainer.fit_loop.epoch_loop.val_loop if stage == "fit" else trainer.validate_loop
            if not callable(getattr(loop, "run", None)):
                raise RuntimeError(
                    f"NcclGuardCallback cannot guard validation: {type(loop).__name__} has no run() in this "
                    "Lightning version; pass eval_timeout_s=None"
                )
            self._wrap(loop, "run", self._guarded_run(trainer, pl_module, loop))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Undoes the wrapping, closes open phases, stops the watchdog this callback started."""
        self._unwrap_all()
        self._close("eval", "batch", "train")
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Undoes the wrapping and closes phases; the watchdog keeps running (Lightning calls no
        ``teardown`` after an exception, and a hang that follows one is still worth a report)."""
        self._unwrap_all()
        self._close("eval", "batch", "train")

    # ------------------------------------------------------------------ phases

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Phase ``train step=<global_step>``; with ``recover``, the strategy's DDP wrapper checked for NaN
        and Inf before each bucket's all-reduce and its replicas compared (docs/numerics.md; once per
        wrapper), or said once why not."""
        self._open("train", phase("train", step=trainer.global_step))
        if self.recovery is not None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.recovery.engine.numerics.adopt(trainer.strategy.model, pl_module, "Lightning", scaler)
            self.recovery.engine.replicas.adopt(trainer.strategy.model, "Lightning")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The train phase goes on with the next step's number (see the module doc); with
        ``heal=True``, the fit loop's state is kept (a join resumes from it)."""
        self._open("train", phase("train", step=trainer.global_step))
        if self.recovery is not None and self.recovery.engine.options.heal:
            self.recovery.keep_loops(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With ``recover`` under ModelParallelStrategy: checks, before any step, that a rebuilt world
        can shard the module again (``configure_model`` has run)."""
        if self.recovery is not None:
            self.recovery.check_sharded()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """With ``heal=True``, the fit loop's state before the first batch is kept."""
        if self.recovery is not None and self.recovery.engine.options.heal and trainer.global_step == 0:
            self.recovery.keep_loops(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Closes the train phase."""
        self._close("train")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Phase ``eval step=<global_step>`` (``sanity_check`` during the sanity check)."""
        name = "sanity_check" if trainer.sanity_checking else "eval"
        self._close("train")
        self._open("eval", phase(name, step=trainer.global_step))

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Nested phase ``batch=<i>``."""
        self._open("batch", phase(f"batch={batch_idx}"))

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Closes the batch phase."""
        self._close("batch")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Closes the eval phase; back in training, when validating inside ``fit``."""
        self._close("batch", "eval")
        self._resume_training(trainer)

    def _resume_training(self, trainer: Trainer) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._open("train", phase("train", step=trainer.global_step))

    def _open(self, kind: str, ph: phase) -> None:
        self._close(kind)  # one left open (an exception between start and end) is replaced
        ph.__enter__()
        self._phases[kind] = ph

    def _close(self, *kinds: str) -> None:
        for kind in kinds:
            ph = self._phases.pop(kind, None)
            if ph is not None:
                ph.__exit__(None, None, None)

    # ------------------------------------------------------------------ wrapping

    def _wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Sets ``owner.<name>`` (an instance attribute) to ``wrapper``; once per owner and name."""
        if any(o is owner and n == name for o, n in self._patched):
            return
        setattr(wrapper, _PATCHED, getattr(owner, name))
        setattr(owner, name, wrapper)
        self._patched.append((owner, name))

    def _unwrap_all(self) -> None:
        while self._patched:
            owner, name = self._patched.pop()
            if name in vars(owner):
                delattr(owner, name)  # the class's method shows through again

    def _guarded_run(self, trainer: Trainer, pl_module: LightningModule, loop: Any) -> Callable[[], Any]:
        original = loop.run
        timeout_s = self.eval_timeout_s
        assert timeout_s is not None  # only wrapped with a deadline

        def run() -> Any:
            step = trainer.global_step
            model = trainer.strategy.model if isinstance(trainer.strategy.model, torch.nn.Module) else pl_module
            start = time.monotonic()
            result = guarded_evaluate(model, original, eval_timeout_s=timeout_s, step=step, fallback=SKIPPED)
            self.last_eval_report = last_report()
            if result is not SKIPPED:
                return result
            self._recover(trainer, loop)
            self._log_skip(trainer, step, time.monotonic() - start)
            return []  # what the loop returns when it has nothing to evaluate

        return run

    def _recover(self, trainer: Trainer, loop: Any) -> None:
        """Leaves Lightning as after a validation that did not happen, on a rank whose run was
        interrupted part-way (and harmlessly on one whose run completed)."""
        self._close("batch", "eval")
        self._resume_training(trainer)
        trainer._logger_connector.reset_results()  # the partial epoch's logged values
        fetcher = getattr(loop, "_data_fetcher", None)
        if fetcher is not None:  # an iterator stopped mid-way; the next run makes a new one
            fetcher.teardown()
            loop._data_fetcher = None

    def _log_skip(self, trainer: Trainer, step: int, elapsed_s: float) -> None:
        report = self.last_eval_report
        skip = skip_record(report, step, elapsed_s)
        self.skipped.append(skip)
        log.warning(
            "NcclGuardCallback: validation at step %d skipped on every rank after %.2f s: %s",
            step,
            elapsed_s,
            skip.reason,
        )
        metrics = {FAILED_METRIC: 1.0, "eval/attempts": float(report.attempts if report is not None else 1)}
        trainer.callback_metrics[FAILED_METRIC] = torch.tensor(1.0)
        _to_loggers(trainer, metrics, step)

    def _log_recovery(self, trainer: Trainer, rec: Recovered) -> None:
        self.recoveries.append(rec)
        _log_recovered(trainer, rec)


def _log_recovered(trainer: Trainer, rec: Recovered) -> None:
    """Logs a redone step to ncclguard's log and to every logger of the trainer."""
    log.warning(
        "NcclGuardCallback: step %d redone and applied in world generation %d (%d ranks) after %d attempt(s), "
        "%.2f s; failed ranks %s",
        rec.step,
        rec.generation,
        rec.world_size,
        rec.attempts,
        rec.elapsed_s,
        rec.failed_ranks,
    )
    # The engine's ncclguard_recover_* values; Lightning's loggers take numbers only.
    metrics = {k: float(v) for k, v in rec.metrics().items() if isinstance(v, int | float)}
    for key, value in metrics.items():
        trainer.callback_metrics[key] = torch.tensor(value)
    _to_loggers(trainer, metrics, rec.step)


def _to_loggers(trainer: Trainer, metrics: dict[str, float], step: int) -> None:
    """Logs ``metrics`` to every logger of the trainer; a logger that fails is logged, never raised."""
    for logger in trainer.loggers:  # Lightning's loggers write on global rank 0 only
        try:
            logger.log_metrics(metrics, step=step)
        except Exception:  # noqa: BLE001 - a logger must never take training down
            log.exception("NcclGuardCallback: %s.log_metrics failed", type(logger).__name__)


def _saving(trainer: Trainer) -> Callable[..., Any]:
    """``trainer.save_checkpoint`` inside phase ``save step=<n>`` (no Lightning hook spans a save)."""
    original = trainer.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        with phase("save", step=trainer.global_step):
            return original(*args, **kwargs)

    return save_checkpoint
