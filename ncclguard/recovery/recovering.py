"""RecoveringStep: a training step of your own loop that every rank commits together, redone on a
rebuilt world when it fails. The adapter of the recovery engine (:mod:`ncclguard.recovery.engine`)
for a module you wrap in DDP (or FSDP2) yourself.

For a plain DDP loop::

    stepper = ncclguard.RecoveringStep(module, optimizer, collective_timeout=60)   # wraps module in DDP
    for step, batch in enumerate(loader):
        stepper(lambda model: loss_fn(model(batch)).backward(), step=step)

Each call runs one transaction of the engine: the module's buffers and the generators are kept,
``step_fn`` runs forward and backward on the wrapped model (an exception in it is this rank's
failure), every rank gets the same outcome, and the optimizer steps only when it is ok. When it is
not, nothing was applied anywhere: the world is rebuilt, the module wrapped again on the new group,
its buffers and the generators put back, and the step redone. A rank the others went on without
exits with status 0 (``left_out="raise"``: raises ``RebuildFailed`` instead).

With ``heal=True`` a rank that died and was restarted alone by its launcher (``ncclguard run
--restarts``; ``NCCLGUARD_RESTART_COUNT`` above 0) comes back: its constructor joins the
survivors' next rebuild and receives the module's and the optimizer's state from a live peer;
``stepper.resume_step`` tells it which step to run first::

    stepper = ncclguard.RecoveringStep(module, optimizer, heal=True)
    for step in range(stepper.resume_step or 0, steps):
        stepper(lambda model: loss_fn(model(batch(step))).backward(), step=step)

A restarted process needs no ``init_process_group`` of its own: where it calls one, ncclguard makes
it a stand-in until the join (docs/reference/recovery-mechanism.md, "Healing a restarted rank").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Unpack

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.recovery._step.state import (
    Layout,
    generators_to_send,
    kept_layout,
    layout_source,
    load_scheduler,
    restore_sent_generators,
    share_layout,
    wrap_in_layout,
)
from ncclguard.recovery.engine import Adapter, Recovery
from ncclguard.recovery.fsdp2 import FSDP2
from ncclguard.recovery.heal import HealResult
from ncclguard.recovery.options import RecoveryKeywords, recovery_options
from ncclguard.recovery.preempt import save_dcp
from ncclguard.recovery.rebuild import RebuildResult
from ncclguard.recovery.records import Recovered, StepResult
from ncclguard.recovery.snapshots.restore import Restored
from ncclguard.recovery.snapshots.state import ModuleState, StateCodec

__all__ = ["RecoveringStep", "StepResult", "cannot_rewrap", "driven_by_a_scheduler"]


def cannot_rewrap(module: torch.nn.Module) -> str | None:
    """Why a module cannot be wrapped again on a rebuilt world by this adapter, or None.

    Args:
        module: what the caller passed as the module to train.

    Returns:
        The reason and what to pass instead, or None when it can.
    """
    kind = type(module)
    if kind.__name__ == "DeepSpeedEngine" or kind.__module__.startswith("deepspeed"):
        return (
            "it is a DeepSpeed engine, which keeps process groups of the world it was built in; use "
            "ncclguard.integrations.deepspeed.CommittedEngineStep (commit, then checkpoint and exit 75)"
        )
    if kind.__name__ == "FullyShardedDataParallel":
        return "it is an FSDP1 FullyShardedDataParallel; pass the unwrapped module with wrap=ncclguard.FSDP2(...)"
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return "it is a DistributedDataParallel already; pass the module it wraps (model.module)"
    if kind.__name__ == "OptimizedModule":  # torch.compile's wrapper (torch._dynamo.eval_frame)
        return (
            "it is a torch.compile'd module, whose graphs may hold the old world; pass the module before "
            "torch.compile, and compile inside wrap= if you need it"
        )
    return None


class RecoveringStep(Adapter):
    """Runs training steps that commit on every rank, and recovers a failed one in process.

    Args:
        module: the model, unwrapped (it is wrapped again after each rebuild).
        optimizer: its optimizer (stepped only after a commit that is ok).
        wrap: builds the wrapped model on the current default group; default
            ``DistributedDataParallel(module)`` (the module itself without a process group; its values
            checked: ``on_nonfinite``, ``replica_check_every``, docs/numerics.md); after a
            rebuild it starts in the buckets the old wrapper had rebuilt, so a redone step sums as
            the run without the fault did (docs/reference/recovery-mechanism.md, "Bit-equality and DDP's buckets").
            A wrap that calls :func:`~ncclguard.record_ddp` puts DDP's all-reduces in the flight
            recorder; a step redone with a comm hook can then differ from the fault-free run in
            the last bit (see docs/reference/recovery-mechanism.md). For FSDP2,
            :class:`~ncclguard.recovery.fsdp2.FSDP2` (it shards the module, and after a rebuild
            shards it again from the shards each rank holds).
        scheduler: your LR scheduler, if any (you step it): with ``heal`` its state goes into the
            snapshots (FSDP2) or the heal (DDP), so a restored rank and a rollback find its rate
            and count as they were.
        scaler: a ``torch.amp.GradScaler`` for fp16, if any: ``step_fn`` backpropagates
            ``stepper.scaler.scale(loss)`` (and calls ``stepper.scaler.unscale_(opt)`` before
            clipping), and the stepper applies a committed step with ``scaler.step(opt)`` and
            ``scaler.update()``. Its scale and growth tracker go into the snapshots and the heal; a
            redone step starts with the per-step state the failed attempt left cleared.
        **recovery: the recovery keywords every adapter takes
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`: ``collective_timeout``,
            ``commit_timeout``, ``rebuild_timeout``, ``allow_shrink``, ``max_attempts``, ``heal``,
            ``heal_timeout``, ``heal_chunk_bytes``, ``left_out``, ``snapshot_every``, ``preempt_dir``,
            ``on_nonfinite``, ``replica_check_every``; docs/recovery.md, "The settings"). Here: with
            ``heal``, a restarted process rejoins and receives the state, and a live rank sends it
            (pass the same on every rank); ``snapshot_every`` counts FSDP2's snapshots;
            ``preempt_dir`` receives the model and the optimizer on SIGTERM, written with
            ``torch.distributed.checkpoint`` (``<preempt_dir>/step-<N>``) after the step every rank
            agreed to stop at.

    Attributes:
        engine: the recovery engine (its ``recoveries`` list the steps redone).
        resume_step: in a restarted process, the step the others redo: run it first. None elsewhere.
        healed: the restarted process's :class:`~ncclguard.recovery.heal.HealResult`, or None.

    Raises:
        TypeError, ValueError: bad arguments (an unknown keyword; a bad recovery value raises
            ``pydantic.ValidationError``, a ValueError), or a module this adapter cannot wrap again (a
            DeepSpeed engine, FSDP1, a DDP wrapper, a compiled module), with what to pass instead.
        RebuildFailed: a restarted process found no rebuild to join within ``rebuild_timeout``.
        HealFailed: a restarted process did not get the state.
    """

    name = "RecoveringStep"

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | FSDP2 | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        **recovery: Unpack[RecoveryKeywords],
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"RecoveringStep needs the torch.nn.Module to train, got {type(module).__name__}")
        why = cannot_rewrap(module)
        if why is not None:
            raise ValueError(f"RecoveringStep cannot wrap this module again after a rebuild: {why}")
        if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
            raise TypeError(f"RecoveringStep needs an optimizer (step, zero_grad), got {type(optimizer).__name__}")
        if wrap is not None and not (callable(wrap) or isinstance(wrap, FSDP2)):
            raise TypeError(f"wrap must build the wrapped model from the module, got {type(wrap).__name__}")
        options = recovery_options(**recovery)
        if options.allow_shrink and isinstance(wrap, FSDP2):
            raise ValueError(
                "allow_shrink=True cannot go with FSDP2: a rank left out takes its shards with it (FSDP2 keeps "
                "no replica); use allow_shrink=False, or DDP"
            )
        if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
            raise TypeError(
                f"scheduler must be an LR scheduler (state_dict/load_state_dict), got {type(scheduler).__name__}"
            )
        if scheduler is None and options.heal and driven_by_a_scheduler(optimizer):
            why = (
                "an LR scheduler steps this optimizer (torch wrapped its step) but scheduler= was not given: a rank "
                "healed from a peer would start its schedule again while its peers go on, and the ranks would "
                "diverge. Pass scheduler=<your scheduler> (or heal=False)"
            )
            if not options.heal_auto:
                raise ValueError(why)
            log.warning("%s: %s", self.name, why)
        if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "step", "update")):
            raise TypeError(f"scaler must be a torch.amp.GradScaler (scale, step, update), got {type(scaler).__name__}")
        self.module, self.optimizer, self._wrap, self.scheduler = module, optimizer, wrap, scheduler
        self.scaler = scaler
        self._model: torch.nn.Module | None = None
        self._forward_sync: bool | None = None  # DDP's buffer-sync flag as the open step found it
        self._wrapper_steps = 0  # steps committed on the current wrapper
        self.engine = Recovery(self, options)
        self.healed: HealResult | Restored | None = self.engine.join_if_restarted()
        self.resume_step: int | None = self.healed.step if self.healed is not None else None
        if self._model is None:  # a restarted rank with sharded state wrapped on joining
            # Healed: the survivors are re-wrapping, and this wrapper takes their bucket layout.
            healed_from = self.healed.source if isinstance(self.healed, HealResult) else None
            self._model = self._wrapped(layout_from=healed_from)

    # ------------------------------------------------------------------------ the adapter's part

    def get_module(self) -> torch.nn.Module:
        """The unwrapped module (after an FSDP2 rebuild, the new one)."""
        return self.module

    def get_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer."""
        return self.optimizer

    def state_codec(self) -> StateCodec | None:
        """FSDP2: each rank's shards, kept in snapshots replicated on a buddy; DDP: None (a live
        peer holds the whole state)."""
        if not isinstance(self._wrap, FSDP2):
            return None
        if self.scheduler is None and self.scaler is None:
            return ModuleState(lambda: self.module, lambda: self.optimizer)
        return ModuleState(lambda: self.module, lambda: self.optimizer, extra=self._carried, restore_extra=self._carry)

    def _carried(self) -> dict[str, Any]:
        """What a snapshot or a heal carries besides the module and the optimizer."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def _carry(self, state: dict[str, Any]) -> None:
        """Puts back what :meth:`_carried` took (on another process, or after a rollback)."""
        for name, held in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if held is None:
                continue
            if state.get(name) is None:
                log.warning("RecoveringStep: no %s state came with the state (%s= on every rank?)", name, name)
            elif name == "scheduler":
                load_scheduler(held, state[name])
            else:
                held.load_state_dict(state[name])

    def heal_extra(self) -> dict[str, Any]:
        """On the live rank that heals a restarted one (DDP): the LR scheduler's state and the
        generators as the step found them, which the restarted rank's redo starts from."""
        tx = self.engine._open  # the failed step's transaction: its generators as the step found them
        return {**self._carried(), "generators": generators_to_send(tx.kept) if tx is not None else None}

    def on_healed(self, result: HealResult) -> None:
        """On the restarted rank: takes the scheduler's state and the generators the live peer sent.

        The generators are the peer's: the restarted rank's redo draws what it drew when every
        rank's generators are the same at a step (one seed on every rank, as the HF Trainer and
        Accelerate set it). A seed per rank cannot be recovered from a peer (docs/stacks/loop.md).
        """
        extra = result.extra if isinstance(result.extra, dict) else {}
        self._carry(extra)
        if extra.get("generators") is not None:
            restore_sent_generators(extra["generators"])

    def keep(self) -> bool | None:
        """DDP's ``require_forward_param_sync`` as the step found it: whether the next forward
        broadcasts the buffers. A failed attempt's forwards change it on some ranks only (a rank
        that raised before its forward, a micro-batch under ``no_sync``), and a redo whose ranks
        disagree on it runs different collectives."""
        self._forward_sync = getattr(self._model, "require_forward_param_sync", None)
        return self._forward_sync

    def restore(self, kept: bool | None) -> None:
        """Puts DDP's flag back before the redo (and :meth:`rewrap` on a new wrapper), and clears
        what the failed attempt's ``unscale_`` noted in the scaler."""
        self._forward_sync = kept
        self._put_forward_sync()
        if self.scaler is not None:
            compat.grad_scaler_forget_step(self.scaler)

    def _put_forward_sync(self) -> None:
        if self._forward_sync is not None and hasattr(self._model, "require_forward_param_sync"):
            self._model.require_forward_param_sync = self._forward_sync  # type: ignore[union-attr]

    def wrap_joined(self) -> None:
        """A restarted rank with FSDP2: shards its fresh module on the joined world before the restore."""
        self._model = self._wrapped()

    def rewrap(self, rebuilt: RebuildResult) -> None:
        """The model wrapped again on the new world (FSDP2: a new module, holding this rank's shards)."""
        # The wrapper built here reduces its first backward in the old one's gradient buckets (read
        # now, before it goes), as the run without the fault did: docs/reference/recovery-mechanism.md, "Bit-equality
        # and DDP's buckets".
        layout = kept_layout(self._model, self._wrapper_steps) if self._wrap is None else None
        # The old wrapper goes first, while the reaper still holds the abandoned groups: freeing a
        # group's last reference on this thread could wait for gloo to give up its ops.
        self._model = None
        self._wrapper_steps = 0
        if isinstance(self._wrap, FSDP2):
            self._model = self.module = self._wrap.again(self.module, self.optimizer)
            self.engine.numerics.install_sharded(self.module)
        else:
            # The layout of the rank that sends the heal (the lowest that did not join): a restarted
            # rank, wrapping in its constructor, takes it from the same rank.
            self._model = self._wrapped(layout_from=layout_source(rebuilt.joined_ranks), layout=layout)
            if not rebuilt.joined_ranks:  # a restarted rank's wrapper is new: every rank's starts as its does
                self._put_forward_sync()

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """The model and the optimizer in DCP, at ``directory/step-<step>`` (load it with
        ``dcp.load`` and ``set_state_dict``; docs/recovery.md, "Preemption")."""
        return save_dcp(self.model, self.optimizer, directory / f"step-{step}", step)

    def _wrapped(self, layout_from: int | None = None, layout: Layout | None = None) -> torch.nn.Module:
        """The model wrapped on the current world.

        Args:
            layout_from: after a rebuild, the rank whose old DDP gradient buckets every rank's new
                wrapper takes for its first backward (every rank passes the same; None: a first
                wrap, nothing is exchanged).
            layout: this rank's old buckets (:func:`kept_layout`), or None.
        """
        if isinstance(self._wrap, FSDP2):
            self.engine.numerics.install_sharded(model := self._wrap.first(self.module, self.optimizer))
            return model
        if self._wrap is not None:
            self.engine.numerics.unchecked("wrap= builds your own wrapper, and its one comm hook stays yours")
            return self._wrap(self.module)
        if not (dist.is_available() and dist.is_initialized()):
            return self.module
        kept = None if layout_from is None else share_layout(layout, layout_from, self.module)
        return self._checked(wrap_in_layout(self.module, kept))  # no layout: DistributedDataParallel(module)

    def _checked(self, model: torch.nn.Module) -> torch.nn.Module:
        """This adapter's own wrapper: its buckets checked for NaN and Inf, its replicas compared (docs/numerics.md)."""
        if self.scaler is not None:
            self.engine.numerics.unchecked(
                "a GradScaler owns non-finite gradients (it skips the step, lowers the scale)"
            )
        else:
            self.engine.numerics.install(model, self.module)
        return self.engine.replicas.install(model)

    # ------------------------------------------------------------------------ the user's part

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped model of the current world (a new object after each rebuild)."""
        assert self._model is not None  # set by the constructor and by every rewrap
        return self._model

    @property
    def recoveries(self) -> list[Recovered]:
        """The steps redone on a rebuilt world, oldest first."""
        return self.engine.recoveries

    def __call__(self, step_fn: Callable[[torch.nn.Module], Any], *, step: int | None = None) -> StepResult[Any]:
        """Runs one step: ``step_fn(model)`` (forward and backward), a commit, the optimizer step;
        on a failed commit, a rebuild and the step again.

        Args:
            step_fn: runs forward and backward on the wrapped model it is given; it must not
                step or zero the optimizer. Called again, with the same inputs, to redo the step.
            step: your loop's step number, checked by :func:`~ncclguard.should_commit` on every rank.

        Returns:
            A :class:`~ncclguard.recovery.records.StepResult`, truthy when the step was applied on
            every rank.

        Raises:
            TypeError: ``step_fn`` is not callable.
            RebuildFailed: this rank was left out, with ``left_out="raise"``.
            NonFiniteGradient: a gradient held a NaN or Inf, with ``on_nonfinite="raise"`` (docs/numerics.md).
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable (forward and backward), got {type(step_fn).__name__}")
        tx = self.engine.begin(step)
        self.zero_grad()
        tx.run(lambda: step_fn(self.model))
        res = tx.settle(lambda: step_fn(self.model))
        if res:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self._wrapper_steps += 1
        return res

    def steps(self, stop: int, start: int = 0) -> Iterator[int]:
        """Your loop's step numbers, from ``start`` (a restarted process: from the step it was
        restored at) to ``stop`` (excluded), going back when a restore from snapshots brought every
        rank back to an older step (:meth:`~ncclguard.recovery.engine.Recovery.steps`)::

            for step in stepper.steps(total):
                stepper(lambda model: loss_fn(model(batch(step))).backward(), step=step)

        Args:
            stop: the step to stop before.
            start: the first step of a process that was not restarted.

        Yields:
            Step numbers.
        """
        return self.engine.steps(stop, start)


def driven_by_a_scheduler(optimizer: Any) -> bool:
    """Whether a torch LR scheduler steps ``optimizer`` (or the optimizer a wrapper of it holds, as
    Accelerate's ``AcceleratedOptimizer``): torch wraps the optimizer's ``step`` when a scheduler is
    made on it (``torch/optim/lr_scheduler.py``, ``_wrapped_by_lr_sched``)."""
    for opt in (optimizer, getattr(optimizer, "optimizer", None)):
        if opt is not None and hasattr(getattr(opt, "step", None), "_wrapped_by_lr_sched"):
            return True
    return False
