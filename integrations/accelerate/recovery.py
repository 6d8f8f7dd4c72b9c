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
variable follow) at the new group (:func:`~ncclguard.toolkit.repoint_ddp`), and, when the
world changed size or this rank was renumbered, updates Accelerate's shared state
(``num_processes``, ``process_index``: what ``accelerator.is_main_process``, ``gather`` and the
samplers Accelerate builds later read). After a rebuild that admitted restarted ranks
(``heal=True``) every rank wraps its module anew instead (:func:`~ncclguard.toolkit.rewrapped_ddp`,
in the gradient buckets the survivors' wrappers had, so the redone step sums as before):
use the model ``step_fn`` is given, or ``stepper.model``, not the one ``prepare`` returned.
Each recovered step is logged with ``accelerator.log`` (keys ``ncclguard_recover_*``) and the
ncclguard logger, and kept in :attr:`AcceleratorRecoveringStep.recoveries`. A rank the others went
on without exits with status 0 (the engine's left-out policy).

With ``Accelerator(gradient_accumulation_steps=N)`` the loop calls the stepper once per micro-batch,
as it would enter ``accelerator.accumulate(model)`` once per micro-batch, and passes the micro-batch
as an argument (it is kept for a redo)::

    def micro_step(model, batch):
        accelerator.backward(loss_fn(model(batch["x"]), batch["y"]))

    for step, batch in enumerate(loader):
        res = stepper(micro_step, batch, step=step)
        if res.pending:
            continue              # a micro-batch of the window: nothing applied yet
        scheduler.step()          # once per optimizer step

Each call runs ``step_fn(model, *inputs)`` inside ``accelerator.accumulate(model)`` (Accelerate
decides ``sync_gradients`` and puts DDP's ``no_sync`` on all but the window's last micro-batch). The
window's first call opens the transaction, each call is recorded (its function, its inputs, its
``sync_gradients`` and ``no_sync`` state), and the call where ``accelerator.sync_gradients`` is True
commits: ok, the optimizer steps once; not ok, the world is rebuilt and every micro-batch of the
window runs again with the state it had. The calls before return a result with ``pending=True``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Unpack

try:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ncclguard.integrations.accelerate needs accelerate: pip install 'ncclguard[hf]'") from exc

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ncclguard.recovery.engine import Transaction
from ncclguard.recovery.options import RecoveryKeywords, recovery_options
from ncclguard.recovery.rebuild import generation
from ncclguard.recovery.records import Recovered, StepResult
from ncclguard.recovery.recovering import RecoveringStep
from ncclguard.toolkit import (
    Micro,
    check_window,
    default_group,
    kept_layout,
    layout_source,
    replay_window,
    repoint_ddp,
    repoint_sampler,
    rewrapped_ddp,
    share_layout,
    unwrapped,
    wrap_in_layout,
)
from ncclguard.world import current_world

__all__ = ["AcceleratorRecoveringStep", "follow_world", "replay_on"]


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


def replay_on(accelerator: Accelerator, window: list[Micro], model: Callable[[], Any]) -> Any:
    """Every micro-batch of the window again under Accelerate (:func:`~ncclguard.toolkit.replay_window`:
    each with the ``sync_gradients`` and ``no_sync`` it had).

    Args:
        accelerator: the loop's Accelerator.
        window: the recorded micro-batches.
        model: gives the model of the current world (a rebuild may have made a new one).

    Returns:
        What the last micro-batch's ``step_fn`` returned.
    """
    outputs = replay_window(
        window,
        model,
        set_sync_gradients=accelerator.gradient_state._set_sync_gradients,
        no_sync=accelerator.no_sync,
    )
    return outputs[-1] if outputs else None


class AcceleratorRecoveringStep(RecoveringStep):
    """:class:`RecoveringStep` for a model and optimizer that ``accelerator.prepare`` returned.

    Args:
        accelerator: the loop's ``Accelerator``; with ``gradient_accumulation_steps`` above 1, call
            the stepper once per micro-batch (see the module doc).
        model: the prepared model (a ``DistributedDataParallel`` under several processes).
        optimizer: the prepared optimizer.
        scheduler: your LR scheduler (prepared or not), if any; you step it once per applied step.
            With ``heal`` a restarted rank receives its state from the live peer (without it, the
            rank's schedule would start again: :class:`RecoveringStep` refuses that).
        **recovery: the recovery keywords every adapter takes, as for :class:`RecoveringStep`
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`). With ``heal=True`` a rank
            restarted by its supervisor joins the survivors here (its ``Accelerator()`` stood in
            for the world until then) and receives a live peer's module and optimizer state; the
            loop then starts at :attr:`resume_step`. ``preempt_dir`` receives
            ``accelerator.save_state`` (``step-<N>``) on SIGTERM, after the step every rank agreed
            to stop at (resume: ``accelerator.load_state(path)``).

    Attributes:
        recoveries: every step that was redone on a rebuilt world, oldest first
            (:class:`~ncclguard.recovery.records.Recovered`; ``.metrics()`` gives what was logged).

    Raises:
        TypeError: not an Accelerator, a model or an optimizer; an unknown recovery keyword or a
            value of the wrong type (a bad value: ``pydantic.ValidationError``, a ValueError).
        ValueError: a DeepSpeed or FSDP model (only DDP is re-pointed; with the DeepSpeed plugin
            :func:`recovering_step` returns the DeepSpeed stepper); Accelerate's FSDP plugin
            (on the CPU Accelerate drops it and trains DDP: ``accelerate/state.py`` sets
            ``DistributedType.FSDP`` only for GPU-like devices); ``heal=True`` with gradient
            accumulation.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        **recovery: Unpack[RecoveryKeywords],
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be the torch.nn.Module accelerator.prepare returned, got {type(model).__name__}"
            )
        # Checked here too (RecoveringStep checks them again): the refusal reads heal, and must come
        # before the engine RecoveringStep's constructor builds talks to any rank.
        options = recovery_options(**recovery)
        heal_refused = _refused(accelerator, True)
        if options.heal and heal_refused is not None and _refused(accelerator, False) is None:
            options = options.without_auto_heal(heal_refused)  # heal=True asked for: raises with why
            recovery = {**recovery, "heal": False}  # RecoveringStep below builds its options again
        refused = _refused(accelerator, options.heal)
        if refused is not None:
            raise ValueError(refused)
        if accelerator.num_processes > 1 and not isinstance(model, DistributedDataParallel):
            raise ValueError(
                f"recovering_step re-points a DistributedDataParallel model after a rebuild; this one is "
                f"{type(model).__name__} (DeepSpeed and FSDP engines keep groups ncclguard cannot re-point inside "
                "Accelerate yet)"
                "; for sharded state today, train in a loop of your own with ncclguard.RecoveringStep(wrap=ncclguard.FSDP2(...), heal=True) or ncclguard.integrations.deepspeed.CommittedEngineStep(..., rebuild_engine=..., heal=True), which restore a killed rank from its buddy's in-memory snapshot (docs/recovery.md, Sharded state)"
            )
        self.accelerator, self.wrapper = accelerator, model
        self._window: list[Micro] = []  # the micro-batches of the open window (gradient accumulation)
        self._window_tx: Transaction[Any] | None = None
        super().__init__(
            unwrapped(model),
            optimizer,
            wrap=self._repointed,
            scheduler=scheduler,
            **recovery,
        )

    def __call__(self, step_fn: Callable[..., Any], *inputs: Any, step: int | None = None) -> StepResult[Any]:
        """Runs one step, or with gradient accumulation one micro-batch (see the module doc).

        Args:
            step_fn: ``step_fn(model, *inputs)`` runs forward and backward (``accelerator.backward``);
                it must not step or zero the optimizer. Called again with the same inputs to redo.
            *inputs: what ``step_fn`` is given after the model (the micro-batch); kept for a redo.
            step: your loop's step number (with accumulation: the window's first micro-batch's is
                checked by the commit; it must grow).

        Returns:
            The window's :class:`~ncclguard.recovery.records.StepResult` on the micro-batch that
            commits (without accumulation: every call); before it, a truthy result with ``pending=True``.

        Raises:
            TypeError: ``step_fn`` is not callable.
            ValueError: a recorded micro-batch's ``step_fn`` reads a variable that has changed since
                (a lambda over the loop's ``batch``): its redo would compute another micro-batch.
            RebuildFailed: this rank was left out, with ``left_out="raise"``.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable (forward and backward), got {type(step_fn).__name__}")
        if self.accelerator.gradient_accumulation_steps == 1:
            return super().__call__(lambda model: step_fn(model, *inputs), step=step)
        with self.accelerator.accumulate(self.model):  # Accelerate's sync_gradients and no_sync
            sync = bool(self.accelerator.sync_gradients)
            if self._window_tx is None:
                self._window_tx, self._window = self.engine.begin(step), []
                self.zero_grad()
            tx = self._window_tx
            grad_sync = bool(getattr(self.model, "require_backward_grad_sync", True))
            self._window.append(Micro.record(step_fn, inputs, sync_gradients=sync, grad_sync=grad_sync))
            tx.run(lambda: step_fn(self.model, *inputs))
        if not sync:
            return StepResult(True, 1, generation(), output=tx.output, pending=True)
        self._window_tx = None
        try:
            check_window(self._window)
            res = tx.settle(lambda: replay_on(self.accelerator, self._window, lambda: self.model))
        finally:
            tx.close()  # settle closes it too; this is for a window refused by the check
            self._window = []
        if res:
            self.optimizer.step()
        return res

    def zero_grad(self) -> None:
        """The module's gradients to None (the prepared optimizer's ``zero_grad`` does nothing while
        Accelerate accumulates)."""
        self.module.zero_grad(set_to_none=True)

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """Accelerate's own state after a preemption stop: ``accelerator.save_state(directory/step-<N>)``
        (models, optimizers, schedulers, generators, samplers) on every rank."""
        path = directory / f"step-{step}"
        self.accelerator.save_state(str(path))
        return path

    def _wrapped(self, layout_from: int | None = None, layout: Any = None) -> torch.nn.Module:
        """Accelerate's wrapper on the current world (:meth:`_repointed`), its gradient buckets checked
        for NaN and Inf as ``RecoveringStep``'s own are, where DDP's one comm hook slot is free and no
        GradScaler owns them, and its replicas compared (docs/numerics.md)."""
        model = self._repointed(self.module)
        self.engine.numerics.adopt(model, self.module, "Accelerate", self.accelerator.scaler)
        self.engine.replicas.adopt(model, "Accelerate")
        return model

    def _repointed(self, module: torch.nn.Module) -> torch.nn.Module:
        # At construction (nothing to do, unless this process just joined: its wrapper was built on
        # the stand-in) and after each rebuild.
        old = self.wrapper
        if not isinstance(old, DistributedDataParallel) or old.process_group is default_group():
            return old
        joined = current_world().joined
        if joined:  # restarted ranks joined: every rank's wrapper starts afresh
            # In the buckets of the lowest rank that did not join (a restarted rank's wrapper never
            # stepped): a new wrapper's first layout is not the one the survivors' had rebuilt
            # (docs/recovery.md, "Bit-equality and DDP's buckets").
            source = layout_source(joined)
            layout = kept_layout(old, 1) if dist.get_rank() == source else None
            shared = share_layout(layout, source, old.module)
            self.wrapper = wrap_in_layout(old.module, shared, build=lambda _module: rewrapped_ddp(old))
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


def _refused(accelerator: Accelerator, heal: bool) -> str | None:
    """Why this Accelerator's setup cannot be recovered by this class, and what to use instead, or None."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return (
            "AcceleratorRecoveringStep re-points DDP; this Accelerator has the DeepSpeed plugin: call "
            "recovering_step(accelerator, model, optimizer, ...), which returns the DeepSpeed stepper "
            "(ncclguard.integrations.accelerate.deepspeed.AcceleratorDeepSpeedStep)"
        )
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        where = (
            "Accelerate wrapped the model in FSDP"
            if fsdp
            else f"Accelerate was given its FSDP plugin, and on {accelerator.distributed_type.value} it dropped it "
            "and wraps the model in DDP (accelerate/state.py sets DistributedType.FSDP only for GPU-like devices)"
        )
        return (
            f"recovering_step cannot recover Accelerate's FSDP plugin: {where}, and ncclguard does not rebuild the "
            "groups of an FSDP model Accelerate prepared. Build the Accelerator without the plugin (DDP, recovered "
            "here), or shard the module yourself with ncclguard.RecoveringStep(module, optimizer, "
            "wrap=ncclguard.FSDP2(shard), heal=True), which restores a killed rank from its buddy's in-memory "
            "snapshot (docs/recovery.md, Sharded state)"
        )
    if heal and accelerator.gradient_accumulation_steps != 1:
        return (
            f"heal=True cannot go with gradient_accumulation_steps={accelerator.gradient_accumulation_steps}: a "
            "restarted process's Accelerator counts micro-batches from zero and holds none of the window the "
            "survivors redo. Use heal=False (a failed window is still redone on a rebuilt world), or "
            "gradient_accumulation_steps=1 with the window's micro-batches inside step_fn"
        )
    return None
