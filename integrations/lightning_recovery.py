"""``NcclGuardCallback(recover=True)``: the recovery engine's adapter for Lightning.

The hook is the strategy's ``optimizer_step(optimizer, closure, model)``, wrapped on the strategy
instance. Lightning 2.x's automatic optimization calls it once per optimizer step, with the
closure that runs ``training_step``, ``zero_grad`` and ``backward`` (``loops/optimization/
automatic.py``); the precision plugin calls the closure inside ``optimizer.step(closure)``
(``plugins/precision/precision.py``). The wrapper runs the closure itself first, so every rank's
forward and backward end (an exception there, a collective that timed out) before anything is
applied; :func:`~ncclguard.recovery.commit.should_commit` then settles, the same on every rank,
whether the step may be applied. When it may, the original ``optimizer_step`` runs with a closure
that hands back the result already computed: ``on_before_optimizer_step``, gradient clipping and
``optimizer.step()`` run once. When it may not, nothing was applied anywhere, so the engine
(:mod:`ncclguard.recovery.engine`) rebuilds the world, this adapter makes the strategy's DDP
wrapper again on the new group, the module's buffers, the generators, the zero_grad progress
counters and the values logged by the failed attempt are put back, and the closure runs again on
the same batch. The LR schedulers step after ``optimizer_step`` returns, in Lightning's loop: once.

Refused when the callback is set up (a ``ValueError`` before any step): a strategy other than
plain DDP, gradient accumulation (the earlier micro-batches of the window cannot be redone), and
manual optimization (the user's code steps the optimizer).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.recovery.engine import Adapter, Recovered, Recovery, RecoveryOptions
from ncclguard.recovery.rebuild import RebuildResult

__all__ = ["StepRecovery", "check_recoverable"]


def check_recoverable(trainer: Any, pl_module: Any) -> None:
    """Refuses what a redo cannot handle exactly, before any step runs.

    Raises:
        ValueError: not plain DDP, gradient accumulation, or manual optimization.
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            f"NcclGuardCallback(recover=True) redoes steps under the DDP strategy only, got {type(strategy).__name__}; "
            "use strategy='ddp' (DDPStrategy), or recover=False"
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"NcclGuardCallback(recover=True) cannot redo a step with accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}: the earlier micro-batches of the window are gone by the optimizer "
            "step. Use accumulate_grad_batches=1 (a larger batch instead), or recover=False"
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "NcclGuardCallback(recover=True) needs automatic optimization: with automatic_optimization=False your "
            "training_step steps the optimizer itself, before any commit. Use ncclguard.should_commit in it, or "
            "recover=False"
        )


# A logged value's accumulated state (lightning/pytorch/trainer/connectors/logger_connector/result.py,
# _ResultMetric; _update_count and _computed come from torchmetrics.Metric).
_LOGGED_STATE = ("value", "cumulated_batch_size", "_forward_cache", "_computed", "_update_count", "has_reset")


class _Kept:
    """What the failed attempt may have changed in Lightning and the redo must find as it was (the
    buffers and the generators are the engine's snapshot)."""

    def __init__(self, trainer: Any) -> None:
        self.progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad
        self.progress_state = copy.deepcopy(self.progress.state_dict())
        # The values training_step logged this epoch (self.log): their accumulated state, by
        # reference (an update assigns new tensors, never writes into these). A torchmetrics
        # Metric logged as a value is not kept (its state is the user's object).
        self.results = trainer._results
        self.logged = {
            key: {f: getattr(metric, f) for f in _LOGGED_STATE if hasattr(metric, f)}
            for key, metric in (self.results or {}).items()
            if metric.is_tensor
        }

    def restore(self) -> None:
        self.progress.load_state_dict(copy.deepcopy(self.progress_state))
        if self.results is not None:  # what the failed attempt logged would count twice in the epoch's values
            for key in [k for k in self.results if k not in self.logged and self.results[k].is_tensor]:
                del self.results[key]
            for key, state in self.logged.items():
                for name, value in state.items():
                    setattr(self.results[key], name, value)


class StepRecovery(Adapter):
    """Wraps ``strategy.optimizer_step`` so that each step is a transaction of the engine.

    Args:
        options: the engine's options (:func:`~ncclguard.recovery.engine.recovery_options`).
        on_recovered: called with the trainer and each :class:`~ncclguard.recovery.engine.Recovered`
            step (the callback logs it to Lightning's loggers).

    Attributes:
        engine: the recovery engine.
    """

    name = "NcclGuardCallback"

    def __init__(self, options: RecoveryOptions, on_recovered: Callable[[Any, Recovered], None]) -> None:
        self.on_recovered = on_recovered
        self.engine = Recovery(self, options)
        self.trainer: Any = None

    def optimizer_step(self, trainer: Any) -> Callable[..., Any]:
        """The wrapper of ``trainer.strategy.optimizer_step`` (set by the callback as an instance attribute)."""
        self.trainer = trainer
        original = trainer.strategy.optimizer_step

        def optimizer_step(optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
            tx = self.engine.begin(trainer.global_step)
            tx.run(closure)  # training_step, zero_grad, backward: DDP's gradient all_reduce
            res = tx.settle(closure).raise_for_error()
            return original(optimizer, lambda done=res.output: done, model, **kwargs)  # computed above

        return optimizer_step

    # ------------------------------------------------------------------------ the adapter's part

    def get_module(self) -> torch.nn.Module:
        """The LightningModule."""
        return self.trainer.strategy.lightning_module

    def get_optimizer(self) -> Any:
        """The trainer's optimizer (automatic optimization steps one)."""
        optimizers = self.trainer.optimizers
        return optimizers[0] if len(optimizers) == 1 else None

    def zero_grad(self) -> None:
        """Nothing: Lightning's closure zeroes the gradients itself, and counts it."""

    def keep(self) -> _Kept:
        """The zero_grad progress counters and the values ``training_step`` logged this epoch."""
        return _Kept(self.trainer)

    def restore(self, kept: _Kept) -> None:
        """Puts them back before the redo."""
        kept.restore()

    def rewrap(self, rebuilt: RebuildResult) -> None:
        """The strategy's DDP wrapper made again on the new group; after a shrink, Lightning's rank
        and world size read the new world."""
        strategy = self.trainer.strategy
        # The old wrapper goes first, while the reaper still holds the abandoned groups.
        strategy.model = strategy.lightning_module
        strategy.model = strategy._setup_model(strategy.lightning_module)
        strategy._register_ddp_hooks()  # the communication hooks of the old wrapper (CUDA only)
        if rebuilt.missing_ranks:  # a shrink renumbered the ranks
            self._renumber()

    def log(self, record: Recovered) -> None:
        """Hands the record to the callback, which logs it to Lightning's loggers."""
        self.on_recovered(self.trainer, record)

    def _renumber(self) -> None:
        """After a shrink: Lightning's rank and world size read the new world (rank-zero logging too)."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        env = self.trainer.strategy.cluster_environment
        # Instance attributes over the class's methods: TorchElasticEnvironment reads RANK and
        # WORLD_SIZE from the launch's environment, which a shrink does not change.
        env.global_rank = dist.get_rank
        env.world_size = dist.get_world_size
        rank_zero_only.rank = fabric_rank_zero_only.rank = dist.get_rank()  # type: ignore[attr-defined]
