"""A training step that recovers, for a loop written with Hugging Face Accelerate.

::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stepper = recovering_step(accelerator, model, optimizer)
    for step, batch in enumerate(loader):
        res = stepper(lambda m: accelerator.backward(loss_fn(m(batch["x"]), batch["y"])), step=step)
        if res:
            scheduler.step()      # once per applied step, never for an attempt that failed

It is :class:`~ncclguard.recovery.recovering.RecoveringStep` (the recovery engine's adapter for a
loop of your own) with a ``wrap`` that knows the Accelerator: after a rebuild it points the wrapper
``accelerator.prepare`` returned (the same object, so ``accelerator._models`` and the loop's
variable follow) at the new group (:func:`~ncclguard.recovery.internals.repoint.repoint_ddp`), and, when the
world changed size or this rank was renumbered, updates Accelerate's shared state
(``num_processes``, ``process_index``: what ``accelerator.is_main_process``, ``gather`` and the
samplers Accelerate builds later read). After a rebuild that admitted restarted ranks
(``heal=True``) every rank wraps its module anew instead (:func:`~ncclguard.recovery.internals.repoint.rewrapped_ddp`):
use the model ``step_fn`` is given, or ``stepper.model``, not the one ``prepare`` returned.
Each recovered step is logged with ``accelerator.log`` (keys ``ncclguard_recover_*``) and the
ncclguard logger, and kept in :attr:`AcceleratorRecoveringStep.recoveries`. A rank the others went
on without exits with status 0 (the engine's left-out policy).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ncclguard.integrations.accelerate needs accelerate: pip install 'ncclguard[hf]'") from exc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ncclguard import _torch_compat as compat
from ncclguard.recovery.internals.repoint import repoint_ddp, repoint_sampler, rewrapped_ddp, unwrapped
from ncclguard.recovery.options import DEFAULT_COLLECTIVE_TIMEOUT_S, LeftOut
from ncclguard.recovery.records import Recovered
from ncclguard.recovery.recovering import RecoveringStep
from ncclguard.world import current_world

__all__ = ["AcceleratorRecoveringStep", "follow_world", "recovering_step"]


def follow_world(rank: int, size: int) -> bool:
    """Makes Accelerate's shared state (``PartialState``, ``AcceleratorState``) say this rank and size.

    Accelerate reads the rank and world size once, when its state is built. After a rebuild that
    renumbered the ranks, ``accelerator.process_index`` / ``num_processes`` (and
    ``TrainingArguments.process_index`` / ``world_size``, read from the same state) would
    describe the old world. ``local_process_index`` and the device are left as they are.

    Args:
        rank: this rank in the new world.
        size: the new world's size.

    Returns:
        True when something changed.
    """
    changed = False
    # SharedDict is a class-level dict (a thread-local one on TPU): every instance reads it live.
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared and (shared.get("num_processes"), shared.get("process_index")) != (size, rank):
            shared["num_processes"], shared["process_index"] = size, rank
            changed = True
    return changed


class AcceleratorRecoveringStep(RecoveringStep):
    """:class:`RecoveringStep` for a model and optimizer that ``accelerator.prepare`` returned.

    Args:
        accelerator: the loop's ``Accelerator`` (``gradient_accumulation_steps`` must be 1: see Raises).
        model: the prepared model (a ``DistributedDataParallel`` under several processes).
        optimizer: the prepared optimizer.
        collective_timeout, commit_timeout, rebuild_timeout, allow_shrink, max_attempts, heal,
            heal_timeout, left_out: as for :class:`RecoveringStep`. With ``heal=True`` a rank
            restarted by its supervisor joins the survivors here (its ``Accelerator()`` stood in
            for the world until then) and receives a live peer's module and optimizer state; the
            loop then starts at :attr:`resume_step`.
        preempt_dir: where, on SIGTERM, every rank writes ``accelerator.save_state`` (``step-<N>``)
            after the step every rank agreed to stop at (resume: ``accelerator.load_state(path)``);
            default the variable ``NCCLGUARD_PREEMPT_DIR`` (docs/recovery.md, "Preemption").

    Attributes:
        recoveries: every step that was redone on a rebuilt world, oldest first
            (:class:`~ncclguard.recovery.records.Recovered`; ``.metrics()`` gives what was logged).

    Raises:
        TypeError: not an Accelerator, a model or an optimizer.
        ValueError: the Accelerator accumulates gradients (``gradient_accumulation_steps`` > 1):
            its ``accumulate()`` skips ``optimizer.step`` and ``zero_grad`` on all but the last
            micro-batch, so a step of this class would be a micro-batch. Run the micro-batches of
            one optimizer step inside ``step_fn`` instead (``with model.no_sync():`` for all but
            the last), with the Accelerator's accumulation at 1. Also: a DeepSpeed or FSDP model
            (only DDP is re-pointed).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        collective_timeout: float | timedelta | None = DEFAULT_COLLECTIVE_TIMEOUT_S,
        commit_timeout: float | timedelta | None = None,
        rebuild_timeout: float | timedelta = 60.0,
        allow_shrink: bool = False,
        max_attempts: int = 3,
        heal: bool = False,
        heal_timeout: float | timedelta = 60.0,
        left_out: LeftOut = "exit",
        preempt_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be the torch.nn.Module accelerator.prepare returned, got {type(model).__name__}"
            )
        if accelerator.gradient_accumulation_steps != 1:
            raise ValueError(
                f"the Accelerator accumulates gradients over {accelerator.gradient_accumulation_steps} micro-batches; "
                "a recovering step is one optimizer step: build the Accelerator with gradient_accumulation_steps=1 and "
                "run the micro-batches inside step_fn (with model.no_sync() for all but the last)"
            )
        if accelerator.num_processes > 1 and not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"recovering_step re-points a DistributedDataParallel model after a rebuild; this one is "
                f"{type(model).__name__} (DeepSpeed and FSDP engines keep groups ncclguard cannot re-point inside "
                "Accelerate yet)"
                "; for sharded state today, train in a loop of your own with ncclguard.RecoveringStep(wrap=ncclguard.FSDP2(...), heal=True) or ncclguard.integrations.deepspeed.CommittedEngineStep(..., rebuild_engine=..., heal=True), which restore a killed rank from its buddy's in-memory snapshot (docs/recovery.md, Sharded state)"
            )
        self.accelerator, self.wrapper = accelerator, model
        super().__init__(
            unwrapped(model),
            optimizer,
            wrap=self._repointed,
            collective_timeout=collective_timeout,
            commit_timeout=commit_timeout,
            rebuild_timeout=rebuild_timeout,
            allow_shrink=allow_shrink,
            max_attempts=max_attempts,
            heal=heal,
            heal_timeout=heal_timeout,
            left_out=left_out,
            preempt_dir=preempt_dir,
        )

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """Accelerate's own state after a preemption stop: ``accelerator.save_state(directory/step-<N>)``
        (models, optimizers, schedulers, generators, samplers) on every rank."""
        path = directory / f"step-{step}"
        self.accelerator.save_state(str(path))
        return path

    def _repointed(self, module: torch.nn.Module) -> torch.nn.Module:
        # At construction (nothing to do, unless this process just joined: its wrapper was built on
        # the stand-in) and after each rebuild.
        old = self.wrapper
        if not isinstance(old, DistributedDataParallel) or old.process_group is compat.default_group():
            return old
        if current_world().joined:  # restarted ranks joined: every rank's wrapper starts afresh
            self.wrapper = rewrapped_ddp(old)
            models = self.accelerator._models
            models[:] = [self.wrapper if m is old else m for m in models]
        else:
            repoint_ddp(old)
        rank, size = dist.get_rank(), dist.get_world_size()
        follow_world(rank, size)
        if getattr(self, "healed", None) is not None:  # this process joined: its stand-in said rank 0 of 1
            for loader in self.accelerator._dataloaders:  # prepared before the join, not iterated yet
                repoint_sampler(loader, rank, size)
        return self.wrapper

    def log(self, record: Recovered) -> None:
        """Logs a recovered step with ``accelerator.log`` (keys ``ncclguard_recover_*``)."""
        self.accelerator.log(record.metrics(), step=record.step)

    def repoint_dataloaders(self, *loaders: Any) -> list[str]:
        """Re-shards prepared data loaders for the current world; call it between epochs.

        Args:
            *loaders: the loaders ``accelerator.prepare`` returned.

        Returns:
            What was re-pointed, in words.
        """
        if not dist.is_initialized():
            return []
        return [d for dl in loaders for d in repoint_sampler(dl, dist.get_rank(), dist.get_world_size())]


def recovering_step(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    **options: Any,
) -> AcceleratorRecoveringStep:
    """A recovering step for an Accelerate loop (see the module doc).

    Args:
        accelerator: the loop's ``Accelerator``.
        model: the model ``accelerator.prepare`` returned.
        optimizer: the optimizer ``accelerator.prepare`` returned.
        **options: ``collective_timeout``, ``commit_timeout``, ``rebuild_timeout``, ``allow_shrink``,
            ``max_attempts``, ``heal``, ``heal_timeout``, ``left_out``, ``preempt_dir``.

    Returns:
        An :class:`AcceleratorRecoveringStep`.

    Raises:
        TypeError, ValueError: see :class:`AcceleratorRecoveringStep`.
    """
    return AcceleratorRecoveringStep(accelerator, model, optimizer, **options)
