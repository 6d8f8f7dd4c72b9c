"""``guard_trainer(trainer, recover=True)``: a failed training step of the HF Trainer, redone on a rebuilt world.

What the Trainer does per optimizer step (transformers 5.x, ``Trainer._run_epoch``): it sets
``accelerator.gradient_state.sync_gradients`` for each micro-batch (True on the last one of the
step), calls ``training_step(model, inputs, num_items_in_batch)`` for each (under
``accelerator.no_sync(model)`` for all but the last), then clips the gradients, calls
``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()``. So the commit goes at
the end of the last micro-batch's ``training_step``, before the clipping and before anything is
applied:

1. ``training_step`` is wrapped on the trainer instance. Each call records its inputs, its
   ``num_items_in_batch``, the ``sync_gradients`` flag and the DDP wrapper's
   ``require_backward_grad_sync`` (the ``no_sync`` state); the first call of a step keeps the CPU
   RNG state and the model's buffers. An exception in a micro-batch is this rank's failure: it
   is not raised, the step's later micro-batches are not computed, and a zero loss is returned.
2. On the last micro-batch, :func:`~ncclguard.recovery.commit.should_commit` settles the step on
   every rank. Ok: the loss is returned and the Trainer clips, steps the optimizer and the LR
   scheduler once, as it would without ncclguard.
3. Not ok: :func:`~ncclguard.recovery.rebuild.rebuild_world`; the Trainer's DDP wrapper (the same
   object everywhere: the loop's ``model``, ``trainer.model_wrapped``, ``accelerator._models``)
   is pointed at the new group in place (:func:`~ncclguard.recovery.repoint.repoint_ddp`); the
   gradients are set to None (as ``model.zero_grad()`` left them before the step), the buffers
   and the RNG state put back; the recorded micro-batches run again with their ``no_sync`` state;
   the step commits again. The loss the Trainer had summed for the failed attempt's earlier
   micro-batches is replaced by the redo's.
4. The recovery is logged with ``trainer.log`` (``ncclguard_recover_*`` keys in
   ``state.log_history`` and the ``report_to`` integrations) and the ncclguard logger.

With ``allow_shrink=True`` the survivors go on without the ranks that did not come to the
rebuild: Accelerate's state (``num_processes``, ``process_index``) follows the new world at once,
``num_items_in_batch`` is counted again over the new world for the redo, and the training data
loader is re-sharded at the next epoch's start (docs/integrations.md says what that means for
the data and the batch size). A rank left out gets :class:`~ncclguard.errors.RebuildFailed`
(``late=True``) out of ``trainer.train()``; it should exit 0.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.errors import CommitFailed, RebuildFailed
from ncclguard.recovery.commit import CommitResult, should_commit
from ncclguard.recovery.rebuild import rebuild_world
from ncclguard.recovery.repoint import repoint_ddp, repoint_sampler, unwrapped
from ncclguard.recovery.step_state import StepState

from .accelerate_recovery import follow_world

__all__ = ["TrainerRecovery"]


@dataclass
class _Micro:
    """One micro-batch of the current optimizer step, as the Trainer gave it."""

    inputs: Any
    num_items: Any
    sync_gradients: bool
    grad_sync: bool


class TrainerRecovery:
    """The state of ``guard_trainer(recover=True)`` on one trainer (see the module doc).

    Args:
        trainer: the ``transformers.Trainer``.
        allow_shrink: rebuild without ranks that do not come (the same on every rank).
        commit_timeout: seconds each commit waits for the other ranks (None: should_commit's default).
        rebuild_timeout: seconds each rebuild waits for them.
        max_attempts: times a step runs at most; past it, CommitFailed ends training on every rank.

    Attributes:
        recoveries: the ``ncclguard_recover_*`` entries logged so far, with their ``step``.
        left_out: this rank is in no world any more.
    """

    def __init__(
        self,
        trainer: Any,
        *,
        allow_shrink: bool,
        commit_timeout: float | timedelta | None,
        rebuild_timeout: float,
        max_attempts: int,
    ) -> None:
        self.trainer = trainer
        self.allow_shrink, self.commit_timeout = allow_shrink, commit_timeout
        self.rebuild_timeout, self.max_attempts = rebuild_timeout, max_attempts
        self.original = trainer.training_step
        self.recoveries: list[dict[str, Any]] = []
        self.left_out = False
        self._micro: list[_Micro] = []
        self._given: list[torch.Tensor] = []  # the losses returned for this step's micro-batches
        self._kept: StepState | None = None
        self._failure: BaseException | None = None
        self._reshard: tuple[int, int] | None = None  # (rank, size) for the next epoch's data loader

    # --- the wrapped training_step -------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's ``training_step``, recorded, with the commit on the step's last micro-batch."""
        if self.left_out:
            raise RuntimeError("this rank was left out of the rebuilt world; it cannot train on")
        if not self._micro:  # the step's first micro-batch: what a redo starts from
            module = unwrapped(model)
            self._kept = StepState.take(module)
            self._failure, self._given = None, []
        sync = bool(self.trainer.accelerator.sync_gradients)
        self._micro.append(
            _Micro(
                copy.copy(inputs), num_items_in_batch, sync, bool(getattr(model, "require_backward_grad_sync", True))
            )
        )
        loss = self._run(model, inputs, num_items_in_batch)
        self._given.append(loss)
        if not sync:
            return loss
        try:
            return self._settle(model)
        finally:
            self._micro, self._given, self._kept = [], [], None

    def _run(self, model: torch.nn.Module, inputs: Any, num_items: Any) -> torch.Tensor:
        if self._failure is not None:  # this step failed here already: nothing more to compute
            return self._zero()
        try:
            return self.original(model, inputs, num_items)
        except Exception as exc:  # noqa: BLE001 - this rank's failure goes into the commit
            log.warning(
                "guard_trainer: the training step at global step %d raised on this rank (%s: %s)",
                self.trainer.state.global_step,
                type(exc).__name__,
                exc,
            )
            self._failure = exc
            return self._zero()

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), device=self.trainer.args.device)

    # --- commit, rebuild, redo -----------------------------------------------------------------------

    def _settle(self, model: torch.nn.Module) -> torch.Tensor:
        start = time.monotonic()
        commits: list[CommitResult] = []
        losses = list(self._given)
        for attempt in range(1, self.max_attempts + 1):
            res = should_commit(timeout=self.commit_timeout, failure=self._failure)
            commits.append(res)
            if res.ok:
                if attempt > 1:
                    self._replace_losses(losses)
                    self._log(commits, attempt, time.monotonic() - start)
                return losses[-1]
            if attempt == self.max_attempts:
                break
            self._failure = None  # the redo's own failures count from here (the rebuild's recount too)
            self._rebuild(model)
            losses = self._redo(model)
        raise commits[-1].error or CommitFailed(f"the step failed {self.max_attempts} time(s)")

    def _rebuild(self, model: torch.nn.Module) -> None:
        if not dist.is_initialized():  # one process: no world to rebuild, the step is only redone
            return
        before = dist.get_world_size()
        rebuilt = rebuild_world(timeout=self.rebuild_timeout, allow_shrink=self.allow_shrink)
        if not rebuilt:
            self.left_out = rebuilt.late
            log.error("guard_trainer: no world to redo the step in (%s)", rebuilt.error)
            raise rebuilt.error or RebuildFailed("rebuild_world failed", late=rebuilt.late)
        repoint_ddp(model)
        if follow_world(rebuilt.rank, rebuilt.world_size) or rebuilt.world_size != before:
            self._reshard = (rebuilt.rank, rebuilt.world_size)
            if any(m.num_items is not None for m in self._micro):
                self._count_items_again()

    def _count_items_again(self) -> None:
        """``num_items_in_batch`` summed over the new world (the Trainer counts it once per step)."""
        count = getattr(self.trainer, "_get_num_items_in_batch", None)
        if not callable(count):
            return
        try:
            n = count([m.inputs for m in self._micro], self.trainer.args.device)
        except Exception as exc:  # noqa: BLE001 - a collective of the redo: its failure is the step's
            self._failure = exc
            return
        for m in self._micro:
            m.num_items = n

    def _redo(self, model: torch.nn.Module) -> list[torch.Tensor]:
        assert self._kept is not None
        model.zero_grad(set_to_none=True)
        self._kept.restore(unwrapped(model))
        state = self.trainer.accelerator.gradient_state
        losses = []
        for m in self._micro:
            state._set_sync_gradients(m.sync_gradients)
            no_sync = getattr(model, "no_sync", None)
            with no_sync() if (not m.grad_sync and no_sync is not None) else nullcontext():
                losses.append(self._run(model, copy.copy(m.inputs), m.num_items))
        return losses

    def _replace_losses(self, losses: list[torch.Tensor]) -> None:
        """The Trainer summed the failed attempt's losses of the earlier micro-batches: use the redo's."""
        earlier_new, earlier_old = losses[:-1], self._given[:-1]
        total = getattr(self.trainer, "_tr_loss", None)
        if not earlier_new or not isinstance(total, torch.Tensor):
            return
        delta = (
            torch.stack([t.detach().to(total.device) for t in earlier_new]).sum()
            - torch.stack([t.detach().to(total.device) for t in earlier_old]).sum()
        )
        if torch.isfinite(delta):  # the Trainer's NaN filter replaced a non-finite loss: leave the sum
            total += delta

    def _log(self, commits: list[CommitResult], attempts: int, elapsed_s: float) -> None:
        failed = sorted({r for c in commits if not c.ok for r in c.failed_ranks})
        step = self.trainer.state.global_step
        metrics: dict[str, Any] = {
            "ncclguard_recover_s": round(elapsed_s, 4),
            "ncclguard_recover_generation": commits[-1].generation,
            "ncclguard_recover_world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "ncclguard_recover_attempts": attempts,
            "ncclguard_recover_failed_ranks": rank_ranges(failed) if failed else "",
        }
        self.recoveries.append({"step": step, **metrics})
        log.warning("guard_trainer: step %d redone on a rebuilt world: %s", step, metrics)
        self.trainer.log(dict(metrics))  # every rank, as the Trainer logs; it adds the step and epoch

    # --- between epochs --------------------------------------------------------------------------

    def on_epoch_begin(self, train_dataloader: Any) -> list[str]:
        """Re-shards the training data loader for the new world, once, at an epoch's start."""
        if self._reshard is None or train_dataloader is None:
            return []
        rank, size = self._reshard
        self._reshard = None
        done = repoint_sampler(train_dataloader, rank, size)
        if not done:
            log.warning(
                "guard_trainer: the world is now %d rank(s), but the training data loader shards with nothing "
                "ncclguard can re-point; each rank goes on reading its old shard",
                size,
            )
        return done
