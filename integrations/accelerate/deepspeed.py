"""``recovering_step`` for an Accelerate loop whose ``Accelerator`` has the DeepSpeed plugin (ZeRO 1, 2, 3).

::

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))

    def build():                      # the model and optimizer, as the loop builds them before prepare
        module = Net()
        return module, DummyOptim(module.parameters())

    model, optimizer = accelerator.prepare(*build())
    stepper = recovering_step(accelerator, model, optimizer, rebuild=build, heal=True)
    for step in stepper.steps(total):
        res = stepper(lambda engine, batch: accelerator.backward(loss_fn(engine, batch)), batch_at(step), step=step)

Under the plugin ``accelerator.prepare`` returns a ``DeepSpeedEngine`` and ``accelerator.backward(loss)``
is Accelerate's ``DeepSpeedEngineWrapper.backward`` (accelerate/utils/deepspeed.py): ``engine.backward``
then ``engine.step()``; the prepared optimizer's ``step``/``zero_grad`` do nothing. So the stepper holds
the engine's ``step`` while a step's transaction is open and runs it once every rank committed, never
for a step that failed (as :class:`~ncclguard.integrations.hf.deepspeed.DeepSpeedPart` does for the HF
Trainer).

A DeepSpeed engine keeps the groups of the world it was built in
(:mod:`ncclguard.integrations.deepspeed.commit`), so a failed step is redone on a new engine: after
the rebuild of the world every rank drops DeepSpeed's cached groups, builds a fresh module and
optimizer with ``rebuild()`` (default: a ``PreTrainedModel``'s config and a ``DummyOptim`` when the
DeepSpeed config names the optimizer), takes out of the Accelerator what the first ``prepare`` left
there (the engine in ``_models``, the optimizer and scheduler wrappers, ``deepspeed_engine_wrapped``),
and calls ``accelerator.prepare`` again. The new engine gets:

- every rank alive (an exception, a stall past the step bound): its own ZeRO state as the failed step
  found it, taken from the old engine (:class:`~ncclguard.integrations.deepspeed.state.DeepSpeedState`,
  no collective); the step is redone, bit-equal to a run without the fault;
- a rank killed and restarted by its supervisor (``heal=True``): every rank goes back to the newest
  snapshot all hold (:mod:`ncclguard.recovery.snapshots`, taken every ``snapshot_every`` steps), the
  restarted rank's partitions from its buddy's replica; the result is falsy with ``rewound_to`` set
  and :meth:`AcceleratorDeepSpeedStep.steps` goes back with it.

After a rebuild the engine, optimizer and scheduler the first ``prepare`` returned are dead: use the
engine ``step_fn`` is given (``stepper.model``), ``stepper.optimizer`` and ``stepper.scheduler``.

With ``gradient_accumulation_steps`` above 1 the loop calls the stepper once per micro-batch and passes
the micro-batch as an argument, as with DDP (:mod:`~ncclguard.integrations.accelerate.recovery`): each
call enters ``accelerator.accumulate``, the window's last commits, and a failed window runs again whole
on the new engine. ``heal=True`` with accumulation is refused (a restore between windows is not tested).

Refused at construction, before any communication: :func:`deepspeed_plugin_refusal`, a model
ncclguard cannot build afresh without ``rebuild``, a torch LR scheduler Accelerate steps outside the
engine (its state is not the engine's), an engine :class:`DeepSpeedState` cannot take.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Unpack

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ncclguard.recovery.engine import Adapter, Recovery, Transaction
from ncclguard.recovery.options import RecoveryKeywords, recovery_options
from ncclguard.recovery.rebuild import RebuildResult, generation
from ncclguard.recovery.records import Recovered, StepResult
from ncclguard.recovery.snapshots.state import StateCodec
from ncclguard.toolkit import Micro, awaiting_join, check_window, log

from ..deepspeed.commit import number_parameters_afresh, release_deepspeed_groups
from ..deepspeed.state import CurrentEngineState, DeepSpeedState
from .recovery import follow_world, replay_on

__all__ = ["AcceleratorDeepSpeedStep", "deepspeed_plugin_refusal"]

Built = tuple[Any, ...]  # what rebuild() returns: (module, optimizer) or (module, optimizer, scheduler)


def deepspeed_plugin_refusal(accelerator: Accelerator, allow_shrink: bool, heal: bool = False) -> str | None:
    """Why ``recovering_step`` cannot recover this Accelerator's DeepSpeed setup, or None; read from the
    DeepSpeed config and the Accelerator before any step.

    Args:
        accelerator: an ``Accelerator`` with ``DistributedType.DEEPSPEED``.
        allow_shrink: the ``allow_shrink`` asked for.
        heal: the ``heal`` asked for.

    Returns:
        One sentence naming what cannot be recovered and what to use instead, or None.
    """
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    zero = config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        return (
            f"recovering_step with the DeepSpeed plugin keeps each rank's ZeRO partitions, and this config has ZeRO "
            f'stage {stage!r}: set "zero_optimization": {{"stage": 1}} (or 2, 3), or build the Accelerator without the '
            "plugin (DDP, which recovering_step recovers too)"
        )
    nvme = [k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device") == "nvme"]
    if nvme:
        return f"recovering_step keeps the ZeRO state in memory; {', '.join(nvme)} to NVMe keeps it on disk: offload to cpu or none"
    if int(zero.get("zero_hpz_partition_size", 1) or 1) > 1:
        return "recovering_step does not keep hpZ's secondary partitions: set zero_hpz_partition_size to 1"
    if int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1) > 1:
        return "recovering_step with DeepSpeed covers data parallelism only; this config has autotp_size > 1"
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and getattr(pc, "sp_enabled", False):
        return "recovering_step with DeepSpeed covers data parallelism only; this Accelerator uses sequence parallelism"
    if allow_shrink:
        return (
            "allow_shrink=True cannot go on with DeepSpeed ZeRO: each rank's partitions are laid out for the world "
            "size they were made in, and a smaller world cannot take them. Leave allow_shrink off (a lost rank is "
            "restarted and healed with heal=True under ncclguard run --ncclguard-restarts)"
        )
    # "auto" takes the Accelerator's; a number in the config wins over it at prepare (accelerator.py).
    gas = config.get("gradient_accumulation_steps", "auto")
    gas = accelerator.gradient_accumulation_steps if gas == "auto" else gas
    if heal and gas != 1:
        return (
            f"heal=True with the DeepSpeed plugin needs gradient_accumulation_steps=1, got {gas}: a restore in the "
            "middle of accumulation windows is not tested. Use heal=False (a failed window is still redone whole "
            "on a new engine), or gradient_accumulation_steps=1 with a larger train_micro_batch_size_per_gpu"
        )
    return None


def _default_rebuild(accelerator: Accelerator, engine: Any) -> Callable[[], Built] | str:
    """The builder used without ``rebuild=``, or why there is none: a ``PreTrainedModel`` (built afresh
    from its config) with the optimizer, and the scheduler if any, in the DeepSpeed config. ``engine``:
    the prepared engine or the module to prepare."""
    from accelerate.utils import DummyOptim, DummyScheduler
    from transformers import PreTrainedModel

    from ..hf.deepspeed import fresh_module

    config = accelerator.state.deepspeed_plugin.deepspeed_config
    module = engine.module if callable(getattr(engine, "zero_optimization_stage", None)) else engine
    if not isinstance(module, PreTrainedModel) or "optimizer" not in config:
        what = "a PreTrainedModel" if isinstance(module, PreTrainedModel) else f"a {type(module).__name__}"
        return (
            "recovering_step with the DeepSpeed plugin redoes a failed step on a new engine, built from a fresh module "
            f"and optimizer; without rebuild= it makes them from a PreTrainedModel's config and the DeepSpeed config's "
            f'"optimizer", and here the model is {what} and the config {"names" if "optimizer" in config else "has no"} '
            "optimizer. Pass rebuild=lambda: (model, optimizer) (or (model, optimizer, scheduler)) that builds them as "
            "your loop does before accelerator.prepare"
        )
    with_scheduler = bool(accelerator._schedulers) and "scheduler" in config
    if accelerator._schedulers and not with_scheduler:
        return (
            "without rebuild= recovering_step cannot build your LR scheduler again (the DeepSpeed config has no "
            '"scheduler"): pass rebuild=lambda: (model, optimizer, scheduler)'
        )

    def build() -> Built:
        new = fresh_module(module)
        opt = DummyOptim(new.parameters())
        return (new, opt, DummyScheduler(opt)) if with_scheduler else (new, opt)

    return build


class AcceleratorDeepSpeedStep(Adapter):
    """:func:`~ncclguard.integrations.accelerate.recovering_step` for an Accelerator with the
    DeepSpeed plugin (see the module doc).

    Args:
        accelerator: the loop's ``Accelerator`` (``DistributedType.DEEPSPEED``).
        model: the ``DeepSpeedEngine`` ``accelerator.prepare`` returned.
        optimizer: the optimizer ``accelerator.prepare`` returned.
        rebuild: builds, on every rank, a fresh ``(module, optimizer)`` or ``(module, optimizer, scheduler)``
            as the loop built them before ``accelerator.prepare`` (the same architecture, the same kinds);
            its weights are overwritten and its random draws do not move the generators. Default: see
            :func:`_default_rebuild`.
        **recovery: the recovery keywords every adapter takes, as for
            :class:`~ncclguard.recovery.recovering.RecoveringStep`
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`). With ``heal=True`` a restarted
            process's constructor joins the survivors (its ``prepare`` ran on a stand-in world),
            builds its engine with them and takes its partitions from its buddy's snapshot; its loop
            starts at :attr:`resume_step` (``steps()`` does). ``allow_shrink=True`` is refused: ZeRO
            partitions do not fit a smaller world.

    Attributes:
        recovery: the recovery engine (its ``recoveries`` are the steps redone).
        resume_step: in a restarted process, the snapshot's step it was restored at; None elsewhere.
        healed: that restore's result, or None.

    Raises:
        TypeError: not an Accelerator, not the prepared engine, a ``rebuild`` that is not callable, an
            unknown recovery keyword or a value of the wrong type.
        ValueError: what cannot be recovered (:func:`deepspeed_plugin_refusal`, no builder), a bad recovery
            value (``pydantic.ValidationError``), said before any communication.
    """

    name = "recovering_step"

    def __init__(
        self,
        accelerator: Accelerator,
        model: Any,
        optimizer: Any,
        *,
        rebuild: Callable[[], Built] | None = None,
        **recovery: Unpack[RecoveryKeywords],
    ) -> None:
        if not isinstance(accelerator, Accelerator) or accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise TypeError("AcceleratorDeepSpeedStep needs an accelerate.Accelerator with the DeepSpeed plugin")
        options = recovery_options(**recovery)
        heal_refused = deepspeed_plugin_refusal(accelerator, options.allow_shrink, True)
        if (
            options.heal
            and heal_refused is not None
            and deepspeed_plugin_refusal(accelerator, options.allow_shrink) is None
        ):
            options = options.without_auto_heal(heal_refused)  # heal=True asked for: raises with why
        refused = deepspeed_plugin_refusal(accelerator, options.allow_shrink, options.heal)
        if refused is not None:
            raise ValueError(refused)
        prepared = callable(getattr(model, "zero_optimization_stage", None))
        if not prepared and not isinstance(model, torch.nn.Module):
            raise TypeError(
                "model must be the DeepSpeedEngine accelerator.prepare returned, or the torch.nn.Module to prepare, "
                f"got {type(model).__name__}"
            )
        if rebuild is not None and not callable(rebuild):
            raise TypeError(
                f"rebuild must build and return (model, optimizer[, scheduler]), got {type(rebuild).__name__}"
            )
        builder = rebuild if rebuild is not None else _default_rebuild(accelerator, model)
        if isinstance(builder, str):
            raise ValueError(builder)
        self.accelerator, self._build = accelerator, builder
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._step: Callable[[], Any] | None = None  # the engine's own step, held while a step is open
        self._open = False
        self._window: list[Micro] = []  # the micro-batches of the open window (gradient accumulation)
        self._window_tx: Transaction[Any] | None = None
        self.state: DeepSpeedState | None = None
        if prepared:
            self._adopt(model, optimizer, self._prepared_scheduler())  # refuses what DeepSpeedState cannot take
        elif not awaiting_join(options.heal):
            engine, prepared_optimizer = accelerator.prepare(model, optimizer)
            self._adopt(engine, prepared_optimizer, self._prepared_scheduler())
        # else: a restarted process, whose world is a stand-in of one until the join (ZeRO-3's zero.Init
        # refuses to partition on it): its engine is prepared once it joined (wrap_joined).
        self.recovery = Recovery(self, options)
        self.healed = self.recovery.join_if_restarted()
        self.resume_step: int | None = self.healed.step if self.healed is not None else None

    # ------------------------------------------------------------------------ the adapter's part

    def get_module(self) -> torch.nn.Module:
        """The engine's module."""
        return self.model.module

    def state_codec(self) -> StateCodec | None:
        """The current engine's own ZeRO state (:class:`DeepSpeedState`), kept in snapshots on a buddy rank."""
        return CurrentEngineState(self)

    def wrap_joined(self) -> None:
        """A restarted process, joined to the survivors' world: its engine built there, with theirs."""
        self._prepare_again()

    def rewrap(self, rebuilt: RebuildResult) -> None:
        """A new engine on the rebuilt world, given the old one's state (the last committed step's:
        ``engine.step()`` ran on no rank).

        Raises:
            ValueError: the new engine cannot take the old one's state (another shape, stage, world).
        """
        assert self.state is not None  # a step ran, so an engine was prepared
        state = self.state.capture()  # the live tensors, no collective: the old engine is dropped after
        self._prepare_again()
        self._current().apply(state)
        log.warning(
            "recovering_step: a new DeepSpeed engine in world generation %d holds the state of global step %d",
            rebuilt.generation,
            self.model.global_steps,
        )

    def log(self, record: Recovered) -> None:
        """Logs a recovered step with ``accelerator.log`` (keys ``ncclguard_recover_*``)."""
        self.accelerator.log(record.metrics(), step=record.step)

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """Accelerate's own state after a preemption stop: ``accelerator.save_state(directory/step-<N>)``
        (DeepSpeed's checkpoint of the engine inside), on every rank; ``accelerator.load_state`` resumes it."""
        path = directory / f"step-{step}"
        self.accelerator.save_state(str(path))
        return path

    # ------------------------------------------------------------------------ building engines

    def _prepared_scheduler(self) -> Any:
        from accelerate.utils.deepspeed import DeepSpeedSchedulerWrapper

        outside = [s for s in self.accelerator._schedulers if not isinstance(s, DeepSpeedSchedulerWrapper)]
        if outside:
            raise ValueError(
                f"recovering_step with the DeepSpeed plugin cannot carry a {type(outside[0].scheduler).__name__} that "
                "Accelerate steps outside the engine (its state is not part of the engine's, so a restore would "
                'lose it): give DeepSpeed the scheduler, in the config\'s "scheduler" section or with '
                "DummyScheduler(optimizer, lr_scheduler_callable=...)"
            )
        return self.accelerator._schedulers[-1] if self.accelerator._schedulers else None

    def _current(self) -> DeepSpeedState:
        assert self.state is not None  # set by _adopt
        return self.state

    def _adopt(self, engine: Any, optimizer: Any, scheduler: Any) -> None:
        """Takes the engine a ``prepare`` returned: its state's codec, its ``step`` held in a transaction."""
        self.state = DeepSpeedState(engine, step_per_micro_batch=False)
        self.model, self.optimizer, self.scheduler = engine, optimizer, scheduler
        original = engine.step
        self._step = original

        def step(*args: Any, **kwargs: Any) -> Any:
            if self._open:  # Accelerate's backward steps the engine: applied once every rank committed
                return None
            return original(*args, **kwargs)

        step.__doc__ = "DeepSpeedEngine.step, held until the step's commit (ncclguard)"
        engine.step = step

    def _prepare_again(self) -> None:
        """Drops the old engine (DeepSpeed's groups, the Accelerator's references) and prepares a new one
        on the current world from ``rebuild()``."""
        acc = self.accelerator
        old = (self.model, self.optimizer, self.scheduler)
        acc._models[:] = [m for m in acc._models if m is not old[0]]
        acc._optimizers[:] = [o for o in acc._optimizers if o is not old[1]]
        acc._schedulers[:] = [s for s in acc._schedulers if s is not old[2]]
        acc.deepspeed_engine_wrapped = None
        release_deepspeed_groups()
        number_parameters_afresh()
        rank, size = dist.get_rank(), dist.get_world_size()
        follow_world(rank, size)
        config = acc.state.deepspeed_plugin.deepspeed_config
        micro = config.get("train_micro_batch_size_per_gpu")
        if isinstance(micro, int) and "train_batch_size" in config:  # a stand-in's prepare said a world of one
            config["train_batch_size"] = micro * int(config.get("gradient_accumulation_steps", 1)) * size
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # the redo draws what the failed attempt drew
            built = self._build()
            if not isinstance(built, tuple) or len(built) not in (2, 3):
                raise TypeError(
                    f"rebuild must return (model, optimizer) or (model, optimizer, scheduler), got {type(built).__name__}"
                )
            prepared = acc.prepare(*built)
        self._adopt(prepared[0], prepared[1], prepared[2] if len(prepared) == 3 else None)

    # ------------------------------------------------------------------------ the user's part

    @property
    def recoveries(self) -> list[Recovered]:
        """The steps redone on a rebuilt world, oldest first."""
        return self.recovery.recoveries

    def steps(self, stop: int, start: int = 0) -> Iterator[int]:
        """Your loop's step numbers, from ``start`` (a restarted process: from the step it was restored
        at) to ``stop``, going back when a restore brought every rank back to an older step."""
        return self.recovery.steps(stop, start)

    def __call__(self, step_fn: Callable[..., Any], *inputs: Any, step: int | None = None) -> StepResult[Any]:
        """Runs ``step_fn(engine, *inputs)`` (forward and ``accelerator.backward``), commits on every rank,
        and steps the engine; on a failed commit, a new engine on a rebuilt world and the step again.
        With gradient accumulation, one micro-batch: see :meth:`_micro_batch`.

        Args:
            step_fn: forward and backward on the engine it is given; called again with the same inputs
                to redo the step (on a new engine).
            *inputs: what ``step_fn`` is given after the engine (the batch).
            step: your loop's step number, checked on every rank by the commit (with accumulation: the
                window's first micro-batch's).

        Returns:
            A :class:`~ncclguard.recovery.records.StepResult`: truthy when the step was applied on every
            rank; falsy with ``rewound_to`` when every rank went back to a snapshot (``steps()`` follows);
            with accumulation, before the window's last micro-batch, truthy with ``pending=True``.

        Raises:
            TypeError: ``step_fn`` is not callable.
            ValueError: with accumulation, a recorded micro-batch's ``step_fn`` reads a variable that changed
                since it ran (its redo would compute another micro-batch).
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable (forward and backward), got {type(step_fn).__name__}")
        if self.accelerator.gradient_accumulation_steps != 1:
            return self._micro_batch(step_fn, inputs, step)
        tx = self.recovery.begin(step)
        return self._settle(tx, lambda: step_fn(self.model, *inputs), lambda: step_fn(self.model, *inputs))

    def _settle(self, tx: Transaction[Any], run: Callable[[], Any], redo: Callable[[], Any]) -> StepResult[Any]:
        """The attempt (``run``, None: already run), the commit and the redo with the engine's ``step``
        held; the step applied once every rank committed."""
        self._open = True
        try:
            tx.run(run)
            res = tx.settle(redo)
        finally:
            self._open = False
            tx.close()
        if res:
            assert self._step is not None  # set by _adopt
            self._step()
        return res

    def _micro_batch(self, step_fn: Callable[..., Any], inputs: tuple[Any, ...], step: int | None) -> StepResult[Any]:
        """One micro-batch inside ``accelerator.accumulate`` (Accelerate decides ``sync_gradients``; the
        engine steps on the window's last). The window's first opens the transaction, each is recorded,
        the last commits; a failed window runs again whole on the new engine, each micro-batch with the
        ``sync_gradients`` it had (as the DDP stepper does: :func:`~ncclguard.toolkit.replay_window`)."""
        acc = self.accelerator
        with acc.accumulate(self.model):
            sync = bool(acc.sync_gradients)
            if self._window_tx is None:
                self._window_tx, self._window = self.recovery.begin(step), []
            tx = self._window_tx
            grad_sync = not getattr(self.model, "inside_no_sync_ctxt", False)  # ZeRO-1's no_sync
            self._window.append(Micro.record(step_fn, inputs, sync_gradients=sync, grad_sync=grad_sync))
            self._open = True
            try:
                tx.run(lambda: step_fn(self.model, *inputs))
            finally:
                self._open = False
        if not sync:
            return StepResult(True, 1, generation(), output=tx.output, pending=True)
        self._window_tx, window = None, self._window
        try:
            check_window(window)
        except ValueError:
            tx.close()
            raise
        finally:
            self._window = []
        return self._settle(tx, lambda: tx.output, lambda: replay_on(acc, window, lambda: self.model))
