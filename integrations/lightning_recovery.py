"""Redoing a failed Lightning training step on a rebuilt world: ``NcclGuardCallback(recover=True)``.

The hook is the strategy's ``optimizer_step(optimizer, closure, model)``, wrapped on the strategy
instance. Lightning 2.x's automatic optimization calls it once per optimizer step, with the
closure that runs ``training_step``, ``zero_grad`` and ``backward`` (``loops/optimization/
automatic.py``); the precision plugin calls the closure inside ``optimizer.step(closure)``
(``plugins/precision/precision.py``). The wrapper runs the closure itself first, so every rank's
forward and backward end (an exception there, a collective that timed out) before anything is
applied; :func:`~ncclguard.recovery.commit.should_commit` then settles, the same on every rank,
whether the step may be applied. When it may, the original ``optimizer_step`` runs with a closure
that hands back the result already computed: ``on_before_optimizer_step``, gradient clipping and
``optimizer.step()`` run once. When it may not, nothing was applied anywhere, so the ranks rebuild
the world (:func:`~ncclguard.recovery.rebuild.rebuild_world`), the strategy's DDP wrapper is made
again on the new group, the module's buffers, the RNG states, the zero_grad progress counters and
the values logged by the failed attempt are put back, and the closure runs again on the same
batch. The LR schedulers step after ``optimizer_step`` returns, in Lightning's loop: once.

Refused when the callback is set up (a ``ValueError`` before any step): a strategy other than
plain DDP, gradient accumulation (the earlier micro-batches of the window cannot be redone), and
manual optimization (the user's code steps the optimizer).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.errors import CommitFailed, RebuildFailed
from ncclguard.recovery.commit import CommitResult, should_commit
from ncclguard.recovery.rebuild import generation, rebuild_world
from ncclguard.recovery.step_state import StepState

__all__ = ["RECOVER_METRICS", "RecoveredStep", "StepRecovery", "check_recoverable", "seconds"]

RECOVER_METRICS = ("recover/recovered", "recover/attempts", "recover/generation", "recover/world_size")


@dataclass(frozen=True)
class RecoveredStep:
    """A training step that failed and was redone on a rebuilt world, as this rank saw it.

    Attributes:
        step: ``trainer.global_step`` of the step.
        attempts: times the step ran (2 after one failure).
        generation: the world generation it was applied in.
        world_size: the size of that world.
        failed_ranks: the ranks the failed commits named (launch numbering of their world).
        elapsed_s: seconds from the first attempt's start to the commit that was ok.
    """

    step: int
    attempts: int
    generation: int
    world_size: int
    failed_ranks: list[int]
    elapsed_s: float


def seconds(name: str, value: float) -> float:
    """Checks a positive number of seconds.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: ``value`` is not a positive int or float.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"NcclGuardCallback's {name} must be a positive number of seconds, got {value!r}")
    return float(value)


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
    """What the failed attempt may have changed and the redo must find as it was."""

    def __init__(self, trainer: Any, module: torch.nn.Module) -> None:
        self.module = module
        self.step = StepState.take(module)  # buffers, torch's CPU and CUDA generators
        self.py_rng = random.getstate()
        self.np_rng = _numpy_state()
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
        self.step.restore(self.module)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            import numpy

            numpy.random.set_state(self.np_rng)
        self.progress.load_state_dict(copy.deepcopy(self.progress_state))
        if self.results is not None:  # what the failed attempt logged would count twice in the epoch's values
            for key in [k for k in self.results if k not in self.logged and self.results[k].is_tensor]:
                del self.results[key]
            for key, state in self.logged.items():
                for name, value in state.items():
                    setattr(self.results[key], name, value)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return None
    return numpy.random.get_state()


class StepRecovery:
    """Wraps ``strategy.optimizer_step`` so that a failed step is redone on a rebuilt world.

    Args:
        allow_shrink: go on without ranks that do not come to the rebuild.
        commit_timeout_s: seconds a commit waits for every rank (None: should_commit's default).
        rebuild_timeout_s: seconds a rebuild waits for every rank.
        max_attempts: times a step runs at most.
        on_recovered: called with each :class:`RecoveredStep` (the callback logs it).
    """

    def __init__(
        self,
        *,
        allow_shrink: bool,
        commit_timeout_s: float | None,
        rebuild_timeout_s: float,
        max_attempts: int,
        on_recovered: Callable[[Any, RecoveredStep], None],
    ) -> None:
        self.allow_shrink, self.max_attempts = allow_shrink, max_attempts
        self.commit_timeout_s, self.rebuild_timeout_s = commit_timeout_s, rebuild_timeout_s
        self.on_recovered = on_recovered

    def optimizer_step(self, trainer: Any) -> Callable[..., Any]:
        """The wrapper of ``trainer.strategy.optimizer_step`` (set by the callback as an instance attribute)."""
        strategy = trainer.strategy
        original = strategy.optimizer_step

        def optimizer_step(optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
            step, start = trainer.global_step, time.monotonic()
            kept = _Kept(trainer, strategy.lightning_module)
            commits: list[CommitResult] = []
            for attempt in range(1, self.max_attempts + 1):
                failure: BaseException | None = None
                output = None
                try:
                    output = closure()  # training_step, zero_grad, backward: DDP's gradient all_reduce
                except Exception as exc:  # noqa: BLE001 - this rank's failure goes into the commit
                    log.warning(
                        "NcclGuardCallback: step %d raised on this rank (%s: %s)", step, type(exc).__name__, exc
                    )
                    failure = exc
                res = should_commit(timeout=self.commit_timeout_s, step=step if attempt == 1 else None, failure=failure)
                commits.append(res)
                if res:
                    if attempt > 1:
                        failed = sorted({r for c in commits[:-1] for r in c.failed_ranks})
                        size = dist.get_world_size() if dist.is_initialized() else 1
                        done = RecoveredStep(step, attempt, generation(), size, failed, time.monotonic() - start)
                        self.on_recovered(trainer, done)
                    return original(optimizer, lambda done=output: done, model, **kwargs)  # computed above
                if attempt == self.max_attempts:
                    break
                self._rebuild(trainer, step)
                kept.restore()
                log.warning(
                    "NcclGuardCallback: redoing step %d in world generation %d (%d ranks), attempt %d",
                    step,
                    generation(),
                    dist.get_world_size(),
                    attempt + 1,
                )
            raise res.error or CommitFailed(f"step {step} failed its commit {self.max_attempts} times")

        return optimizer_step

    def _rebuild(self, trainer: Any, step: int) -> None:
        """A new world, and the strategy pointed at it; ends (status 0) a rank left out of it."""
        strategy = trainer.strategy
        # The old wrapper goes first (as in RecoveringStep): the reaper still holds the old groups.
        strategy.model = strategy.lightning_module
        rebuilt = rebuild_world(timeout=self.rebuild_timeout_s, allow_shrink=self.allow_shrink)
        if not rebuilt:
            error = rebuilt.error or RebuildFailed("rebuild_world failed")
            if rebuilt.late:
                # The others went on without this rank. A zero status: torchrun leaves them running.
                # os._exit: at interpreter shutdown a timed-out gloo group can abort the process
                # (status -6, seen with DeepSpeed here), and torchrun would stop the survivors.
                log.error(
                    "NcclGuardCallback: step %d: this rank was left out (%s); it exits with status 0", step, error
                )
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            raise error
        strategy.model = strategy._setup_model(strategy.lightning_module)
        strategy._register_ddp_hooks()  # the communication hooks of the old wrapper (CUDA only)
        if rebuilt.missing_ranks:  # a shrink renumbered the ranks
            self._renumber(trainer)

    @staticmethod
    def _renumber(trainer: Any) -> None:
        """After a shrink: Lightning's rank and world size read the new world (rank-zero logging too)."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        env = trainer.strategy.cluster_environment
        # Instance attributes over the class's methods: TorchElasticEnvironment reads RANK and
        # WORLD_SIZE from the launch's environment, which a shrink does not change.
        env.global_rank = dist.get_rank
        env.world_size = dist.get_world_size
        rank_zero_only.rank = fabric_rank_zero_only.rank = dist.get_rank()  # type: ignore[attr-defined]
