"""CommittedEngineStep: the recovery engine's adapter for DeepSpeed. Every rank agrees on each step;
a failed one is redone in process on a new engine when you pass ``rebuild_engine`` (no disk), and
otherwise ends in a checkpoint and exit status 75, so that the launcher restarts the job from it.

Why the engine is built anew rather than re-pointed: a DeepSpeed engine keeps the groups
of the world it was built in, and its ZeRO optimizer keeps state laid out for them. Read in the
installed DeepSpeed (0.19.8; docs/recovery.md "### DeepSpeed" cites the lines): the engine takes
its data-parallel group once (``runtime/engine.py``, ``self.data_parallel_group =
groups._get_data_parallel_group()``), a module-level clone of the world group
(``utils/groups.py``, ``_clone_world_group``, cached in ``_WORLD_GROUP``); the ZeRO 1/2 optimizer
stores that group per parameter group with the partition count (``runtime/zero/stage_1_and_2.py``,
``dp_process_group``, ``real_dp_process_group``, ``partition_count``) and the buckets of a backward
in flight (``ipg_buckets``, ``params_already_reduced``, ``averaged_gradients``). Re-pointing all
of that after a rebuild means writing a dozen private attributes of one DeepSpeed version and
resetting a half-reduced backward by hand; nothing checks it, so it is not done.

The redo in process (``rebuild_engine``): a failed commit means ``optimizer.step()`` ran on no
rank, so the old engine still holds the state of the last committed step. After the rebuild each
rank takes it from the old engine (:class:`~ncclguard.integrations.deepspeed.state.DeepSpeedState`,
no collective), drops DeepSpeed's cached clone of the old world group (``deepspeed.utils.groups``,
``_release_process_group_references``: ``rebuild_world`` destroyed the groups with torch's call, which
leaves DeepSpeed's cache in place), builds a new engine with ``rebuild_engine()`` (a new module of the
same architecture: a ZeRO-3 module already converted keeps the old group in every parameter's
``ds_process_group``), puts the state in, and redoes the step. Measured in
benchmarks/investigations/deepspeed_rebuild_in_process.py; docs/integrations.md has the figures.

What is safe: ``engine.save_checkpoint`` runs its collectives (two barriers and, with tag
validation, two all_reduces) through ``deepspeed.comm`` with no group, that is on torch's default
group (``comm/torch.py``, ``barrier``), and ZeRO 1/2's ``state_dict`` runs none. So after a failed
commit every rank rebuilds the world (all ranks alive; the new default group), saves a checkpoint
of the step before the failed one (``optimizer.step()`` ran on no rank), and exits 75. When a rank
does not come to the rebuild, no complete checkpoint can be written (its ZeRO partition is in that
process): the ranks exit 75 without one and the launcher restarts from the last checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Unpack

import torch

from ncclguard.errors import HealFailed, RebuildFailed
from ncclguard.exits import exit_now
from ncclguard.recovery.commit import CommitResult
from ncclguard.recovery.engine import Adapter, Recovery
from ncclguard.recovery.heal import HealResult
from ncclguard.recovery.options import RecoveryKeywords, RecoveryOptions, recovery_options
from ncclguard.recovery.rebuild import RebuildResult
from ncclguard.recovery.snapshots.restore import Restored
from ncclguard.recovery.snapshots.state import StateCodec
from ncclguard.toolkit import awaiting_join, default_group, log

from .state import CurrentEngineState, DeepSpeedState

__all__ = ["EX_TEMPFAIL", "CommittedEngineStep", "EngineStepResult", "release_deepspeed_groups"]

EX_TEMPFAIL = 75  # sysexits.h: a temporary failure; launchers restart on a non-zero status
CHECKED_BY = "DeepSpeed's ZeRO"  # who reduces the gradients the numerical check sees (docs/numerics.md)


@dataclass
class EngineStepResult:
    """A step that committed on every rank and was applied (``engine.step()`` ran).

    Attributes:
        output: what ``step_fn`` returned.
        commit: the step's commit.
        rewound_to: with ``heal``, the snapshot's step every rank went back to (the step was not
            applied; the result is falsy): go on from there (``stepper.steps()`` does).
        timings: with ``rewound_to``, where the failed step's seconds went (the engine's
            ``StepResult.timings``: attempt, commit, rebuild, rewrap, heal).
        restored: this rank's part in a restore from snapshots during the step (its bytes and
            timings; the redo's seconds are in ``stepper.recovery.recoveries``), or None.
        skipped: the step held a NaN or an infinity and ``on_nonfinite="skip"`` dropped its batch
            on every rank (not applied, the result is falsy): go on with the next batch.
    """

    output: Any
    commit: CommitResult
    rewound_to: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    restored: Restored | None = None
    skipped: bool = False

    def __bool__(self) -> bool:
        return self.rewound_to is None and not self.skipped


def _engine_options(recovery: RecoveryKeywords, redo: bool) -> RecoveryOptions:
    """The engine's options for :class:`CommittedEngineStep`, whose attempts depend on ``rebuild_engine``.

    Args:
        recovery: the recovery keywords it was given.
        redo: whether a failed step is redone in process (``rebuild_engine`` given).

    Returns:
        The options: without a redo one attempt (the failed step ends in a checkpoint, see the
        module doc); with one ``max_attempts``, 2 when left out.

    Raises:
        TypeError, ValueError: a bad recovery keyword; ``max_attempts`` under 2 with a redo;
            ``allow_shrink=True``.
    """
    attempts = recovery.get("max_attempts", 2)
    if redo and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 2):
        raise ValueError(f"max_attempts must be an int of at least 2 with rebuild_engine (a redo), got {attempts!r}")
    keywords = recovery.copy()
    keywords["max_attempts"] = attempts if redo else 1
    options = recovery_options(**keywords)
    if options.allow_shrink:
        raise ValueError(
            "allow_shrink=True cannot go on with DeepSpeed ZeRO: each rank's partitions are laid out for the world "
            "size they were made in, and a smaller world cannot take them. Leave allow_shrink off (a lost rank is "
            "restarted and healed with heal=True and rebuild_engine under ncclguard run --ncclguard-restarts)"
        )
    return options


class CommittedEngineStep(Adapter):
    """Runs DeepSpeed steps that every rank commits before ``engine.step()``; on a failed commit:
    with ``rebuild_engine``, rebuild the world and redo the step in process on a new engine (no
    disk); without it, or when that fails, rebuild, ``engine.save_checkpoint(checkpoint_dir)``, exit 75.

    ``stepper = CommittedEngineStep(engine, checkpoint_dir="/ckpt", rebuild_engine=make_engine)``, then
    per step ``stepper(lambda e: e.backward(e(**batch).loss), step=step)``: ``step_fn`` gets the engine
    to use, and after a recovery that is a new one (``stepper.engine``). On a restart from disk, load
    the checkpoint with ``engine.load_checkpoint(checkpoint_dir)`` and go on from ``engine.global_steps``.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine``, with ``gradient_accumulation_steps() == 1``.
        checkpoint_dir: where the checkpoint of a failed step goes (yours; nothing else is written).
        exit_code: the status to exit with (75, EX_TEMPFAIL).
        rebuild_engine: builds a new engine on the current world, as you built the first (a new
            module of the same architecture, ``deepspeed.initialize`` with the same config; ZeRO 1,
            2 or 3); it is called on every rank after a rebuild, and its random draws do not move
            the step's generators. None: no redo in process.
        **recovery: the recovery keywords every adapter takes
            (:class:`~ncclguard.recovery.options.RecoveryKeywords`; docs/recovery.md, "The
            settings"). Here: ``collective_timeout`` bounds ZeRO's gradient reduction on
            DeepSpeed's clone of the world group; ``rebuild_timeout`` also bounds the rebuild
            before the save; ``max_attempts`` counts with ``rebuild_engine`` only (default 2, at
            least 2; without it a step runs once); ``heal`` (needs ``rebuild_engine``) gives a
            killed, restarted rank its partitions from its buddy's in-memory snapshot (every
            ``snapshot_every`` steps), each snapshot swap and restore bounded by ``heal_timeout``;
            ``preempt_dir`` receives ``engine.save_checkpoint(preempt_dir)`` on SIGTERM, after the
            step every rank agreed to stop at (resume: ``engine.load_checkpoint(preempt_dir)``);
            ``allow_shrink=True`` is refused (ZeRO partitions do not fit a smaller world);
            ``on_nonfinite`` checks each parameter's gradient before ZeRO reduces it (off under
            ``"auto"``), and its ``"redo"`` and ``"skip"`` need ``rebuild_engine`` (a new engine holds
            the last applied step's state without the refused gradients; docs/numerics.md).

    Raises:
        TypeError, ValueError: not an engine, gradient accumulation, a bad directory, recovery keyword
            or ``rebuild_engine``, ``allow_shrink=True``, ``on_nonfinite="redo"`` or ``"skip"`` without
            ``rebuild_engine``, or an engine whose state ``DeepSpeedState`` cannot take.
    """

    name = "CommittedEngineStep"

    def __init__(
        self,
        engine: Any,
        *,
        checkpoint_dir: str | os.PathLike[str],
        exit_code: int = EX_TEMPFAIL,
        rebuild_engine: Callable[[], Any] | None = None,
        **recovery: Unpack[RecoveryKeywords],
    ) -> None:
        options = _engine_options(recovery, rebuild_engine is not None)
        if options.on_nonfinite in ("redo", "skip") and rebuild_engine is None:
            raise ValueError(
                f"on_nonfinite={options.on_nonfinite!r} needs rebuild_engine: ZeRO keeps a refused step's gradients in its "
                "own partitions, and only a new engine given the last applied step's state is rid of them. Pass "
                "rebuild_engine, or on_nonfinite='raise' (the step is not applied; end the process after it)"
            )
        if rebuild_engine is None:  # heal=True asked for raises; heal by default is turned off
            options = options.without_auto_heal(
                "heal=True needs rebuild_engine: a restarted rank and the survivors build a new engine on the "
                "joined world, and the restarted rank's partitions come from its buddy's snapshot"
            )
        heal = options.heal
        self._joining = engine is None and awaiting_join(heal)
        if self._joining:  # a restarted process builds its engine once it has joined the survivors' world
            engine = _Pending()
        for name in ("backward", "step", "save_checkpoint", "gradient_accumulation_steps"):
            if not callable(getattr(engine, name, None)):
                raise TypeError(
                    f"CommittedEngineStep needs a DeepSpeed engine (no {name}()), got {type(engine).__name__}"
                )
        gas = engine.gradient_accumulation_steps()
        if gas != 1:
            raise ValueError(
                f"CommittedEngineStep needs gradient_accumulation_steps=1, got {gas}: engine.step() applies only at the "
                "window's end, and a checkpoint in the middle of a window would resume it misaligned. Raise "
                "train_micro_batch_size_per_gpu instead"
            )
        if not isinstance(checkpoint_dir, str | os.PathLike) or not str(checkpoint_dir):
            raise ValueError(f"checkpoint_dir must be a directory path, got {checkpoint_dir!r}")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be an int from 1 to 255 (a restart needs a failure), got {exit_code!r}")
        if rebuild_engine is not None and not callable(rebuild_engine):
            raise TypeError(f"rebuild_engine must build and return a new engine, got {type(rebuild_engine).__name__}")
        self.engine, self.checkpoint_dir, self.exit_code = engine, Path(checkpoint_dir), exit_code
        self.rebuild_engine, self._heal = rebuild_engine, heal
        # Made now, on the live world: it refuses, before any step, an engine whose state it cannot take.
        self.state = None if rebuild_engine is None or self._joining else DeepSpeedState(engine)
        self.recovery = Recovery(self, options)
        if not self._joining:  # a restarted process puts it on the engine it builds on the joined world
            self.recovery.numerics.install_params(engine.module, CHECKED_BY)
        try:
            joined = self.recovery.join_if_restarted()
        except HealFailed as exc:  # refused or failed: this process holds nothing of the run's state
            self._exit_unrestored(exc)
        # A restarted process: how it was restored (its bytes and timings), and where it goes on.
        self.healed: HealResult | Restored | None = joined
        self.resume_step: int | None = joined.step if joined is not None else None

    def state_codec(self) -> StateCodec | None:
        """With ``heal``: the current engine's own ZeRO state (:class:`DeepSpeedState`), which the
        engine keeps in snapshots replicated on a buddy rank."""
        return CurrentEngineState(self) if self.recovery_heal else None

    @property
    def recovery_heal(self) -> bool:
        """Whether a killed rank is restored from its buddy's snapshot (``heal=True``)."""
        return self.rebuild_engine is not None and self._heal

    def wrap_joined(self) -> None:
        """A restarted process, joined to the survivors' world: builds its engine there (with the
        survivors, who build theirs in :meth:`rewrap`: ``deepspeed.initialize`` broadcasts)."""
        assert self.rebuild_engine is not None
        release_deepspeed_groups()
        number_parameters_afresh()
        self.engine = self.rebuild_engine()
        self.state = DeepSpeedState(self.engine)
        self.recovery.numerics.install_params(self.engine.module, CHECKED_BY)

    def steps(self, stop: int, start: int = 0) -> Iterator[int]:
        """Your loop's step numbers, from ``start`` (a restarted process: from the step it was
        restored at) to ``stop``, going back when a restore brought every rank back to an older
        step (:meth:`~ncclguard.recovery.engine.Recovery.steps`)."""
        return self.recovery.steps(stop, start)

    def get_module(self) -> torch.nn.Module:
        """The engine's module."""
        return self.engine.module

    def rewrap(self, rebuilt: RebuildResult) -> None:
        """With ``rebuild_engine``: a new engine on the rebuilt world, given the old one's state (the
        last committed step's: ``optimizer.step()`` ran on no rank). Without: nothing (no redo).

        Raises:
            ValueError: the new engine cannot take the old one's state (another shape, stage, world).
        """
        if self.rebuild_engine is None or self.state is None:
            return
        new = self._renew()
        log.warning(
            "CommittedEngineStep: a new engine in world generation %d holds the state of global step %d",
            rebuilt.generation,
            new.global_steps,
        )

    def discard_gradients(self, redo: bool) -> None:
        """After a step whose gradients every rank refused (a NaN or an Inf): with ``rebuild_engine``,
        a new engine on this world holds the old one's state (the last applied step's:
        ``engine.step()`` did not run), and none of the refused gradients ZeRO keeps in its
        partitions and buckets. Without it the engine keeps them; only ``on_nonfinite="raise"`` is
        taken then (see :meth:`__init__`)."""
        if self.rebuild_engine is None or self.state is None:
            log.warning(
                "CommittedEngineStep: the engine still holds the refused step's gradients (no rebuild_engine to "
                "build a clean one); do not step it again"
            )
            return
        new = self._renew()
        log.warning(
            "CommittedEngineStep: a new engine holds the state of global step %d, without the refused gradients",
            new.global_steps,
        )

    def _renew(self) -> Any:
        """A new engine from ``rebuild_engine`` on the current world, given the current one's state,
        its gradients checked as the old one's were; it becomes :attr:`engine`."""
        assert self.rebuild_engine is not None and self.state is not None
        state = self.state.capture()  # the live tensors, no collective: the old engine is dropped after
        release_deepspeed_groups()
        number_parameters_afresh()
        # The redo must draw the random numbers the failed attempt drew: the new module's
        # initialisation draws from the same generators, so they are put back after it.
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            new = self.rebuild_engine()
        self.state = DeepSpeedState(new)
        self.state.apply(state)
        self.engine = new
        self.recovery.numerics.install_params(new.module, CHECKED_BY)
        return new

    def save_checkpoint(self, directory: Path, step: int) -> Path:
        """DeepSpeed's own checkpoint after a preemption stop: ``engine.save_checkpoint(directory)``
        with the tag ``global_step<N>`` (and its ``latest`` file), on every rank.

        Returns:
            The tag's directory (``engine.load_checkpoint(directory)`` loads it).
        """
        tag = f"global_step{self.engine.global_steps}"
        self.engine.save_checkpoint(str(directory), tag=tag)
        return directory / tag

    def __call__(self, step_fn: Callable[[Any], Any], *, step: int | None = None) -> EngineStepResult:
        """Runs ``step_fn(engine)`` (forward and ``engine.backward``), commits, and steps the engine.

        Args:
            step_fn: forward and backward on the engine it is given; it must not call ``engine.step()``.
            step: your loop's step number, checked on every rank by :func:`~ncclguard.should_commit`.

        Returns:
            An :class:`EngineStepResult` when the step was applied on every rank.

        Raises:
            TypeError: ``step_fn`` is not callable.
        After a failed commit (and the checkpoint, when one could be written) the process ends
        with ``exit_code`` through ``os._exit``, not ``SystemExit``: at interpreter shutdown a gloo
        group that timed out aborts the process (measured: status -6, "terminate called without
        an active exception"), and the launcher must see the status.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable (forward and backward), got {type(step_fn).__name__}")
        tx = self.recovery.begin(step)
        tx.run(lambda: step_fn(self.engine))
        res = tx.settle(None if self.rebuild_engine is None else lambda: step_fn(self.engine))
        restored = res.healed if isinstance(res.healed, Restored) else None
        if res:
            self.engine.step()
            return EngineStepResult(res.output, res.commits[-1], restored=restored)
        if res.skipped:  # a non-finite gradient, on_nonfinite="skip": the batch is dropped on every rank
            return EngineStepResult(None, res.commits[-1], skipped=True)
        if res.rewound_to is not None:  # every rank went back to a snapshot: the loop goes back too (steps())
            return EngineStepResult(None, res.commits[-1], res.rewound_to, res.timings, restored)
        if isinstance(res.error, HealFailed):  # every snapshot refused: a restarted rank holds fresh partitions
            self._exit_unrestored(res.error)
        if isinstance(res.error, RebuildFailed):  # a rank is missing: no complete checkpoint can be written
            log.error(
                "CommittedEngineStep: %s. Exiting %d; the launcher restarts from your last checkpoint",
                res.error,
                self.exit_code,
            )
            exit_now(self.exit_code)  # no interpreter shutdown: see the doc above
        self.checkpoint_and_exit(res.commits[-1], tx.number)

    def _exit_unrestored(self, error: HealFailed) -> NoReturn:
        """Ends the process with ``exit_code`` and writes no checkpoint: a restarted rank that was not
        restored holds its fresh engine's partitions, and a checkpoint of this world would save them
        as the run's (and point DeepSpeed's ``latest`` at it). The launcher's restart goes to the last
        whole checkpoint on disk, which is named."""
        last = last_checkpoint(self.checkpoint_dir)
        log.error(
            "CommittedEngineStep: the restarted rank(s) could not be restored (%s). No checkpoint is written: "
            "their fresh partitions would be saved as the run's. Exiting %d; the launcher restarts from %s",
            error,
            self.exit_code,
            f"your last checkpoint on disk, {last} (engine.load_checkpoint({str(self.checkpoint_dir)!r}))"
            if last is not None
            else f"the start: {self.checkpoint_dir} holds no DeepSpeed checkpoint ('latest' names none)",
        )
        exit_now(self.exit_code)  # no interpreter shutdown: see __call__

    def checkpoint_and_exit(self, res: CommitResult, step: int) -> NoReturn:
        """Rebuilds the world (the engine's rebuild and left-out policy), saves the engine's
        checkpoint in it and ends the process with ``exit_code`` (``os._exit``, after flushing the logs).

        Args:
            res: the failed commit (its reasons are logged).
            step: the step that failed.
        """
        log.error("CommittedEngineStep: the step failed on ranks %s: %s", res.failed_ranks, res.error)
        rebuilt = self.recovery.rebuild(step)
        if not rebuilt:
            log.error(
                "CommittedEngineStep: no checkpoint: %s. Exiting %d; the launcher restarts from your last checkpoint",
                rebuilt.error,
                self.exit_code,
            )
            exit_now(self.exit_code)  # no interpreter shutdown: see __call__
        tag = f"global_step{self.engine.global_steps}"
        optimizer: Any = getattr(self.engine, "optimizer", None)
        old_group = getattr(optimizer, "dp_process_group", None)
        try:
            # Its collectives run on the rebuilt default group (see the module doc). The save also
            # reads the ZeRO group's size (engine.py, _create_zero_checkpoint_files), which torch
            # refuses for a destroyed group: for the save only, the new world group (same size:
            # no shrink) stands in.
            if old_group is not None:
                optimizer.dp_process_group = default_group()
            self.engine.save_checkpoint(str(self.checkpoint_dir), tag=tag)
        except Exception:  # noqa: BLE001 - the exit below is the point; the error is logged
            log.exception("CommittedEngineStep: engine.save_checkpoint(%s) failed", self.checkpoint_dir)
            exit_now(self.exit_code)  # no interpreter shutdown: see __call__
        finally:
            if old_group is not None:
                optimizer.dp_process_group = old_group
        log.error(
            "CommittedEngineStep: checkpoint %s saved in %s (before the failed step); exiting %d so that the "
            "launcher restarts from it (engine.load_checkpoint)",
            tag,
            self.checkpoint_dir,
            self.exit_code,
        )
        exit_now(self.exit_code)  # no interpreter shutdown: see __call__


class _Pending:
    """The engine of a restarted process before it joins: built by ``rebuild_engine`` at the join."""

    def __getattr__(self, name: str) -> Any:
        if name in ("backward", "step", "save_checkpoint"):
            return lambda *a, **k: None
        if name == "gradient_accumulation_steps":
            return lambda: 1
        raise AttributeError(f"the engine is built when this restarted process joins ({name})")


def last_checkpoint(directory: Path) -> Path | None:
    """The checkpoint ``engine.load_checkpoint(directory)`` would load: the tag DeepSpeed's ``latest``
    file names, where that tag's directory exists; None otherwise."""
    try:
        tag = (directory / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    found = directory / tag
    return found if tag and "/" not in tag and found.is_dir() else None


def number_parameters_afresh() -> None:
    """Restarts ZeRO-3's numbering of parameters and modules before an engine is built on a new world.

    ZeRO-3 numbers the parameters it converts and the modules it registers with process-wide
    counters (DeepSpeed 0.19: ``partition_parameters.Init.param_id``, and the mutable default
    ``count`` of ``DeepSpeedZeRoOffload._register_deepspeed_module``), then checks on its first
    forward that every rank fetched the same numbers (``assert_ints_same_as_other_ranks``). A
    restarted process counts from 0 while the survivors' counts went on over the engines they built:
    every rank starts both at 0 again, so the new engines number alike.
    """
    try:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        from deepspeed.runtime.zero.partition_parameters import Init
    except ImportError:  # pragma: no cover - a DeepSpeed without ZeRO-3 numbers nothing
        return
    Init.param_id = 0
    defaults = getattr(DeepSpeedZeRoOffload._register_deepspeed_module, "__defaults__", None)
    if defaults and isinstance(defaults[0], list) and defaults[0]:
        defaults[0][0] = 0
    else:
        log.warning("CommittedEngineStep: this DeepSpeed numbers its modules elsewhere; a restarted rank may disagree")


def release_deepspeed_groups() -> None:
    """Drops DeepSpeed's cached groups of the old world (its clone of the world group above all), so
    that ``deepspeed.initialize`` on the rebuilt world makes them anew. ``rebuild_world`` destroys the
    groups with torch's call; DeepSpeed's own ``deepspeed.comm.destroy_process_group`` would release them
    with ``deepspeed.utils.groups._release_process_group_references`` (0.19), called here.

    Raises:
        RuntimeError: this DeepSpeed has neither that function nor the ``_WORLD_GROUP`` cache.
    """
    from deepspeed.utils import groups  # only with a DeepSpeed engine at hand

    release = getattr(groups, "_release_process_group_references", None)
    if callable(release):
        release(None)
    elif hasattr(groups, "_WORLD_GROUP"):  # older DeepSpeed: the world clone is the cache that matters
        groups._WORLD_GROUP = None
    else:
        raise RuntimeError(
            "CommittedEngineStep: this DeepSpeed keeps its groups where ncclguard does not know to release "
            "them; pass no rebuild_engine (a failed step then ends in a checkpoint)"
        )
