"""What the recovery engine does when a step's commit names a non-finite gradient.

Every rank reads the same commit outcome, so every rank takes the same action (:func:`choose`):

- ``"redo"`` (and ``"auto"``, the default, on a model on a GPU): the step's state is put back (buffers, generators, no gradients) and
  the step runs again on the same world, once; a second finding in the same step skips it (the
  batch itself is bad, not the moment);
- ``"skip"``: the step's state is put back and the step is not applied: the batch leaves no trace;
- ``"raise"``: :class:`~ncclguard.errors.NonFiniteGradient` on every rank, the step not applied.

A rank flagged at two different steps no more than ``within`` steps apart is named once as a
suspect device (:class:`Suspects`). :class:`NonFiniteWatch` holds the engine's part: the hook's
check, the policy, the suspects, and a bounded record of what was seen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ncclguard._log import log
from ncclguard.errors import NonFiniteGradient
from ncclguard.recovery._numerics import fsdp2_check, param_check
from ncclguard.recovery._numerics.findings import BucketFinding, NumericsSaid, outcome_words
from ncclguard.recovery._numerics.hook import GradCheck, refusal
from ncclguard.recovery._numerics.told import tell_nonfinite

__all__ = ["Action", "NonFiniteSeen", "NonFiniteWatch", "Policy", "Suspects", "choose"]

Policy = Literal["auto", "redo", "skip", "raise", "off"]
Action = Literal["redo", "skip", "raise"]
MAX_SEEN = 100  # findings kept in NonFiniteWatch.seen


def choose(policy: Policy, redone: bool, can_redo: bool) -> Action:
    """The action on a finding (pure; the same on every rank, which read the same outcome).

    Args:
        policy: the engine's ``on_nonfinite``.
        redone: this step was redone for a finding already.
        can_redo: an attempt is left and the caller can run the step again.

    Returns:
        ``"raise"`` under that policy; ``"redo"`` under ``"redo"`` for a step's first finding
        while an attempt is left; ``"skip"`` otherwise.
    """
    if policy == "raise":
        return "raise"
    if policy in ("redo", "auto") and can_redo and not redone:
        return "redo"
    return "skip"


class Suspects:
    """The ranks flagged at two different steps at most ``within`` steps apart, each named once.

    Args:
        within: the most steps between two findings of one rank for it to be a suspect.
    """

    def __init__(self, within: int) -> None:
        if isinstance(within, bool) or not isinstance(within, int) or within < 1:
            raise ValueError(f"within must be an int of at least 1, got {within!r}")
        self.within = within
        self.named: list[int] = []
        self._last: dict[int, int] = {}

    def seen(self, ranks: Iterable[int], step: int) -> list[int]:
        """Notes a finding on ``ranks`` at ``step``.

        Returns:
            The ranks that became suspects with it (sorted; each rank once ever).
        """
        new = []
        for rank in sorted(set(ranks)):
            before = self._last.get(rank)
            if before is not None and before != step and abs(step - before) <= self.within and rank not in self.named:
                self.named.append(rank)
                new.append(rank)
            self._last[rank] = step
        return new


@dataclass(frozen=True)
class NonFiniteSeen:
    """One finding as the engine acted on it (:attr:`NonFiniteWatch.seen`).

    Attributes:
        step: the loop's step number.
        ranks: the ranks whose gradient was not finite.
        finite_ranks: the ranks whose checked gradient was finite.
        buckets: by rank, its flagged buckets.
        action: ``"redo"``, ``"skip"`` or ``"raise"``.
    """

    step: int
    ranks: list[int]
    finite_ranks: list[int]
    buckets: dict[int, list[BucketFinding]]
    action: Action


class NonFiniteWatch:
    """The engine's part of the check: the hook's scans, the policy and the suspects.

    Args:
        policy: ``on_nonfinite`` (``"off"``: nothing is checked).
        within: ``nonfinite_suspect_steps``.
        who: the adapter's name, for the log.

    Attributes:
        check: the scans of the current attempt (None when off).
        suspects: the ranks named as suspect devices.
        seen: the latest findings, oldest first (at most 100).
    """

    def __init__(self, policy: Policy, within: int, who: str) -> None:
        self.policy, self.who = policy, who
        self.check: GradCheck | None = GradCheck() if policy != "off" else None
        self.suspects = Suspects(within)
        self.seen: deque[NonFiniteSeen] = deque(maxlen=MAX_SEEN)
        self._redone = False
        self._said_unchecked = False

    def install(self, model: torch.nn.Module, module: torch.nn.Module) -> bool:
        """Puts the check on a DDP wrapper that ncclguard built (see :meth:`GradCheck.install`).

        Returns:
            Whether the wrapper carries it (False: the policy is ``"off"``, ``"auto"`` with the
            model on the CPU, or DDP refused; said once).
        """
        if self.check is None:
            return False
        if self.policy == "auto" and not any(p.is_cuda for p in module.parameters()):
            # Measured: the scan adds 6-8% to a CPU DDP step (docs/numerics.md, "What it costs"); on an
            # H200 a nearly fixed 0.4-0.8 ms a step, under 1% of the steps of 80 ms and more.
            self.unchecked("on_nonfinite='auto' leaves a model on the CPU unchecked; on_nonfinite='redo' checks it")
            return False
        try:
            self.check.install(model, module)
        except RuntimeError as exc:  # DDP's own refusal: the wrapper keeps working unchecked
            log.warning("%s: gradients are not checked for NaN or Inf on this wrapper (%s)", self.who, exc)
            return False
        return True

    def install_sharded(self, model: torch.nn.Module) -> bool:
        """Puts the check on each FSDP module's reduce-scatter (:mod:`~ncclguard.recovery._numerics.fsdp2_check`),
        again on every module FSDP2 shards anew after a rebuild.

        Returns:
            Whether it carries it (False: off, ``"auto"``, which leaves FSDP2 unchecked until its
            check has run on a GPU, or no FSDP module holds parameters; said once).
        """
        if self.check is None:
            return False
        if self.policy == "auto":
            self.unchecked(
                "on_nonfinite='auto' leaves FSDP2 unchecked (its check has not run on a GPU yet); 'redo' checks it"
            )
            return False
        if fsdp2_check.install(self.check, model) == 0:
            self.unchecked("no FSDP2 module holds parameters of its own")
            return False
        return True

    def install_params(self, module: torch.nn.Module, built_by: str) -> bool:
        """Puts the check on each parameter's gradient, before the framework reduces it
        (:mod:`~ncclguard.recovery._numerics.param_check`: DeepSpeed's ZeRO), again on every module
        the framework builds anew.

        Args:
            module: the module whose parameters take the gradients.
            built_by: who reduces them, for the log.

        Returns:
            Whether it carries it (False: off, ``"auto"``, which leaves it unchecked until it has
            run on a GPU, or no parameter takes a gradient; said once).
        """
        if self.check is None:
            return False
        if self.check.carries(module) and param_check.carries_every(self.check, module):
            return True
        if self.policy == "auto":
            self.unchecked(
                f"on_nonfinite='auto' leaves {built_by} unchecked (its check has not run on a GPU yet); 'redo' checks it"
            )
            return False
        if param_check.install(self.check, module) == 0:
            self.unchecked("no parameter takes a gradient")
            return False
        return True

    def adopt(self, model: torch.nn.Module, module: torch.nn.Module, built_by: str, scaler: Any = None) -> bool:
        """Puts the check on the wrapper a framework built (Accelerate's ``prepare``, the HF Trainer,
        Lightning's DDP strategy) where its one comm hook slot is free and the check stays bit-equal
        (:func:`~ncclguard.recovery._numerics.hook.refusal`); again on each new wrapper, once on each.

        Args:
            model: the framework's wrapper of this step.
            module: the module it wraps (its parameter names name the findings).
            built_by: who built it, for the log.
            scaler: the framework's ``GradScaler`` (fp16), which owns non-finite gradients; None: none.

        Returns:
            Whether the wrapper carries the check (False: said once why not).
        """
        if self.check is None:
            return False
        if self.check.carries(model):
            return True
        why = (
            "a GradScaler owns non-finite gradients (it skips the step, lowers the scale)"
            if scaler is not None
            else None
        )
        why = why or refusal(model)
        if why is not None:
            self.unchecked(f"{built_by}'s wrapper: {why}")
            return False
        return self.install(model, module)

    def unchecked(self, why: str) -> None:
        """Says once (at info level) why the adapter's gradients are not checked; nothing when off."""
        if self.check is not None and not self._said_unchecked:
            self._said_unchecked = True
            log.info("%s: gradients are not checked for NaN or Inf: %s (docs/numerics.md)", self.who, why)

    def begin(self) -> None:
        """A new step: no scans, not redone."""
        self._redone = False
        self.clear()

    def clear(self) -> None:
        """A new attempt of the step: the scans so far are dropped."""
        if self.check is not None:
            self.check.clear()

    def take(self) -> NumericsSaid | None:
        """What this rank states at the commit (the attempt's scans read, then dropped: the next
        attempt fills them afresh), or None when no wrapper carries the check."""
        if self.check is None or not self.check.installed:
            return None
        said = self.check.said()
        self.check.clear()
        return said

    def act(
        self,
        step: int,
        nonfinite: Mapping[int, Sequence[BucketFinding]],
        finite: Sequence[int],
        can_redo: bool,
        attempt: int = 1,
        commit: int = 0,
    ) -> tuple[Action, NonFiniteGradient]:
        """Chooses the action on a finding every rank read, says it, names a suspect device, and tells
        the watchdog (an incident: :mod:`ncclguard.recovery._numerics.told`).

        Args:
            step: the loop's step number.
            nonfinite: by rank, its flagged buckets (the commit's outcome).
            finite: the ranks whose checked gradient was finite.
            can_redo: an attempt is left and the caller can run the step again.
            attempt: the step's attempt whose commit named it.
            commit: that commit's number in its world (the incident's signature).

        Returns:
            The action, and the error that names the finding (raised by the caller for ``"raise"``,
            the skipped step's error for ``"skip"``).
        """
        action = choose(self.policy, self._redone, can_redo)
        self._redone = self._redone or action == "redo"
        then = {
            "redo": "its state is put back and it runs again",
            "skip": "its state is put back and its batch is skipped",
            "raise": "NonFiniteGradient is raised",
        }[action]
        text = f"{outcome_words(step, nonfinite, finite)}; the step was not applied on any rank: {then}"
        ranks = sorted(nonfinite)
        log.warning("%s: %s (on_nonfinite=%r)", self.who, text, self.policy)
        suspects = self.suspects.seen(ranks, step)
        for rank in suspects:
            log.warning(
                "%s: rank %d gave a non-finite gradient again at step %d, within %d steps of the last time: its "
                "device is suspect (a failing GPU or its memory); consider taking it out of the job",
                self.who,
                rank,
                step,
                self.suspects.within,
            )
        buckets = {r: list(nonfinite[r]) for r in ranks}
        self.seen.append(NonFiniteSeen(step, ranks, list(finite), buckets, action))
        tell_nonfinite(
            step, attempt, buckets, finite, action, suspects, commit, self.who
        )  # an incident, before a raise
        error = NonFiniteGradient(
            text,
            step=step,
            ranks=ranks,
            buckets={r: [b.model_dump() for b in bs] for r, bs in buckets.items()},
            finite_ranks=list(finite),
            action=action,
        )
        return action, error
