"""The recovery engine: one implementation of a training step's transaction, for every framework.

A step's transaction, on every rank of the world (:meth:`Recovery.begin`, :meth:`Transaction.run`,
:meth:`Transaction.settle`):

1. **begin**: the step's snapshot (the module's buffers and every random generator,
   :class:`~ncclguard.recovery._step.state.StepState`, plus what the adapter keeps), the step
   mark, and the step bound (:mod:`ncclguard.recovery._step.guards`): a collective of this step waits
   for its peers at most ``collective_timeout`` seconds, whatever timeout the framework left on
   the group;
2. **run**: forward and backward; an exception is this rank's failure, stated at the commit and
   not raised;
3. **commit**: :func:`~ncclguard.recovery.commit.should_commit` gives every rank the same
   outcome. Ok: the transaction ends and the caller applies the step (``optimizer.step()``);
4. **not ok**: nothing was applied anywhere. The world is rebuilt
   (:func:`~ncclguard.recovery.rebuild.rebuild_world`); a rank the others went on without is
   left out (the left-out policy below); restarted ranks the rebuild admitted are healed from
   a live peer (:func:`~ncclguard.recovery.heal.heal_from_peer`); the adapter re-wraps the model
   on the new world; the snapshot is put back; the step runs again, up to ``max_attempts``;
5. **not ok for the values alone**: a commit that names only gradients that held a NaN or an
   infinity before the reduction (the adapter's check, :mod:`ncclguard.recovery._numerics`) rebuilds
   nothing: the snapshot is put back, and the step runs again on the same world once, is skipped,
   or raises :class:`~ncclguard.errors.NonFiniteGradient`, per ``on_nonfinite`` (docs/numerics.md).
   One that names only replicas whose digest differs from the majority's (``replica_check_every``)
   heals them from a majority peer in the same world and runs the step again.

The framework-specific parts are an :class:`Adapter`: what to keep beyond the snapshot, how to
re-wrap the model on a new world, where to log. ``RecoveringStep``, ``guard_trainer(recover=True)``,
Lightning's ``NcclGuardCallback(recover=True)``, Accelerate's ``recovering_step`` and DeepSpeed's
``CommittedEngineStep`` are adapters of this one engine.

The left-out policy, the same everywhere: a rank that reaches the rebuild after the others went
on without it is in no world. The world's subscribers of ``"left_out"`` are told first
(:func:`ncclguard.world.subscribe`; the rebuild tells them, as it tells ``"rebuilt"`` with the
step redone). With ``left_out="exit"`` (the default) it then logs why at critical level and exits
with status 0: torchrun leaves a worker that exits 0 alone, so the job ends when the others finish.
With ``left_out="raise"`` it raises :class:`~ncclguard.errors.RebuildFailed` (``late=True``) for
code that wants to act first.

Preemption (:mod:`ncclguard.recovery.preempt`): the engine installs a SIGTERM handler that only notes
the request; the next commit carries it to every rank (``CommitResult.stop``), the step is applied,
and at the next :meth:`Recovery.begin` every rank writes :meth:`Adapter.save_checkpoint` to the
preemption directory and exits 143.

A rank stuck for good inside a step never reaches the rebuild at all. While an engine runs, the
left-behind fence (:mod:`ncclguard.watching.desk.left_behind`) is on, whatever the watchdog's ladder:
such a rank exits 0 once the world record shows the others went on without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ncclguard._log import log
from ncclguard.backend_rules import rules_for, survivor_handling
from ncclguard.errors import HealFailed, RebuildFailed
from ncclguard.exits import exit_now
from ncclguard.recording.steps import mark_step
from ncclguard.recovery._numerics.policy import NonFiniteWatch
from ncclguard.recovery._numerics.replicas import ReplicaCheck
from ncclguard.recovery._rebuild import stand_in
from ncclguard.recovery._step.guards import StepBound, StepTiming, arm_left_behind_fence, not_rewound
from ncclguard.recovery._step.seeds import SeedCheck
from ncclguard.recovery.adapter import Adapter, Reenter
from ncclguard.recovery.heal import HealResult, heal_from_peer
from ncclguard.recovery.options import RecoveryOptions
from ncclguard.recovery.preempt import install_handler, stop_now
from ncclguard.recovery.rebuild import RebuildResult, rebuild_for_step
from ncclguard.recovery.records import Recovered
from ncclguard.recovery.rejoin import rejoin_world
from ncclguard.recovery.snapshots.keeper import Keeper
from ncclguard.recovery.snapshots.restore import Fetched, Restored, fetch, put_back, restore
from ncclguard.recovery.transaction import Carried, Transaction

__all__ = ["Adapter", "Recovery", "Reenter", "Transaction"]

T = TypeVar("T")


class Recovery:
    """The engine: owns every transaction of one training loop on this rank (see the module doc).

    Args:
        adapter: the framework's part.
        options: the settings (:func:`recovery_options`).

    Attributes:
        recoveries: every step applied after a redo, oldest first.
        applied: steps committed so far (the step a heal sends when the caller passes none).
    """

    def __init__(self, adapter: Adapter, options: RecoveryOptions) -> None:
        if not isinstance(adapter, Adapter):
            raise TypeError(f"adapter must be a ncclguard.recovery.engine.Adapter, got {type(adapter).__name__}")
        if not isinstance(options, RecoveryOptions):
            raise TypeError(f"options must come from recovery_options(), got {type(options).__name__}")
        self.adapter, self.options = adapter, options
        _keep_survivors()
        self.bound = StepBound(options.collective_timeout_s)
        self.timing = StepTiming(  # the verdict
            options.collective_timeout_s, adapter.name, options.left_out == "exit", heals=options.heal
        )
        self.recoveries: list[Recovered] = []
        self.applied = 0
        self._open: Transaction[Any] | None = None
        self._redo_next = False  # a restarted process's first step is the survivors' redo
        self._carried: Carried | None = None  # a step left by Reenter
        self.left = False  # this rank was left out (with left_out="raise"): no further step
        self.resume_step: int | None = None  # a restarted process: the step it joined at
        self.rewind_to: int | None = None  # every rank went back to this snapshot's step: the loop too
        codec = adapter.state_codec() if options.heal else None
        # Sharded state: snapshots of this rank's own state, replicated on a buddy (no disk).
        self.keeper: Keeper | None = (
            Keeper(
                codec,
                every=options.snapshot_every,
                timeout_s=options.heal_timeout_s,
                keep=options.snapshot_keep,
                spares=options.snapshot_spares,
                max_bytes=options.snapshot_max_bytes,
            )
            if codec is not None
            else None
        )
        # A heal from a live peer hands over its generators: the ranks' are compared at each commit.
        explicit = options.heal and not options.heal_auto
        self.seeds = SeedCheck(adapter.name, states=options.heal and self.keeper is None, explicit=explicit)
        self.stop_after: int | None = None  # a stop agreed at this step's commit (SIGTERM)
        # A gradient's NaN or Inf, found before the reduction: the adapter puts the check on its wrapper.
        self.numerics = NonFiniteWatch(options.on_nonfinite, options.nonfinite_suspect_steps, adapter.name)
        # A replica that drifted (a flipped bit): digests compared every replica_check_every steps, where
        # the adapter's DDP wrapper puts the check on (ReplicaCheck.install; a framework's: ReplicaCheck.adopt).
        self.replicas = ReplicaCheck(
            options.replica_check_every,
            adapter,
            self.numerics.suspects,
            options.heal_timeout_s,
            options.heal_chunk_bytes,
        )
        install_handler()

    def join_if_restarted(self) -> HealResult | Restored | None:
        """In a process restarted after its rank died, with ``heal`` on: joins the survivors' next
        rebuild (:func:`~ncclguard.recovery.rejoin.rejoin_world`) and receives the module's and the
        optimizer's state from a live peer. Elsewhere, nothing.

        Returns:
            The heal's result (its ``step`` is the step the survivors redo), or None.

        Raises:
            RebuildFailed: no rebuild admitted this process within ``rebuild_timeout``.
            HealFailed: the state did not arrive.
        """
        if not stand_in.awaiting_join(self.options.heal):
            return None
        stand_in.leave()  # what the framework set up on it is built again on the joined world
        rejoin_world(timeout=self.options.rebuild_timeout_s).raise_for_error()
        if self.keeper is not None:
            self.adapter.wrap_joined()
            if self.adapter.restores_in_loop:
                return None  # the adapter restores once its loop has built the model
            restored = restore(self.keeper, None, self.options.heal_timeout_s).raise_for_error()
            self.applied, self._redo_next, self.resume_step = restored.step or 0, True, restored.step
            return restored
        healed = heal_from_peer(
            self.adapter.get_module(),
            self.adapter.get_optimizer(),
            timeout=self.options.heal_timeout_s,
            chunk_bytes=self.options.heal_chunk_bytes,
        ).raise_for_error()
        self.applied, self._redo_next, self.resume_step = healed.step or 0, True, healed.step
        self.adapter.on_healed(healed)
        return healed

    def fetch_snapshot(self, limit: int | None = None) -> Fetched | None:
        """The first half of a restore for an adapter that :attr:`~Adapter.restores_in_loop`: every
        rank agrees on the snapshot's step and the restarted ranks receive their replicas
        (:func:`~ncclguard.recovery.snapshots.restore.fetch`); every rank calls it, before the loop.

        Args:
            limit: the most bytes a restarted rank takes (its model is not built yet).

        Returns:
            What this rank puts back (:meth:`put_snapshot_back`), or None when nobody joined or
            there are no snapshots (``heal`` off).
        """
        if self.keeper is None:
            return None
        return fetch(self.keeper, None, self.options.heal_timeout_s, limit=limit)

    def put_snapshot_back(self, fetched: Fetched) -> Restored:
        """The second half: once the model is built, every rank checks and applies what
        :meth:`fetch_snapshot` gave it, and the engine goes on from the snapshot's step: the next
        transaction is that step's redo on every rank.

        Returns:
            The :class:`~ncclguard.recovery.snapshots.restore.Restored` (falsy: nothing applied anywhere).
        """
        assert self.keeper is not None  # fetched comes from fetch_snapshot
        restored = put_back(self.keeper.codec, fetched, self.options.heal_timeout_s)
        self.keeper.force = True  # the receivers hold nothing to replicate yet
        if restored and restored.step is not None:
            self._redo_next = True
            if restored.role == "receiver":
                self.applied, self.resume_step = restored.step, restored.step
            if self._carried is not None:  # the survivors' failed step goes on as the redo of the snapshot's
                self._carried.number = restored.step
        return restored

    def steps(self, stop: int, start: int = 0) -> Iterator[int]:
        """A loop's step numbers, from ``start`` (a restarted process: from the step it joined at)
        to ``stop`` (excluded), going back when a restore from snapshots brought every rank back
        to an older step (:attr:`rewind_to`).

        Yields:
            Step numbers.
        """
        step = self.resume_step if self.resume_step is not None else start
        while step < stop:
            yield step
            if self.rewind_to is not None:
                step, self.rewind_to = self.rewind_to, None
            else:
                step += 1

    def begin(self, step: int | None = None, *, number: int | None = None) -> Transaction[Any]:
        """Opens the transaction of one step: its snapshot, its mark, its bound.

        Args:
            step: the caller's step number, checked on every rank by the commit (it must grow).
            number: how logs, records and a heal name the step when ``step`` is not passed (a
                framework's own count); default ``step``, else the count of steps applied.

        Returns:
            The open :class:`Transaction`.
        """
        if self.left:
            raise RuntimeError(
                f"{self.adapter.name}: this rank was left out of the rebuilt world; it has no step to run"
            )
        if self._open is not None:  # one left open by an exception that escaped its caller
            self._open.close()
        if self.stop_after is not None:  # the step the stop was agreed at is applied: write and exit
            stop_now(self.adapter, self.options.preempt_dir, self.stop_after)
        mark_step(
            step if step is not None else number
        )  # the heartbeat's step and the straggler windows' count; a redo is the same step
        arm_left_behind_fence()
        carried, self._carried = self._carried, None
        if carried is not None and carried.number != (number if number is not None else step):
            carried = None  # a different step: the one left by Reenter is not coming back
        if carried is None:
            self.numerics.begin()
        else:  # the same step's next attempt: a second finding in it is not redone again
            self.numerics.clear()
        tx: Transaction[Any] = Transaction(self, step, number, redo=self._redo_next, carried=carried)
        self._open, self._redo_next = tx, False
        if self.rewind_to is not None and step is not None:  # the loop's step after every rank went back
            if step != self.rewind_to:
                tx.failure = not_rewound(step, self.rewind_to)  # stated at the commit: every rank learns it
            self.rewind_to = None
        if self.keeper is not None:
            self._snapshot(tx)
        self.bound.arm()
        self.timing.begins()
        return tx

    def _snapshot(self, tx: Transaction[Any]) -> None:
        """Takes the step's snapshot when one is due. A redo takes none: the others are inside
        their transaction's redo then, not at a step boundary."""
        keeper = self.keeper
        assert keeper is not None
        keeper.note_begin()
        if tx._redo or not keeper.due(tx.number) or not (dist.is_available() and dist.is_initialized()):
            return
        try:
            keeper.take(tx.number, tx.kept)
        except HealFailed as exc:  # a peer died during the swap: this step fails on every rank
            log.warning("%s: step %d's snapshot failed: %s", self.adapter.name, tx.number, exc)
            tx.failure = exc

    # --------------------------------------------------------------- what a failed commit sets off

    def rebuild(self, step: int) -> RebuildResult:
        """Rebuilds the world for a redo of ``step``; applies the left-out policy to a rank the
        others went on without.

        The world's subscribers are told (:func:`ncclguard.world.subscribe`): ``"rebuilt"`` with
        ``step`` before the redo, or ``"left_out"`` before this rank exits or raises.

        Returns:
            The rebuild's result (falsy: no world to redo the step in).

        Raises:
            RebuildFailed: this rank was left out and ``left_out="raise"``.
        """
        rebuilt = rebuild_for_step(step, timeout=self.options.rebuild_timeout_s, allow_shrink=self.options.allow_shrink)
        if rebuilt:
            return rebuilt
        if rebuilt.late:
            self._leave(rebuilt, step)
        log.error("%s: no world to redo step %d in (%s)", self.adapter.name, step, rebuilt.error)
        return rebuilt

    def _leave(self, rebuilt: RebuildResult, step: int) -> None:
        # The subscribers of "left_out" were told by the rebuild: what is left is the policy.
        error = rebuilt.error or RebuildFailed("the others went on without this rank", late=True)
        self.left = True
        if self.options.left_out == "raise":
            raise error
        log.critical(
            "%s: step %d: this rank was left out (%s); it exits with status 0 so that the job ends with the others",
            self.adapter.name,
            step,
            error,
        )
        # os._exit: at interpreter shutdown a timed-out gloo group can abort the process (status -6,
        # seen with DeepSpeed here), and torchrun would then stop the survivors.
        exit_now(0)

    def heal_joined(self, rebuilt: RebuildResult, step: int) -> HealResult | None:
        """Sends the state as the step found it to the restarted ranks the rebuild admitted.

        Returns:
            The heal's result, or None when nobody joined or ``heal`` is off (or the state is
            sharded: :meth:`restore_joined` after the re-wrap).
        """
        if not (self.options.heal and rebuilt.joined_ranks) or self.keeper is not None:
            return None
        healed = heal_from_peer(
            self.adapter.get_module(),
            self.adapter.get_optimizer(),
            step=step,
            timeout=self.options.heal_timeout_s,
            chunk_bytes=self.options.heal_chunk_bytes,
            extra=self.adapter.heal_extra(),
        )
        if healed:
            self.seeds.healed(list(rebuilt.joined_ranks))
        return healed

    def restore_joined(self, rebuilt: RebuildResult, step: int) -> Restored | None:
        """Sharded state: brings every rank back to one snapshot, the restarted ranks from their
        buddies' replicas (after the re-wrap).

        Returns:
            The restore's result, or None when nobody joined or the state is not sharded.
        """
        if self.keeper is None or not rebuilt.joined_ranks:
            return None
        restored = restore(self.keeper, step, self.options.heal_timeout_s)
        if restored.rolled_back:
            self._redo_next = True  # the loop goes back to the snapshot's step, a redo everywhere
        return restored


def _keep_survivors() -> None:
    """On NCCL, every group made from now on (a rebuild's, a rejoin's) lets a survivor of a peer's
    death live on (``backend_rules.survivor_handling``); a group made before that would not is said.
    A restarted process's stand-in world of one (torch's ``fake`` backend) gets the variables for the
    world it joins next, and no warning: its own group carries nothing."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    rules = rules_for()
    backend = rules.backend.lower()
    stand_in_world = backend == "fake"
    # A mixed default backend ("cpu:gloo,cuda:nccl") on a machine without a GPU runs no NCCL op.
    on_nccl = rules.stand_in or ("nccl" in backend and torch.cuda.is_available())
    if not (on_nccl or stand_in_world):
        return
    to_set, warning = survivor_handling(os.environ, group_made=not stand_in_world)
    os.environ.update(to_set)
    if warning is not None and on_nccl:
        log.warning("recovery on NCCL: %s", warning)
