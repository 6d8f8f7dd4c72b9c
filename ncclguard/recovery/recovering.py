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
from ncclguard.recovery.rebuild import generation, rebuild_world

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
            last attempt, :class:`~ncclguard.errors.RebuildFailed` when no world could be rebuilt).
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

    Raises:
        TypeError, ValueError: bad arguments.
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
        self._rebuild_s = to_seconds(rebuild_timeout, "rebuild_timeout")
        self.module, self.optimizer = module, optimizer
        self._wrap, self._commit_timeout = wrap, commit_timeout
        self.allow_shrink, self.max_attempts = allow_shrink, max_attempts
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

    def _restore(self, buffers: list[torch.Tensor], rng: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        """Puts back what the failed attempt changed: gradients, buffers, the RNG states."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, kept in zip(self.module.buffers(), buffers, strict=True):
                live.copy_(kept)
        torch.set_rng_state(rng[0])
        if rng[1]:
            torch.cuda.set_rng_state_all(rng[1])

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
        buffers = [b.detach().clone() for b in self.module.buffers()]
        # CUDA's generators too, where CUDA is in use (dropout on the GPU draws from them).
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])
        commits: list[CommitResult] = []
        rebuilds, output = 0, None
        for attempt in range(1, self.max_attempts + 1):
            self.optimizer.zero_grad(set_to_none=True)
            failure: BaseException | None = None
            try:
                output = step_fn(self.model)
            except Exception as exc:  # noqa: BLE001 - this rank's failure goes into the commit
                log.warning("RecoveringStep: the step raised on this rank (%s: %s)", type(exc).__name__, exc)
                failure, output = exc, None
            res = should_commit(timeout=self._commit_timeout, step=step if attempt == 1 else None, failure=failure)
            commits.append(res)
            if res:
                self.optimizer.step()
                return StepResult(True, attempt, generation(), rebuilds, output, commits, elapsed_s=_since(start))
            error: NcclGuardError | None = res.error or CommitFailed("the step's commit failed")
            if attempt == self.max_attempts:
                break
            old = self._model
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
            self._restore(buffers, rng)
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
