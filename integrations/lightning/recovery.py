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

Gradient accumulation (``accumulate_grad_batches=N``): Lightning's automatic optimization runs
``AutomaticOptimization.run`` once per micro-batch; on all but the last micro-batch of a window it
runs the closure itself inside ``_block_parallel_sync_behavior`` (DDP's ``no_sync``) and steps no
optimizer, on the last it calls ``strategy.optimizer_step`` (``loops/optimization/automatic.py``,
``run``; the window's end is ``fit_loop._should_accumulate()``, ``loops/training_epoch_loop.py``).
So ``run`` is wrapped too: the window's first micro-batch opens the transaction (the buffers, the
generators, the logged values as the window found them), each micro-batch is recorded (its batch,
its index, whether it ran without gradient sync), an exception in one is this rank's failure (the
window's later micro-batches are not computed), and the commit is at the last one's
``optimizer_step``. A redo runs every micro-batch of the window again on the rebuilt world, each
under the sync behaviour it had, the first one's ``zero_grad`` included.

``ModelParallelStrategy`` (FSDP2 applied in ``configure_model``): after a rebuild the module is
sharded again on the new world instead of re-wrapped in DDP, and with ``heal`` each rank's shards go
into snapshots replicated on a buddy; a restore that takes every rank back to an older snapshot
enters the fit loop again there (:mod:`ncclguard.integrations.lightning.sharded`).

Refused when the callback is set up (a ``ValueError`` before any step): a strategy other than DDP
or ``ModelParallelStrategy`` (Lightning's FSDP1 and DeepSpeed strategies: CUDA only in Lightning,
so untested here), tensor parallelism or a shrink with FSDP2, and manual optimization (the user's
code steps the optimizer).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ncclguard.recovery.engine import Adapter, Recovery, Reenter, Transaction
from ncclguard.recovery.heal import HealResult
from ncclguard.recovery.options import RecoveryOptions
from ncclguard.recovery.rebuild import RebuildResult
from ncclguard.recovery.records import Recovered
from ncclguard.recovery.snapshots.state import ModuleState, StateCodec
from ncclguard.toolkit import (
    StepState,
    awaiting_join,
    generators_to_send,
    kept_layout,
    layout_source,
    load_scheduler,
    log,
    restore_sent_generators,
    share_layout,
    wrap_in_layout,
)

from .preempt import save_lightning
from .sharded import ShardedLightning, check_model_parallel

__all__ = ["StepRecovery", "check_recoverable"]


def _skip_batches(fetcher: Any, count: int) -> None:
    """Draws ``count`` batches from the fetcher's loader and drops them; Lightning's counters stay as
    the loaded loop state says (a fetcher that prefetched keeps as many batches ahead)."""
    for _ in range(count):
        try:
            if getattr(fetcher, "batches", None):
                fetcher.batches.pop(0)
                fetcher.batches.append(next(fetcher.iterator))
            else:
                next(fetcher.iterator)
        except StopIteration:
            return


def check_recoverable(trainer: Any, pl_module: Any, *, allow_shrink: bool = False) -> None:
    """Refuses what a redo cannot handle exactly, before any step runs.

    Args:
        trainer: the trainer, its strategy's environment set up (the callback's ``setup``).
        pl_module: the LightningModule.
        allow_shrink: the callback's option (refused with FSDP2: a lost rank's shards have no replica).

    Raises:
        ValueError: a strategy other than DDP or ModelParallelStrategy (FSDP2), tensor parallelism,
            a shrink with FSDP2, or manual optimization.
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        check_model_parallel(strategy, allow_shrink)
    elif isinstance(strategy, FSDPStrategy | DeepSpeedStrategy):
        raise ValueError(
            f"NcclGuardCallback(recover=True) does not redo steps under {type(strategy).__name__}: Lightning 2.6 "
            "runs it on CUDA GPUs only (FSDPStrategy: 'requires a GPU accelerator', trainer/connectors/"
            "accelerator_connector.py; DeepSpeedStrategy: 'only supported on CUDA GPUs', strategies/deepspeed.py "
            "setup_environment), so its recovery could not be built and tested. For sharded state use "
            "ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1) with fully_shard in "
            "configure_model (FSDP2: a killed rank comes back from its buddy's snapshot with heal=True); for "
            "DeepSpeed ZeRO, a loop of your own with ncclguard.integrations.deepspeed.CommittedEngineStep(..., "
            "rebuild_engine=..., heal=True) (docs/recovery.md); or recover=False"
        )
    elif not isinstance(strategy, DDPStrategy):
        raise ValueError(
            f"NcclGuardCallback(recover=True) redoes steps under the DDP strategy or ModelParallelStrategy (FSDP2) "
            f"only, got {type(strategy).__name__}; use strategy='ddp' (DDPStrategy), ModelParallelStrategy, or "
            "recover=False"
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
        # DDP's buffer-sync flag (the next forward broadcasts the buffers): a failed attempt's forwards
        # change it on some ranks only; the wrapper made again on the new world gets it back.
        self.forward_sync = getattr(trainer.strategy.model, "require_forward_param_sync", None)
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


@dataclass
class _Micro:
    """One micro-batch of the current window, as Lightning's ``AutomaticOptimization.run`` got it."""

    optimizer: Any
    batch_idx: int
    kwargs: Any  # the hooks' kwargs: the batch, its index
    blocked: bool  # run inside the strategy's block_backward_sync (DDP's no_sync)


def _data_again(loop: Any) -> None:
    """The training data at the loaded loop's position: Lightning restores a loader that has a
    state (``state_dict``/``load_state_dict``) itself; any other starts its epoch again, so its
    batches up to the position are drawn and dropped, as a run without the fault drew them (a
    loader whose order is fixed by its sampler's seed and epoch: Lightning's DistributedSampler).
    Setting the data up draws from torch's generator (the loader iterator's base seed): the
    generators are left as the step found them."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.fabric.utilities.types import _Stateful

    position = loop.epoch_loop.batch_progress.current.ready  # batches drawn this epoch
    generators = StepState.take(torch.nn.Module())
    try:
        loop.setup_data()
        combined, fetcher = loop._combined_loader, loop._data_fetcher
        if combined is None or fetcher is None:
            return
        for loader in combined.flattened:  # before the first batch is drawn, as the epoch's start does
            _set_sampler_epoch(loader, loop.epoch_progress.current.processed)
        if all(isinstance(loader, _Stateful) for loader in combined.flattened):
            return
        _skip_batches(fetcher, position)
    finally:
        generators.restore_generators()


def _ddp_again(strategy: Any, layout_from: int | None, steps: int) -> None:
    """The strategy's DDP wrapper made again on the current world, by the strategy (its DDP
    arguments), every rank's reducing its first backward in rank ``layout_from``'s old gradient
    buckets: with DDP's default ``find_unused_parameters=False`` a new wrapper's first layout is not
    the one the run without the fault reduced in (docs/recovery.md, "Bit-equality and DDP's
    buckets"). Every rank of the world calls it with the same ``layout_from`` (None: nothing
    exchanged, DDP's first layout); ``steps``: the steps the old wrapper committed."""
    module = strategy.lightning_module
    layout = kept_layout(strategy.model, steps) if layout_from is not None else None
    # The old wrapper goes first, while the reaper still holds the abandoned groups.
    strategy.model = module
    if layout_from is None:
        strategy.model = strategy._setup_model(module)
    else:
        strategy.model = wrap_in_layout(module, share_layout(layout, layout_from, module), build=strategy._setup_model)
    strategy._register_ddp_hooks()  # the communication hooks of the old wrapper (CUDA only)


class StepRecovery(Adapter):
    """Wraps ``strategy.optimizer_step`` so that each step is a transaction of the engine.

    Args:
        options: the engine's options (:func:`~ncclguard.recovery.options.recovery_options`).
        on_recovered: called with the trainer and each :class:`~ncclguard.recovery.records.Recovered`
            step (the callback logs it to Lightning's loggers).

    Attributes:
        engine: the recovery engine.
    """

    name = "NcclGuardCallback"

    def __init__(self, options: RecoveryOptions, on_recovered: Callable[[Any, Recovered], None]) -> None:
        self.on_recovered = on_recovered
        self._sharded: ShardedLightning | None = None  # ModelParallelStrategy (FSDP2): set in the callback's setup
        self.engine = Recovery(self, options)
        self.trainer: Any = None
        self._tx: Transaction[Any] | None = None
        self._window: list[_Micro] = []  # the micro-batches of the open transaction
        self._forward_sync: bool | None = None  # DDP's buffer-sync flag as the open step found it
        self._loops: dict[str, Any] | None = None  # the fit loop's state at the last window's end
        self._resume: dict[str, Any] | None = None  # what the fit loop resumes from after a join
        # The rank whose DDP gradient buckets every rank's next wrapper takes (set with _resume on a join).
        self._layout_from: int | None = None
        self._wrapper_steps = 0  # steps committed on the strategy's current DDP wrapper

    def use_sharded(self, trainer: Any, pl_module: Any) -> None:
        """ModelParallelStrategy (FSDP2): keeps the module's skeletons (before ``configure_model`` shards
        it), and makes the engine again so that, with ``heal``, it keeps snapshots of each rank's shards
        replicated on a buddy (:meth:`state_codec`)."""
        self.trainer = trainer
        self._sharded = ShardedLightning(trainer, pl_module)
        self.engine = Recovery(self, self.engine.options)

    def check_sharded(self) -> None:
        """When fit starts (after ``configure_model``): can a rebuilt world shard the module again?

        Raises:
            ValueError: see :meth:`~ncclguard.integrations.lightning.sharded.ShardedLightning.check`.
        """
        if self._sharded is not None:
            self._sharded.check()

    def optimizer_step(self, trainer: Any) -> Callable[..., Any]:
        """The wrapper of ``trainer.strategy.optimizer_step`` (set by the callback as an instance attribute):
        the window's last micro-batch, then the commit."""
        self.trainer = trainer
        original = trainer.strategy.optimizer_step

        def optimizer_step(optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
            tx = self._tx if self._tx is not None else self.engine.begin(trainer.global_step)
            self._tx = tx
            tx.run(closure)  # training_step, zero_grad, backward: DDP's gradient all_reduce
            try:
                res = tx.settle(lambda: self._replay(closure))
            finally:
                self._tx, self._window = None, []
            if res.rewound_to is not None:  # every rank went back to a snapshot: its step, in the fit loop
                raise Reenter(f"every rank went back to step {res.rewound_to}'s snapshot")
            res.raise_for_error()
            self._wrapper_steps += 1
            return original(optimizer, lambda done=res.output: done, model, **kwargs)  # computed above

        return optimizer_step

    def automatic_run(self, trainer: Any) -> Callable[..., Any]:
        """The wrapper of ``fit_loop.epoch_loop.automatic_optimization.run`` (one call per micro-batch):
        the window's first micro-batch opens the transaction, each is recorded, and one that
        accumulates (no optimizer step) runs inside the transaction (see the module doc)."""
        self.trainer = trainer
        original = trainer.fit_loop.epoch_loop.automatic_optimization.run

        def run(optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
            blocked = not trainer.strategy.handles_gradient_accumulation and trainer.fit_loop._should_accumulate()
            if self._tx is None:
                self._tx, self._window = self.engine.begin(trainer.global_step), []
            # A shallow copy: the loop's dict is its own, the batch is the one training_step was given.
            self._window.append(_Micro(optimizer, batch_idx, copy.copy(kwargs), blocked))
            if not blocked:  # the window's last: optimizer_step (wrapped above) runs it and commits
                return original(optimizer, batch_idx, kwargs)
            out = self._tx.run(lambda: original(optimizer, batch_idx, kwargs))
            return out if out is not None else {}  # what run returns for a step without a loss

        return run

    def _replay(self, closure: Callable[[], Any]) -> Any:
        """The redo: every micro-batch of the window again, each under the gradient sync it had, the
        last through Lightning's own closure (its result is what the optimizer step is given)."""
        from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior

        trainer = self.trainer
        automatic = trainer.fit_loop.epoch_loop.automatic_optimization
        for micro in self._window[:-1]:
            again = automatic._make_closure(micro.kwargs, micro.optimizer, micro.batch_idx)
            with _block_parallel_sync_behavior(trainer.strategy, block=micro.blocked):
                again()
        return closure()

    # ------------------------------------------------------------------------ joining (heal=True)

    def keep_loops(self, trainer: Any) -> None:
        """The fit loop's state at a window's end (the callback's ``on_train_batch_end`` after an
        optimizer step, and at train start): where Lightning's own mid-epoch checkpoints are taken,
        so its resume logic reads it as one. A join resumes every rank from it."""
        if trainer.fit_loop._should_accumulate():
            return  # inside a window: a join resumes at the window's start
        self._loops = copy.deepcopy(trainer.fit_loop.state_dict())

    def fit_loop_run(self, trainer: Any) -> Callable[[], Any]:
        """The wrapper of ``trainer.fit_loop.run`` (set in the callback's ``setup``): on a restarted
        rank, the join; on every rank, the fit loop entered again at a step that restarted ranks
        joined (:class:`~ncclguard.recovery.engine.Reenter`), from the same state."""
        self.trainer = trainer
        original = trainer.fit_loop.run

        def run() -> Any:
            if awaiting_join(self.engine.options.heal):
                joined = self.engine.join_if_restarted()
                # The survivors' wrappers take the healing rank's buckets; this one takes them too.
                self._layout_from = joined.source if isinstance(joined, HealResult) else None
                self._resume_from()
            while True:
                try:
                    return original()
                except Reenter as why:
                    log.warning("NcclGuardCallback: %s; every rank enters the fit loop again", why)
                    self._resume_from()

        return run

    def _resume_from(self) -> None:
        """Puts the fit loop, the LR schedulers and the generators where the join's step starts, wraps
        the module in DDP anew on the joined world (FSDP2: sharded again already), and sets the
        training data up again at the loop's position (the same on every rank)."""
        assert self._resume is not None  # set by the heal or the restore (restarted rank) or by rewrap (survivors)
        resume, self._resume = self._resume, None
        layout_from, self._layout_from = self._layout_from, None
        trainer = self.trainer
        loop = trainer.fit_loop
        # The training data is set up again, as in a new process: FitLoop.setup_data skips a loop
        # that has a loader (and its barrier with it), and a restarted rank's has none yet.
        if loop._data_fetcher is not None:
            loop._data_fetcher.teardown()
            loop._data_fetcher = None
        loop._combined_loader = None
        if resume.get("loops") is not None:
            loop.load_state_dict(resume["loops"])
        for config, state in zip(trainer.lr_scheduler_configs, resume.get("schedulers") or [], strict=False):
            load_scheduler(config.scheduler, state)
        if resume.get("generators") is not None:
            restore_sent_generators(resume["generators"])
        self._setup_model_again(layout_from)
        _data_again(loop)

    def _setup_model_again(self, layout_from: int | None) -> None:
        if self._sharded is not None:
            return  # FSDP2: sharded again on the joined world by rewrap or wrap_joined
        _ddp_again(self.trainer.strategy, layout_from, self._wrapper_steps)
        self._wrapper_steps = 0

    def heal_extra(self) -> dict[str, Any]:
        """The fit loop's state at the last batch's end, the LR schedulers' and the generators as
        the step found them: what a restarted rank's fit loop resumes from."""
        kept = self._tx.kept if self._tx is not None else None
        return {
            "loops": self._loops,
            "schedulers": [config.scheduler.state_dict() for config in self.trainer.lr_scheduler_configs],
            "generators": generators_to_send(kept) if kept is not None else None,
        }

    def on_healed(self, result: HealResult) -> None:
        """Keeps what the live peer sent: the fit loop resumes from it."""
        if not isinstance(result.extra, dict):
            raise ValueError("the live peer sent no fit-loop state to resume from (heal=True on every rank?)")
        self._resume = result.extra

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
        self._forward_sync = kept.forward_sync

    def state_codec(self) -> StateCodec | None:
        """FSDP2 (ModelParallelStrategy): each rank's shards, the optimizer's, the fit loop's state and
        the LR schedulers', kept in snapshots replicated on a buddy; DDP: None (a live peer sends the
        whole state)."""
        if self._sharded is None:
            return None
        return ModuleState(
            lambda: self.trainer.strategy.lightning_module,
            self.get_optimizer,
            extra=self._snapshot_extra,
            restore_extra=self._from_snapshot,
        )

    def _snapshot_extra(self) -> dict[str, Any]:
        # At a step's start: the fit loop as the last window left it, the schedulers before this step.
        return {
            "loops": self._loops,
            "schedulers": [config.scheduler.state_dict() for config in self.trainer.lr_scheduler_configs],
        }

    def _from_snapshot(self, extra: Any) -> None:
        # The restore puts the generators back itself; the fit loop resumes from the rest.
        if not isinstance(extra, dict):
            raise ValueError("the snapshot holds no fit-loop state to resume from")
        self._resume = {"loops": extra.get("loops"), "schedulers": extra.get("schedulers")}

    def wrap_joined(self) -> None:
        """A restarted rank (FSDP2): shards its fresh module on the joined world before the restore."""
        assert self._sharded is not None  # only called with a state codec
        self._sharded.reshard(copy_shards=False)

    def rewrap(self, rebuilt: RebuildResult) -> None:
        """The strategy's DDP wrapper made again on the new group (FSDP2: the module sharded again,
        each rank keeping its shards); after a shrink, Lightning's rank and world size read the new
        world.

        Raises:
            Reenter: restarted ranks joined (``heal=True``) under DDP: they start the fit loop at this
                step, so every rank enters it again there (:meth:`fit_loop_run`). Under FSDP2 the
                restore from snapshots comes first; the optimizer step's wrapper re-enters if it
                brought every rank back to an older step.
        """
        if self._sharded is not None:
            self._sharded.reshard(copy_shards=True)
            return
        # Every rank's new wrapper takes the buckets of the rank that heals (the lowest that did not
        # join); a restarted rank reads the same rank as its heal's source.
        source = layout_source(rebuilt.joined_ranks)
        if rebuilt.joined_ranks and self.engine.options.heal:
            self._resume, self._layout_from = self.heal_extra(), source
            raise Reenter(f"restarted ranks {rebuilt.joined_ranks} joined")
        self._setup_model_again(source)
        if self._forward_sync is not None and hasattr(self.trainer.strategy.model, "require_forward_param_sync"):
            self.trainer.strategy.model.require_forward_param_sync = self._forward_sync
        if rebuilt.missing_ranks:  # a shrink renumbered the ranks
            self._renumber()

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """Lightning's own checkpoint, by ``trainer.save_checkpoint`` (:func:`.preempt.save_lightning`)."""
        return save_lightning(self.trainer, directory, sharded=self._sharded is not None)

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
        rank_zero_only.rank = fabric_rank_zero_only.rank = dist.get_rank()
