"""RecoveringStep: a training step that every rank commits together, redone on a rebuilt world when
it fails.

For a plain DDP loop::

    stepper = ncclguard.RecoveringStep(module, optimizer)     # wraps module in DDP
    for step, batch in enumerate(loader):
        result = stepper(lambda model: loss_fn(model(batch)).backward(), step=step)
        if result.left_out:      # this rank came too late: the others went on without it
            sys.exit(0)

Each call: the module's buffers and the RNG state are kept; the gradients are cleared; ``step_fn``
runs forward and backward on the wrapped model (an exception in it is this rank's failure, not
raised); :func:`~ncclguard.recovery.commit.should_commit` settles the verdict on every rank. When it
is ok the optimizer steps. When it is not, nothing was applied anywhere (the parameters and the
optimizer's state are those from before the step, since ``optimizer.step()`` never ran), so the
ranks rebuild the world (:func:`~ncclguard.recovery.rebuild.rebuild_world`), wrap the module again
on the new group, put the buffers and the RNG state back, and redo the step.

With ``heal=True`` a rank that died and was restarted alone by its launcher comes back: in the
restarted process (``NCCLGUARD_RESTART_COUNT`` above 0, no process group yet) the constructor
joins the survivors' next rebuild (:func:`~ncclguard.recovery.rejoin.rejoin_world`) and receives
the module's and the optimizer's state from the lowest-numbered survivor
(:func:`~ncclguard.recovery.heal.heal_from_peer`); the survivors send it right after their
rebuild, before they redo the step. ``stepper.resume_step`` tells the restarted process which
step to run first::

    if ncclguard.restart_count() == 0:
        dist.init_process_group("gloo")          # a restarted process must not: it rejoins
    stepper = ncclguard.RecoveringStep(module, optimizer, heal=True)
    for step in range(stepper.resume_step or 0, steps):
        stepper(lambda model: loss_fn(model(batch(step))).backward(), step=step)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.deadlines import to_seconds
from ncclguard.errors import CommitFailed, NcclGuardError, RebuildFailed
from ncclguard.recording.steps import mark_step
from ncclguard.recovery.commit import CommitResult, should_commit
from ncclguard.recovery.fsdp2 import FSDP2
from ncclguard.recovery.heal import DEFAULT_CHUNK_BYTES, HealResult, heal_from_peer
from ncclguard.recovery.rebuild import generation, rebuild_world
from ncclguard.recovery.rejoin import rejoin_world, restart_count
from ncclguard.recovery.step_state import StepState

__all__ = ["RecoveringStep", "StepResult"]


@dataclass
class StepResult:
    """One step as :class:`RecoveringStep` ran it on this rank; truthy when it was applied.

    Attributes:
        ok: the step committed on every rank and the optimizer stepped.
        attempts: times the step ran (1 without a failure).
        generation: the world generation it ended in.
        rebuilds: rebuilds it took.
        output: what ``step_fn`` returned in the last attempt (None if it raised).
        commits: every attempt's commit.
        left_out: this rank is in no world now (the others rebuilt without it); it should exit.
        elapsed_s: seconds from entry to return.
        error: why the step was not applied (:class:`~ncclguard.errors.CommitFailed` after the
            last attempt, :class:`~ncclguard.errors.RebuildFailed` when no world could be rebuilt,
            :class:`~ncclguard.errors.HealFailed` when restarted ranks joined and were not healed).
        healed: with ``heal=True``, this rank's part in healing the restarted ranks that joined at
            this step's rebuild (None when none joined).
    """

    ok: bool
    attempts: int
    generation: int
    rebuilds: int = 0
    output: Any = None
    commits: list[CommitResult] = field(default_factory=list)
    left_out: bool = False
    elapsed_s: float = 0.0
    error: NcclGuardError | None = None
    healed: HealResult | None = None

    def __bool__(self) -> bool:
        return self.ok

    def raise_for_error(self) -> StepResult:
        """Raises :attr:`error` if the step was not applied; returns self otherwise (for chaining)."""
        if self.error is not None:
            raise self.error
        return self


class RecoveringStep:
    """Runs training steps that commit on every rank, and recovers a failed one in process.

    Args:
        module: the model, unwrapped (it is wrapped again after each rebuild).
        optimizer: its optimizer (stepped only after a commit that is ok).
        wrap: builds the wrapped model on the current default group; default
            ``DistributedDataParallel(module)`` (the module itself without a process group).
            A wrap that calls :func:`~ncclguard.record_ddp` puts DDP's all-reduces in the flight
            recorder; a step redone with a comm hook can then differ from the fault-free run in
            the last bit (see docs/recovery.md). For
            FSDP2, :class:`~ncclguard.recovery.fsdp2.FSDP2` (it shards the module, and after a
            rebuild shards it again from the shards each rank holds).
        commit_timeout: seconds (or a timedelta) each commit waits for the other ranks; default
            :func:`should_commit`'s.
        rebuild_timeout: seconds (or a timedelta) each rebuild waits for them.
        allow_shrink: rebuild without the ranks that did not come (the same on every rank).
        max_attempts: times a step runs at most before its result is falsy.
        heal: in a restarted process, rejoin and receive the state (see the module's
            docstring); on a live rank, send it to the restarted ranks a rebuild admits. Pass
            the same on every rank.
        heal_timeout: seconds (or a timedelta) for one state transfer.
        heal_chunk_bytes: bytes per broadcast of a state transfer, at most.

    Attributes:
        resume_step: in a restarted process, the step the others redo (their ``step=``, or the
            count of steps they had applied when they pass none): run it first. None elsewhere.
        healed: the restarted process's :class:`~ncclguard.recovery.heal.HealResult`, or None.

    Raises:
        TypeError, ValueError: bad arguments.
        RebuildFailed: a restarted process found no rebuild to join within ``rebuild_timeout``.
        HealFailed: a restarted process did not get the state.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | FSDP2 | None = None,
        commit_timeout: float | timedelta | None = None,
        rebuild_timeout: float | timedelta = 60.0,
        allow_shrink: bool = False,
        max_attempts: int = 3,
        heal: bool = False,
        heal_timeout: float | timedelta = 60.0,
        heal_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"RecoveringStep needs the torch.nn.Module to train, got {type(module).__name__}")
        if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
            raise TypeError(f"RecoveringStep needs an optimizer (step, zero_grad), got {type(optimizer).__name__}")
        if wrap is not None and not (callable(wrap) or isinstance(wrap, FSDP2)):
            raise TypeError(f"wrap must build the wrapped model from the module, got {type(wrap).__name__}")
        if not isinstance(allow_shrink, bool):
            raise TypeError(f"allow_shrink must be a bool, got {allow_shrink!r}")
        if allow_shrink and isinstance(wrap, FSDP2):
            raise ValueError(
                "allow_shrink=True cannot go with FSDP2: a rank left out takes its shards with it (FSDP2 keeps "
                "no replica); use allow_shrink=False, or DDP"
            )
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int of at least 1, got {max_attempts!r}")
        if commit_timeout is not None:
            to_seconds(commit_timeout, "commit_timeout")
        if not isinstance(heal, bool):
            raise TypeError(f"heal must be a bool, got {heal!r}")
        if heal and isinstance(wrap, FSDP2):
            raise ValueError("heal=True is for DDP: FSDP2's shards are not sent to a restarted rank; use heal=False")
        if isinstance(heal_chunk_bytes, bool) or not isinstance(heal_chunk_bytes, int) or heal_chunk_bytes < 1:
            raise ValueError(f"heal_chunk_bytes must be a positive int, got {heal_chunk_bytes!r}")
        self._rebuild_s = to_seconds(rebuild_timeout, "rebuild_timeout")
        self._heal_s = to_seconds(heal_timeout, "heal_timeout")
        self.module, self.optimizer = module, optimizer
        self._wrap, self._commit_timeout = wrap, commit_timeout
        self.allow_shrink, self.max_attempts, self.heal = allow_shrink, max_attempts, heal
        self._chunk = heal_chunk_bytes
        self.resume_step: int | None = None
        self.healed: HealResult | None = None
        self._applied = 0  # steps applied: what a heal sends as the step to run when step= is never passed
        self._redo_next = False  # the first step of a restarted process is the others' redo
        if heal and restart_count() > 0 and not (dist.is_available() and dist.is_initialized()):
            rejoin_world(timeout=self._rebuild_s).raise_for_error()
            self.healed = heal_from_peer(
                module, optimizer, timeout=self._heal_s, chunk_bytes=heal_chunk_bytes
            ).raise_for_error()
            self.resume_step, self._redo_next = self.healed.step, True
            self._applied = self.healed.step or 0
        self._model: torch.nn.Module | None = self._wrapped()

    def _wrapped(self) -> torch.nn.Module:
        if isinstance(self._wrap, FSDP2):
            return self._wrap.first(self.module, self.optimizer)
        if self._wrap is not None:
            return self._wrap(self.module)
        if not (dist.is_available() and dist.is_initialized()):
            return self.module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(self.module)

    def _rewrapped(self) -> torch.nn.Module:
        """The model on the rebuilt world (FSDP2: a new module, holding this rank's shards)."""
        if isinstance(self._wrap, FSDP2):
            self.module = self._wrap.again(self.module, self.optimizer)
            return self.module
        return self._wrapped()

    def _restore(self, kept: StepState) -> None:
        """Puts back what the failed attempt changed: gradients, buffers, the RNG states."""
        self.optimizer.zero_grad(set_to_none=True)
        kept.restore(self.module)

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped model of the current world (a new object after each rebuild).

        Raises:
            RuntimeError: this rank was left out of the world (no model to train).
        """
        if self._model is None:
            raise RuntimeError("this rank was left out of the rebuilt world; it has no model to train")
        return self._model

    def __call__(self, step_fn: Callable[[torch.nn.Module], Any], *, step: int | None = None) -> StepResult:
        """Runs one step: ``step_fn(model)`` (forward and backward), a commit, the optimizer step;
        on a failed commit, a rebuild and the step again.

        Args:
            step_fn: runs forward and backward on the wrapped model it is given; it must not
                step or zero the optimizer. Called again, with the same inputs, to redo the step.
            step: your loop's step number, checked by :func:`should_commit` on every rank.

        Returns:
            A :class:`StepResult`, truthy when the step was applied on every rank.

        Raises:
            TypeError: ``step_fn`` is not callable.
            RuntimeError: this rank was left out of the world by an earlier call.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable (forward and backward), got {type(step_fn).__name__}")
        self.model  # noqa: B018 - refuses a rank left out earlier, before anything runs
        mark_step(step)  # the heartbeat's step and the straggler windows' step count; a redo is the same step
        start = time.monotonic()
        kept = StepState.take(self.module)  # CUDA's generators too, where CUDA is in use (GPU dropout)
        commits: list[CommitResult] = []
        rebuilds, output = 0, None
        healed: HealResult | None = None
        for attempt in range(1, self.max_attempts + 1):
            self.optimizer.zero_grad(set_to_none=True)
            failure: BaseException | None = None
            try:
                output = step_fn(self.model)
            except Exception as exc:  # noqa: BLE001 - this rank's failure goes into the commit
                log.warning("RecoveringStep: the step raised on this rank (%s: %s)", type(exc).__name__, exc)
                failure, output = exc, None
            # A redo passes no step=: the others' first attempt already did.
            redo = attempt > 1 or self._redo_next
            self._redo_next = False
            res = should_commit(timeout=self._commit_timeout, step=None if redo else step, failure=failure)
            commits.append(res)
            if res:
                self.optimizer.step()
                self._applied += 1
                done = StepResult(True, attempt, generation(), rebuilds, output, commits, elapsed_s=_since(start))
                done.healed = healed
                return done
            error: NcclGuardError | None = res.error or CommitFailed("the step's commit failed")
            if attempt == self.max_attempts:
                break
            old = self._model
            joined: list[int] = []
            if dist.is_available() and dist.is_initialized():
                self._model = None
                rebuilt = rebuild_world(timeout=self._rebuild_s, allow_shrink=self.allow_shrink)
                rebuilds += 1
                if not rebuilt:
                    log.error("RecoveringStep: no world to redo the step in (%s)", rebuilt.error)
                    if not rebuilt.late:  # nothing changed: the old world and its wrapper stand
                        self._model = old
                    error = rebuilt.error or RebuildFailed("rebuild_world failed")
                    return StepResult(
                        False, attempt, generation(), rebuilds, None, commits, rebuilt.late, _since(start), error
                    )
                joined = rebuilt.joined_ranks
            self._restore(kept)
            if self.heal and joined:
                # Before the re-wrap (DDP broadcasts rank 0's parameters), in the same order as the
                # restarted ranks' constructor: the state from before this step, and its number.
                healed = heal_from_peer(
                    self.module,
                    self.optimizer,
                    step=self._applied if step is None else step,
                    timeout=self._heal_s,
                    chunk_bytes=self._chunk,
                )
                if not healed:
                    fail = StepResult(False, attempt, generation(), rebuilds, None, commits, False, _since(start))
                    fail.error, fail.healed = healed.error, healed
                    return fail
            # The old wrapper goes now, while the reaper still holds the abandoned groups: freeing
            # a group's last reference on this thread could wait for gloo to give up its ops.
            del old
            self._model = self._rewrapped()
            log.warning(
                "RecoveringStep: redoing the step in world generation %d (%d ranks), attempt %d",
                generation(),
                dist.get_world_size() if dist.is_initialized() else 1,
                attempt + 1,
            )
        return StepResult(False, self.max_attempts, generation(), rebuilds, None, commits, False, _since(start), error)


def _since(start: float) -> float:
    return time.monotonic() - start
