"""``guard_trainer(trainer, recover=True)``: the recovery engine's adapter for the HF Trainer.

What the Trainer does per optimizer step (transformers 5.x, ``Trainer._run_epoch``): it sets
``accelerator.gradient_state.sync_gradients`` for each micro-batch (True on the last one of the
step), calls ``training_step(model, inputs, num_items_in_batch)`` for each (under
``accelerator.no_sync(model)`` for all but the last), then clips the gradients, calls
``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()``. So the transaction
(:mod:`ncclguard.recovery.engine`) opens at the step's first micro-batch and is settled at the end
of its last ``training_step``, before the clipping and before anything is applied:

1. ``training_step`` is wrapped on the trainer instance. Each call records its inputs, its
   ``num_items_in_batch``, the ``sync_gradients`` flag and the DDP wrapper's
   ``require_backward_grad_sync`` (the ``no_sync`` state). An exception in a micro-batch is this
   rank's failure: it is not raised, the step's later micro-batches are not computed, and a zero
   loss is returned.
2. On the last micro-batch the engine settles the step. Ok: the loss is returned and the Trainer
   clips, steps the optimizer and the LR scheduler once, as it would without ncclguard.
3. Not ok: the engine rebuilds the world; this adapter points the Trainer's DDP wrapper (the same
   object everywhere: the loop's ``model``, ``trainer.model_wrapped``, ``accelerator._models``) at
   the new group in place (:func:`~ncclguard.toolkit.repoint_ddp`); the engine puts the
   buffers and the generators back; the recorded micro-batches run again with their ``no_sync``
   state, and the step commits again. The loss the Trainer had summed for the failed attempt's
   earlier micro-batches is replaced by the redo's.
4. The recovery is logged with ``trainer.log`` (``ncclguard_recover_*`` keys in
   ``state.log_history`` and the ``report_to`` integrations) and the ncclguard logger.
5. A backend failure in the Trainer's own collectives between two steps (the loss gather of
   ``logging_steps``, an evaluation, a save, the callbacks) is not raised out of ``train()``: it
   is the next step's failure on this rank, or that of one settled as ``train()`` ends
   (:mod:`ncclguard.integrations.hf.between`).

With ``allow_shrink=True`` the survivors go on without the ranks that did not come to the
rebuild: Accelerate's state (``num_processes``, ``process_index``) follows the new world at once,
``num_items_in_batch`` is counted again over the new world for the redo, and the training data
loader is re-sharded at the next epoch's start (docs/recovery.md says what that means for the data
and the batch size). A rank left out exits 0 (the engine's left-out policy).

Under DeepSpeed (``TrainingArguments(deepspeed=...)``) the engine's step is held until the commit
and a failed step is redone on a new engine, every rank entering ``train()`` again:
:mod:`ncclguard.integrations.hf.deepspeed`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.recovery.engine import Adapter, Recovery, Reenter, Transaction
from ncclguard.recovery.heal import HealResult
from ncclguard.recovery.options import RecoveryOptions
from ncclguard.recovery.rebuild import RebuildResult
from ncclguard.recovery.records import Recovered
from ncclguard.recovery.snapshots.state import StateCodec
from ncclguard.toolkit import (
    Micro,
    awaiting_join,
    generators_to_send,
    load_scheduler,
    log,
    replay_window,
    repoint_ddp,
    repoint_sampler,
    restore_sent_generators,
    unwrapped,
)

from ..accelerate.recovery import follow_world
from .between import BetweenSteps
from .deepspeed import DeepSpeedPart, TrainerStateCodec, batch_for_world

__all__ = ["TrainerRecovery"]


class TrainerRecovery(Adapter):
    """The adapter ``guard_trainer(recover=True)`` installs on one trainer (see the module doc).

    Args:
        trainer: the ``transformers.Trainer``.
        options: the engine's options (:func:`~ncclguard.recovery.options.recovery_options`).

    Attributes:
        engine: the recovery engine (its ``recoveries`` list the steps redone).
    """

    name = "guard_trainer"

    def __init__(self, trainer: Any, options: RecoveryOptions) -> None:
        self.trainer = trainer
        self.original = trainer.training_step
        self._tx: Transaction[Any] | None = None
        # DeepSpeed: the engine's step is held until the commit; a redo builds a new engine (hf/deepspeed.py).
        self._ds = DeepSpeedPart(trainer, lambda: self._tx is not None) if trainer.is_deepspeed_enabled else None
        self.restores_in_loop = self._ds is not None
        self._joined = False  # the rebuild that sent every rank into train() again admitted restarted ranks
        self.engine = Recovery(self, options)
        self._model: torch.nn.Module | None = None
        self._micro: list[Micro] = []  # step_fn(model, inputs, num_items) redoes one
        self._given: list[torch.Tensor] = []  # the losses returned for this step's micro-batches
        self._redone: list[torch.Tensor] = []
        self._reshard: tuple[int, int] | None = None  # (rank, size) for the next epoch's data loader
        self._resume: dict[str, Any] | None = None  # the state train() resumes from after a join
        # The Trainer's collectives between two steps: a failure there is the next step's (hf/between.py).
        self._between = BetweenSteps(trainer, lambda: self._tx is not None)
        self._between.install()
        self.original_train = trainer.train
        trainer.train = self._train
        if options.heal or self._ds is not None:
            self._install_resume(trainer)

    @property
    def recoveries(self) -> list[Recovered]:
        """The steps redone on a rebuilt world, oldest first."""
        return self.engine.recoveries

    # --- the wrapped training_step -------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's ``training_step``, recorded, with the commit on the step's last micro-batch.

        Raises:
            CommitFailed, RebuildFailed, HealFailed: the step could not be applied on every rank.
        """
        if self._tx is None:  # the step's first micro-batch: the transaction opens
            self._model = model
            _check_gradients(self.engine, self.trainer, model, self._ds is not None)
            if self._resume is not None and self._resume.get("generators") is not None:
                # Here, not in the Trainer's _load_rng_state: the loop draws between the two
                # (a data loader's base seed at an epoch's start), and the step found them here.
                restore_sent_generators(self._resume["generators"])
            self._resume = None  # the resume (if any) is done: later checkpoints load as the Trainer's own
            self._tx = self.engine.begin(number=self.trainer.state.global_step)
            self._micro, self._given = [], []
        failed = self._between.take()  # between the steps (or the micro-batches): this step fails on every rank
        if failed is not None and self._tx.failure is None:
            self._tx.failure = failed
        sync = bool(self.trainer.accelerator.sync_gradients)
        grad_sync = bool(getattr(model, "require_backward_grad_sync", True))
        self._micro.append(Micro(self._again, (copy.copy(inputs), num_items_in_batch), sync, grad_sync))
        loss = self._attempt(model, inputs, num_items_in_batch)
        self._given.append(loss)
        if not sync:
            return loss
        try:
            res = self._tx.settle(lambda: self._redo(model))
            if res.skipped and self._ds is None:  # on_nonfinite="skip": the batch leaves no trace
                _skip_next_step(self.trainer.optimizer)
                return loss
            res.raise_for_error()
            if self._ds is not None:  # the engine's step, held from the last micro-batch's backward
                self._between.run(self._ds.apply_held, "DeepSpeed's optimizer step, after the commit")
            # Committed as it ran (a step entered again after a join too), or redone.
            return _replace_losses(self.trainer, self._given, self._redone) if self._redone else loss
        finally:
            self._tx, self._micro, self._given, self._redone = None, [], [], []
            if self._ds is not None:
                self._ds.drop_held()

    def _attempt(self, model: torch.nn.Module, inputs: Any, num_items: Any) -> torch.Tensor:
        assert self._tx is not None  # open from the step's first micro-batch to its settlement
        out = self._tx.run(lambda: self.original(model, inputs, num_items))
        return out if out is not None else torch.zeros((), device=self.trainer.args.device)

    # --- the adapter's part --------------------------------------------------------------------------

    def get_module(self) -> torch.nn.Module:
        """The Trainer's model, unwrapped (DDP's or DeepSpeed's module)."""
        model = self._model if self._model is not None else self.trainer.model_wrapped
        if self._ds is not None:
            return getattr(model, "module", model)
        return unwrapped(model)

    def get_optimizer(self) -> Any:
        """The Trainer's optimizer."""
        return self.trainer.optimizer

    def zero_grad(self) -> None:
        """As ``model.zero_grad()`` left the gradients before the step (DeepSpeed: nothing, the
        failed step's engine is not used again)."""
        if self._model is not None and self._ds is None:
            self._model.zero_grad(set_to_none=True)

    def discard_gradients(self, redo: bool) -> None:
        """Under DeepSpeed, after a step whose gradients every rank refused: a redo runs on a new engine
        on the same world (:meth:`DeepSpeedPart.discard`). DDP: nothing (they are the ``.grad``).

        Raises:
            Reenter: ``redo`` under DeepSpeed: every rank enters ``train()`` again at this step.
        """
        if self._ds is not None and self._ds.discard(redo):
            self._joined, self._resume = False, self.heal_extra()  # every rank alive: its own state goes in
            raise Reenter("a new DeepSpeed engine without the refused step's gradients")

    def rewrap(self, rebuilt: RebuildResult) -> None:
        """The Trainer's DDP wrapper pointed at the new group; Accelerate's state follows the world.

        Raises:
            Reenter: restarted ranks joined (``heal=True``): they start ``train()`` at this step, so
                every rank enters the Trainer's loop again there (see :meth:`_train`). Under
                DeepSpeed, always: the Trainer builds a new engine on the new world there.
        """
        if self._ds is not None:
            follow_world(rebuilt.rank, rebuilt.world_size)
            self._joined = bool(rebuilt.joined_ranks) and self.engine.options.heal
            if not self._joined:  # every rank alive: the next engine gets this rank's state as the step found it
                self._ds.keep_for_next_engine()
                self._resume = self.heal_extra()
            raise Reenter(f"a new DeepSpeed engine on world generation {rebuilt.generation}")
        if rebuilt.joined_ranks and self.engine.options.heal:
            self._resume = self.heal_extra()
            raise Reenter(f"restarted ranks {rebuilt.joined_ranks} joined")
        if self._model is not None:
            repoint_ddp(self._model)
        if follow_world(rebuilt.rank, rebuilt.world_size) or rebuilt.missing_ranks:
            self._reshard = (rebuilt.rank, rebuilt.world_size)
            if any(m.inputs[1] is not None for m in self._micro):
                _count_items_again(self.trainer, self._micro)

    def log(self, record: Recovered) -> None:
        """``trainer.log`` on every rank, as the Trainer logs; it adds the step and the epoch."""
        self.trainer.log(dict(record.metrics()))

    def state_codec(self) -> StateCodec | None:
        """DeepSpeed: each rank's own ZeRO state and the Trainer's state, kept in snapshots replicated
        on a buddy rank (``heal=True``). DDP: None (a live peer sends the whole state)."""
        return TrainerStateCodec(self._ds) if self._ds is not None else None

    def heal_extra(self) -> dict[str, Any]:
        """What a restarted rank's Trainer resumes from, beside the model and the optimizer: the
        Trainer's state (JSON), the LR scheduler's, and the generators as the step found them."""
        scheduler = self.trainer.lr_scheduler
        kept = self._tx.kept if self._tx is not None else None
        return {
            "trainer_state": json.dumps(dataclasses.asdict(self.trainer.state)),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "generators": generators_to_send(kept) if kept is not None else None,
        }

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """The Trainer's own ``checkpoint-<global_step>`` under ``directory`` (model, optimizer,
        scheduler, generators, Trainer state), written by the Trainer's ``_save_checkpoint``: resume
        with ``trainer.train(resume_from_checkpoint=...)``. Nothing is pushed to the Hub."""
        trainer, args = self.trainer, self.trainer.args
        kept = (args.output_dir, args.push_to_hub)
        args.output_dir, args.push_to_hub = str(directory), False  # the preemption directory only
        try:
            trainer._save_checkpoint(self._model if self._model is not None else trainer.model_wrapped, trial=None)
        finally:
            args.output_dir, args.push_to_hub = kept
        return directory / f"checkpoint-{trainer.state.global_step}"

    def on_healed(self, result: HealResult) -> None:
        """Keeps what the live peer sent: ``train()`` resumes from it."""
        if not isinstance(result.extra, dict):
            raise ValueError("the live peer sent no Trainer state to resume from (heal=True on every rank?)")
        self._resume = result.extra

    # --- joining and entering the loop again (heal=True) ------------------------------------------

    def _install_resume(self, trainer: Any) -> None:
        """Wraps the Trainer's checkpoint loaders on the instance: a restarted rank joins in
        ``train()``, and every rank enters the loop again at the step a join redoes, through the
        Trainer's own resume path (it positions the data, the step and the epoch) fed from memory
        (:meth:`_train`)."""
        for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state"):
            setattr(trainer, name, self._loader(name, getattr(trainer, name)))
        if self._ds is not None:
            trainer._prepare_for_training = self._preparing(trainer._prepare_for_training)

    def _preparing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``Trainer._prepare_for_training`` under DeepSpeed: builds the engine as the Trainer does;
        a resume from memory skips DeepSpeed's checkpoint loader (there is no file), and the state
        kept for the new engine goes in once it is built (:meth:`DeepSpeedPart.adopt`)."""

        def prepare(max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any = None) -> Any:
            ours = self._resume is not None and resume_from_checkpoint == _resume_dir(self.trainer)
            out = original(max_steps, train_dataloader, None if ours else resume_from_checkpoint)
            assert self._ds is not None  # installed for DeepSpeed only
            self._ds.adopt(self.trainer.model_wrapped, self.engine)
            return out

        prepare.__doc__ = "Trainer._prepare_for_training; the engine it builds is adopted by ncclguard"
        return prepare

    def _loader(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def load(checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self._resume is None or checkpoint != _resume_dir(self.trainer):
                return original(checkpoint, *args, **kwargs)
            if name == "_load_optimizer_and_scheduler" and self._resume.get("scheduler") is not None:
                load_scheduler(self.trainer.lr_scheduler, self._resume["scheduler"])
            # The model and the optimizer are in place already: the survivors' as the step found
            # them, a restarted rank's from the heal (DeepSpeed: put in the new engine, _preparing).
            # The generators: at the step's first micro-batch (training_step). The scaler: none on CPU.
            return None

        load.__doc__ = f"Trainer.{name}, fed from memory when train() resumes at a join (ncclguard)"
        return load

    def _train(self, *args: Any, **kwargs: Any) -> Any:
        """``trainer.train()``: on a restarted rank, joins first; on every rank, enters the loop
        again at a step that restarted ranks joined (:class:`~ncclguard.recovery.engine.Reenter`);
        a failure between steps left after the last one is settled before it returns."""
        with self._between.in_train():
            bound = inspect.signature(self.original_train).bind(*args, **kwargs)
            if awaiting_join(self.engine.options.heal):
                if self.trainer.optimizer is None and self._ds is None:  # made now, so that the heal fills it
                    self.trainer.create_optimizer()
                self.engine.join_if_restarted()
                follow_world(dist.get_rank(), dist.get_world_size())  # the stand-in said rank 0 of 1
                if self._ds is not None:  # its partitions come from its buddy's snapshot, with the others'
                    batch_for_world(self.trainer, dist.get_world_size())
                    self._resume = self._ds.enter_again(self.engine, joined=True)
            while True:
                if self._resume is not None:
                    path = Path(_resume_dir(self.trainer))
                    path.mkdir(parents=True, exist_ok=True)
                    (path / "trainer_state.json").write_text(self._resume["trainer_state"])
                    bound.arguments["resume_from_checkpoint"] = str(path)
                try:
                    out = self.original_train(*bound.args, **bound.kwargs)
                    self._settle_last()
                    return out
                except Reenter as why:
                    log.warning(
                        "guard_trainer: %s; every rank enters the training loop again at the step it redoes", why
                    )
                    self._between.take()  # a failure of the old world's
                    self._model = None
                    trainer = self.trainer
                    if self._ds is not None:  # a fresh module for the new engine, and the snapshot's state
                        resume = self._ds.enter_again(self.engine, joined=self._joined)
                        self._resume = resume if resume is not None else self._resume
                        continue
                    # As a new process has them: the model unwrapped (Accelerate wraps it again on the
                    # new group) and the optimizer itself (Accelerate wraps it again too).
                    trainer.model_wrapped = trainer.model
                    trainer.optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)

    def _settle_last(self) -> None:
        """A failure between steps kept after the last step (no next step takes it): settled as a
        step of its own with nothing to compute, so that the world is rebuilt and a dead rank healed
        before ``train()`` returns (under DeepSpeed, or when ranks joined: :class:`Reenter`)."""
        failed = self._between.take()
        if failed is None:
            return
        self._tx = self.engine.begin(number=self.trainer.state.global_step)
        self._tx.failure = failed
        try:
            self._tx.settle(lambda: None).raise_for_error()
        finally:
            self._tx = None

    # --- the redo ------------------------------------------------------------------------------------

    def _again(self, model: torch.nn.Module, inputs: Any, num_items: Any) -> torch.Tensor:
        """One recorded micro-batch again, on a copy of its inputs (the Trainer may change them)."""
        return self._attempt(model, copy.copy(inputs), num_items)

    def _redo(self, model: torch.nn.Module) -> list[torch.Tensor]:
        self._redone = replay_window(
            self._micro,
            lambda: model,
            set_sync_gradients=self.trainer.accelerator.gradient_state._set_sync_gradients,
            no_sync=_no_sync,
        )
        return self._redone

    # --- between epochs --------------------------------------------------------------------------

    def on_epoch_begin(self, train_dataloader: Any) -> list[str]:
        """Re-shards the training data loader for the new world, once, at an epoch's start."""
        reshard, self._reshard = self._reshard, None
        return _reshard(train_dataloader, reshard)


def _reshard(train_dataloader: Any, reshard: tuple[int, int] | None) -> list[str]:
    """The training data loader re-pointed at (rank, size) ``reshard``; what was re-pointed."""
    if reshard is None or train_dataloader is None:
        return []
    rank, size = reshard
    done = repoint_sampler(train_dataloader, rank, size)
    if not done:
        log.warning(
            "guard_trainer: the world is now %d rank(s), but the training data loader shards with nothing "
            "ncclguard can re-point; each rank goes on reading its old shard",
            size,
        )
    return done


def _check_gradients(engine: Recovery, trainer: Any, model: torch.nn.Module, deepspeed: bool) -> None:
    """The Trainer's DDP wrapper checked for NaN and Inf before each bucket's all-reduce, and its
    replicas compared, as ``RecoveringStep``'s own are (docs/numerics.md; once per wrapper), or said
    once why not. Under DeepSpeed each parameter's gradient is checked before ZeRO reduces it (a
    hook on the parameter, as ``CommittedEngineStep``'s; again on each new engine's parameters)."""
    if deepspeed:
        engine.numerics.install_params(getattr(model, "module", model), "the Trainer on DeepSpeed")
        engine.replicas.unchecked("DeepSpeed's ZeRO partitions the optimizer's state: no rank holds a whole replica")
    else:
        engine.numerics.adopt(model, unwrapped(model), "the Trainer", trainer.accelerator.scaler)
        engine.replicas.adopt(model, "the Trainer")


def _resume_dir(trainer: Any) -> str:
    """Where the Trainer's state of a resume is written (its resume path reads it from a file):
    inside the run's output_dir, one directory per launch rank."""
    return str(Path(trainer.args.output_dir) / ".ncclguard-resume" / f"rank{os.environ.get('RANK', '0')}")


def _count_items_again(trainer: Any, micro: list[Micro]) -> None:
    """``num_items_in_batch`` of a redo's micro-batches summed over the new world (the Trainer counts
    it once per step)."""
    count = getattr(trainer, "_get_num_items_in_batch", None)
    if not callable(count):
        return
    try:
        n = count([m.inputs[0] for m in micro], trainer.args.device)
    except Exception as exc:  # noqa: BLE001 - a collective of the redo: its failure is the step's
        log.warning("guard_trainer: counting the batch's items over the new world failed (%s)", exc)
        return
    for m in micro:
        m.inputs = (m.inputs[0], n)


def _replace_losses(trainer: Any, given: list[torch.Tensor], losses: list[torch.Tensor]) -> torch.Tensor:
    """The Trainer summed the failed attempt's losses of the earlier micro-batches (``given``): it
    gets the redo's (``losses``) instead.

    Returns:
        The redo's loss of the last micro-batch (the one ``training_step`` returns).
    """
    earlier_new, earlier_old = losses[:-1], given[:-1]
    total = getattr(trainer, "_tr_loss", None)
    if not earlier_new or not isinstance(total, torch.Tensor):
        return losses[-1]
    delta = (
        torch.stack([t.detach().to(total.device) for t in earlier_new]).sum()
        - torch.stack([t.detach().to(total.device) for t in earlier_old]).sum()
    )
    if torch.isfinite(delta):  # the Trainer's NaN filter replaced a non-finite loss: leave the sum
        total += delta
    return losses[-1]


def _skip_next_step(optimizer: Any) -> None:
    """The Trainer's next ``optimizer.step()`` skipped, and with it its LR scheduler's step, as
    Accelerate skips both for an fp16 overflow: ``AcceleratedOptimizer.step_was_skipped`` is True until
    the step after (the Trainer steps the scheduler only ``if not accelerator.optimizer_step_was_skipped``,
    transformers 5.x ``Trainer._inner_training_loop``). The gradients are cleared already.

    Raises:
        TypeError: the optimizer is not Accelerate's (the Trainer's always is).
    """
    if not hasattr(optimizer, "_is_overflow"):
        raise TypeError(
            f"on_nonfinite='skip' needs the Trainer's AcceleratedOptimizer, not a {type(optimizer).__name__}"
        )
    own, set_here = optimizer.step, "step" in vars(optimizer)  # the class's, or one set on the instance

    def put_back() -> None:
        if set_here:
            optimizer.step = own
        else:
            del optimizer.step

    def skipped(*args: Any, **kwargs: Any) -> None:
        optimizer._is_overflow = True  # read by the Trainer before its scheduler's step

        def after(*args: Any, **kwargs: Any) -> Any:
            optimizer._is_overflow = False
            put_back()
            return own(*args, **kwargs)

        optimizer.step = after

    optimizer.step = skipped


def _no_sync(model: torch.nn.Module) -> AbstractContextManager[Any]:
    """DDP's ``no_sync`` on the Trainer's model; nothing for a model without one (a DeepSpeed engine)."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else nullcontext()
