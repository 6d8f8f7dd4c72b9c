"""One step's transaction of the recovery engine (:class:`Transaction`, opened by
:meth:`~ncclguard.recovery.engine.Recovery.begin`): run, commit, and on a failure the rebuild, the
heal or restore, the re-wrap and the redo, up to ``max_attempts`` (the steps in
:mod:`ncclguard.recovery.engine`'s doc).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch.distributed as dist

from ncclguard._log import log
from ncclguard.errors import CommitFailed, NcclGuardError
from ncclguard.recovery._commit.said import note_numerics
from ncclguard.recovery._step.guards import diverged
from ncclguard.recovery._step.state import StepState
from ncclguard.recovery.adapter import Reenter
from ncclguard.recovery.commit import CommitResult, should_commit
from ncclguard.recovery.heal import HealResult
from ncclguard.recovery.rebuild import RebuildResult, generation
from ncclguard.recovery.records import Recovered, StepResult
from ncclguard.recovery.snapshots.restore import Restored
from ncclguard.world import current_world

if TYPE_CHECKING:
    from ncclguard.recovery.engine import Recovery

__all__ = ["Carried", "Clock", "Transaction"]

T = TypeVar("T")


@dataclass
class Carried:
    """A transaction left by :class:`Reenter`, for the next one of the same step to go on with."""

    number: int
    attempt: int
    start: float
    tally: _Tally  # what the attempts before the Reenter gathered (rebuilt, or refused their values)


@dataclass
class _Tally:
    """What one step's attempts have gathered so far, for its result.

    Attributes:
        commits: every attempt's commit.
        joined: the restarted ranks the rebuilds admitted.
        healed: the last heal or restore (None: none yet).
        rebuilds: rebuilds taken.
        clock: where the seconds went.
        nonfinite: attempts that ended in a non-finite gradient or a drifted replica (no rebuild:
            their redo is not a recovery).
    """

    commits: list[CommitResult]
    joined: list[int]
    healed: HealResult | Restored | None
    rebuilds: int
    clock: Clock
    nonfinite: int = 0

    def carried(self, number: int, attempt: int, start: float) -> Carried:
        """These attempts of step ``number`` (the last ``attempt``), left by :class:`Reenter`."""
        return Carried(number, attempt, start, self)


@dataclass(frozen=True)
class _NoRedo:
    """The new world could not take the step (its handshake, a heal or a restore failed, the re-wrap
    raised): no redo. The next commit fails on ``error`` on this rank, so every rank rebuilds again."""

    error: BaseException


class Clock:
    """Seconds spent per phase of a transaction (:attr:`Recovered.timings`)."""

    def __init__(self, start: float) -> None:
        self.last = start
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


class Transaction(Generic[T]):
    """One step's transaction (see the module doc); made by :meth:`Recovery.begin`.

    Attributes:
        step: the caller's step number, or None.
        number: how the step is named (see :meth:`Recovery.begin`).
        kept: the step's snapshot (buffers and generators as the step found them).
        failure: this rank's failure in the current attempt (an exception caught by :meth:`run`).
        output: what the last :meth:`run` returned.
    """

    def __init__(
        self,
        engine: Recovery,
        step: int | None,
        number: int | None = None,
        redo: bool = False,
        carried: Carried | None = None,
    ) -> None:
        self.engine, self.step = engine, step
        self.number = number if number is not None else step if step is not None else engine.applied
        # A redo (the survivors' after Reenter, a restarted rank's first step): no step= at its commit.
        self._redo = redo or carried is not None
        self._carried = carried
        self.failure: BaseException | None = None
        self.output: T | None = None
        self._start = carried.start if carried is not None else time.monotonic()
        adapter = engine.adapter
        self.kept = StepState.take(adapter.get_module())
        self._extra = adapter.keep()
        self._closed = False
        self._clean = False  # committed at its first attempt (the learned bound counts it)

    def run(self, fn: Callable[[], T]) -> T | None:
        """Runs ``fn`` (forward and backward); an exception becomes this rank's failure.

        Returns:
            What ``fn`` returned, or None when it raised (or when an earlier part of this attempt
            failed: nothing more is computed).
        """
        if self.failure is not None:
            return None
        try:
            self.output = fn()
        except Exception as exc:  # noqa: BLE001 - this rank's failure goes into the commit
            log.warning(
                "%s: step %s raised on this rank (%s: %s)",
                self.engine.adapter.name,
                self.number,
                type(exc).__name__,
                exc,
            )
            self.failure, self.output = exc, None
        return self.output

    def close(self) -> None:
        """Ends the transaction without an outcome (the step bound is lifted)."""
        if not self._closed:
            self._closed = True
            self.engine.bound.disarm()
            self.engine.timing.ends(self._clean)
            if self.engine._open is self:
                self.engine._open = None

    def settle(self, redo: Callable[[], T] | None) -> StepResult[T]:
        """Commits the step on every rank; on a failed commit rebuilds, heals, re-wraps, restores
        and redoes it (``redo`` runs forward and backward again, through :meth:`run` or not).

        Args:
            redo: runs the step again; None: no redo (the result is falsy after the first failed
                commit, and the world is left as it is).

        Returns:
            The :class:`StepResult`; truthy when the step may be applied.

        Raises:
            Reenter: the adapter's framework must enter its loop again at this step (the
                transaction is carried to the next :meth:`Recovery.begin` of it).
            RebuildFailed: this rank was left out of the rebuilt world and ``left_out="raise"``.
            LoopDiverged, GeneratorsApart: the ranks passed different step numbers (a loop that did
                not go back with a restore), or ``heal=True`` met a seed per rank; on every rank.
        """
        opts = self.engine.options
        tally, first = self._tally()
        error: NcclGuardError | None = None
        try:
            for attempt in range(first, opts.max_attempts + 1):
                # A redo passes no step=: the first attempt's commit already checked it.
                checked = self.step if attempt == 1 and not self._redo else None
                self.engine.seeds.state(self.kept)
                note_numerics(self.engine.numerics.take())  # this attempt's scans, read once
                self.engine.replicas.state(self.number)  # the replica's digests, at the check's steps
                res = should_commit(timeout=opts.commit_timeout_s, step=checked, failure=self.failure)
                tally.commits.append(res)
                tally.clock.lap("commit")
                self.engine.seeds.check(res, self.number)  # raises on every rank alike (the same outcome)
                if res:
                    return self._committed(res, attempt, tally)
                loop = diverged(res)
                if loop is not None:  # a rebuild cannot mend it: every rank stops with the fix
                    log.critical("%s: %s", self.engine.adapter.name, loop)
                    raise loop
                if res.only_nonfinite:  # the world is whole: the values went wrong, not a rank
                    numeric = _on_nonfinite(self, res, attempt, tally, redo)
                    if numeric is not None:
                        return numeric
                    continue
                if res.only_drift:  # a replica drifted: healed from the majority in this world
                    healed = _on_drift(self, res, attempt, tally, redo)
                    if healed is not None:
                        return healed
                    continue
                error = res.error or CommitFailed(f"step {self.number}'s commit failed")
                if attempt == opts.max_attempts or redo is None:
                    break
                ended = self._recover(attempt, tally)
                if isinstance(ended, _NoRedo):
                    self.failure = ended.error
                    continue
                if ended is not None:
                    return ended
                self._redo_step(redo, attempt, tally.clock)
            return self._result(False, len(tally.commits), tally, error)
        finally:
            self.close()

    def _tally(self) -> tuple[_Tally, int]:
        """What this step's attempts have gathered (those before a :class:`Reenter` too), and the
        number of the attempt whose commit comes next; laps the attempt that ran before it."""
        carried = self._carried
        if carried is None:
            tally, first = _Tally(commits=[], joined=[], healed=None, rebuilds=0, clock=Clock(self._start)), 1
        else:  # the attempts before the Reenter go on here
            tally, first = carried.tally, carried.attempt + 1
        tally.clock.lap("redo" if carried else "attempt")  # this attempt ran before the commit
        return tally, first

    def _committed(self, res: CommitResult, attempt: int, tally: _Tally) -> StepResult[T]:
        """The step committed: counted applied, a stop agreed at its commit noted, a redo recorded."""
        engine = self.engine
        engine.applied += 1
        if res.stop:
            engine.stop_after = self.number
        if attempt - 1 > tally.nonfinite:  # a redo on a rebuilt world, not only for the values
            _recovered(self, self.number, attempt, tally.commits, tally.joined, tally.clock.laps)
        return self._result(True, attempt, tally, None)

    def _recover(self, attempt: int, tally: _Tally) -> StepResult[T] | _NoRedo | None:
        """After a failed commit: rebuilds the world, puts back the state the step found, and
        brings the restarted ranks and the model onto the new world.

        Returns:
            The step's result when it ends here (no world, a restore refused, every rank went back
            to an older snapshot); :class:`_NoRedo` when the new world could not take the step (its
            handshake, a heal or a restore failed, the re-wrap raised); or None: the step is redone.

        Raises:
            Reenter: the adapter's framework enters its loop again (the transaction is carried).
            RebuildFailed: this rank was left out and ``left_out="raise"``.
        """
        engine = self.engine
        engine.bound.disarm()  # the rebuild and the heal are bounded by their own timeouts
        engine.timing.pause()  # and the verdict judges no rank there (a healthy one looks still)
        # A world whose last rebuild failed its handshake has no group, and is no world of one.
        several = (dist.is_available() and dist.is_initialized()) or current_world().awaits_group
        rebuilt = engine.rebuild(self.number) if several else None
        tally.clock.lap("rebuild")
        if rebuilt is not None:
            tally.rebuilds += 1
            if not rebuilt and current_world().awaits_group and rebuilt.error is not None:
                return _NoRedo(rebuilt.error)  # the members met: the next commit fails at once, they meet again
            if not rebuilt:
                return self._result(False, attempt, tally, rebuilt.error)
        self._put_back()
        if rebuilt is None:  # no process group: a world of one redoes the step where it is
            return None
        return self._onto_new_world(rebuilt, attempt, tally)

    def _put_back(self) -> None:
        """Puts back the step's snapshot and what the adapter kept, and clears the gradients."""
        adapter = self.engine.adapter
        self.kept.restore(adapter.get_module())
        adapter.restore(self._extra)
        # Before the heal and the re-wrap: after Reenter the framework's own loop runs the
        # next attempt, and a failed attempt's local gradients (its backward ran, its
        # all_reduce did not) would be summed into it.
        adapter.zero_grad()

    def _onto_new_world(self, rebuilt: RebuildResult, attempt: int, tally: _Tally) -> StepResult[T] | _NoRedo | None:
        """Heals the restarted ranks the rebuild admitted (a replicated model), re-wraps the model
        on the new world, then restores sharded state from the snapshots.

        A heal that failed (a receiver died or refused, a chunk missed the deadline) or a re-wrap
        that raised (DDP's first broadcast to a receiver that died) leaves a world that may be
        dead: the step is not redone there, and the next commit rebuilds it (a receiver restarted
        again joins that rebuild), within ``max_attempts``.

        Returns:
            The step's result when it ends here, :class:`_NoRedo`, or None: the step is redone.

        Raises:
            Reenter: from the adapter's re-wrap; the transaction is carried to the next begin.
        """
        engine, number = self.engine, self.number
        healed = engine.heal_joined(rebuilt, number)
        tally.clock.lap("heal")
        if healed is not None:
            tally.healed = healed
            if not healed:
                assert healed.error is not None
                log.warning("%s: step %s: %s; the world is rebuilt again", engine.adapter.name, number, healed.error)
                return _NoRedo(healed.error)
        tally.joined += rebuilt.joined_ranks
        try:
            engine.adapter.rewrap(rebuilt)
        except Reenter:
            tally.clock.lap("rewrap")
            engine._carried = tally.carried(number, attempt, self._start)
            raise
        except Exception as exc:  # noqa: BLE001 - the new world failed under the wrap: rebuild again
            tally.clock.lap("rewrap")
            why = f"the re-wrap on the new world raised ({type(exc).__name__}: {exc})"
            log.warning("%s: step %s: %s; the world is rebuilt again", engine.adapter.name, number, why)
            return _NoRedo(exc)
        tally.clock.lap("rewrap")
        return self._restore_sharded(rebuilt, attempt, tally)

    def _restore_sharded(self, rebuilt: RebuildResult, attempt: int, tally: _Tally) -> StepResult[T] | _NoRedo | None:
        """Sharded state: every rank back to one snapshot (:meth:`Recovery.restore_joined`). A refused
        restore ends the step (another world would refuse it too); one that failed otherwise (a
        receiver died in it, the deadline) is no redo, and a rank whose restore failed while a peer's
        succeeded meets it at the step's next commit, not at the next step's.

        Returns:
            The step's result when the restore was refused or went back to an older step (the
            loop runs again from there), :class:`_NoRedo`, or None: the step is redone.
        """
        engine = self.engine
        restored = engine.restore_joined(rebuilt, self.number)
        if restored is None:
            return None
        tally.clock.lap("heal")
        tally.healed = restored
        if not restored and restored.error is not None and not restored.error.refused_ranks:
            log.warning("%s: step %s: %s; the world is rebuilt again", engine.adapter.name, self.number, restored.error)
            return _NoRedo(restored.error)
        if not restored:
            return self._result(False, attempt, tally, restored.error)
        if not restored.rolled_back:
            return None
        log.warning(
            "%s: every rank went back to step %s; the loop runs again from there", engine.adapter.name, restored.step
        )
        back = self._result(False, attempt, tally, None)
        back.rewound_to = engine.rewind_to = restored.step
        back.timings = {k: round(v, 4) for k, v in tally.clock.laps.items()}
        return back

    def _redo_step(self, redo: Callable[[], T], attempt: int, clock: Clock) -> None:
        """Runs the step again on the new world (attempt ``attempt + 1``), under the step bound."""
        engine = self.engine
        log.warning(
            "%s: redoing step %d in world generation %d (%d ranks), attempt %d",
            engine.adapter.name,
            self.number,
            generation(),
            dist.get_world_size() if dist.is_initialized() else 1,
            attempt + 1,
        )
        engine.bound.arm()
        engine.timing.redo()
        self.failure = None
        self.run(redo)
        clock.lap("redo")

    def _result(self, ok: bool, attempts: int, tally: _Tally, error: NcclGuardError | None) -> StepResult[T]:
        self._clean = ok and attempts == 1
        return StepResult(
            ok,
            attempts,
            generation(),
            tally.rebuilds,
            self.output if ok else None,
            tally.commits,
            time.monotonic() - self._start,
            error,
            tally.healed,
        )


def _on_nonfinite(
    tx: Transaction[T], res: CommitResult, attempt: int, tally: _Tally, redo: Callable[[], T] | None
) -> StepResult[T] | None:
    """A commit that named non-finite gradients alone: the policy's action, the same on every rank
    (:mod:`ncclguard.recovery._numerics.policy`). The step's state is put back in every case.

    Returns:
        The step's result when it ends here (skipped), or None: the step ran again on this world.

    Raises:
        NonFiniteGradient: with ``on_nonfinite="raise"``.
    """
    engine = tx.engine
    can_redo = redo is not None and attempt < engine.options.max_attempts
    action, error = engine.numerics.act(tx.number, res.nonfinite, res.finite_ranks, can_redo, attempt, res.step)
    tally.nonfinite += 1
    tx._put_back()  # buffers, generators and gradients as the step found them: the batch leaves no trace
    try:  # and the framework's own copies of them (DeepSpeed's partitions)
        engine.adapter.discard_gradients(action == "redo")
    except Reenter:  # its loop builds them anew and runs the step again: this attempt is carried there
        engine._carried = tally.carried(tx.number, attempt, tx._start)
        raise
    if action == "raise":
        raise error
    if action == "skip":
        skipped = tx._result(False, attempt, tally, error)
        skipped.skipped = True
        return skipped
    assert redo is not None  # choose() redoes only when it can
    _redo_here(tx, redo, tally)
    return None


def _on_drift(
    tx: Transaction[T], res: CommitResult, attempt: int, tally: _Tally, redo: Callable[[], T] | None
) -> StepResult[T] | None:
    """A commit that named drifted replicas alone (docs/numerics.md, "Replicas checked"): the step's
    state is put back on every rank, the drifted ranks are healed from a majority peer in this world
    (:meth:`~ncclguard.recovery._numerics.replicas.ReplicaCheck.heal`), and the step runs again.

    Returns:
        The step's result when it ends here (no redo left: not applied), or None: the step ran
        again, or the heal failed and the next commit fails on this rank (every rank rebuilds).

    Raises:
        ReplicasDiverged: no digest was held by a majority (every rank alike).
    """
    engine = tx.engine
    tally.nonfinite += 1  # a redo on this world for the values: no recovery
    tx._put_back()
    healed = engine.replicas.heal(res, tx.number, attempt)
    tally.clock.lap("heal")
    tally.healed = healed
    if not healed:  # the world may be dead: the next commit fails here, and every rank rebuilds
        tx.failure = healed.error
        return None
    if redo is None or attempt == engine.options.max_attempts:
        return tx._result(False, attempt, tally, res.error)
    _redo_here(tx, redo, tally)
    return None


def _redo_here(tx: Transaction[T], redo: Callable[[], T], tally: _Tally) -> None:
    """Runs the step again on this world, under its own bound (a redo for the values: no rebuild)."""
    tx.engine.bound.arm()  # the attempt's own bound, as after a rebuild
    tx.failure = None
    tx.run(redo)
    tally.clock.lap("redo")


def _recovered(
    tx: Transaction[T],
    number: int,
    attempts: int,
    commits: list[CommitResult],
    joined: list[int],
    timings: dict[str, float],
) -> None:
    record = Recovered(
        step=number,
        attempts=attempts,
        generation=generation(),
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        failed_ranks=sorted({r for c in commits if not c.ok for r in c.failed_ranks}),
        healed_ranks=sorted(set(joined)),
        elapsed_s=time.monotonic() - tx._start,
        timings={k: round(v, 4) for k, v in timings.items()},
    )
    engine = tx.engine
    engine.recoveries.append(record)
    log.warning("%s: step %d redone on a rebuilt world: %s", engine.adapter.name, number, record.metrics())
    try:
        engine.adapter.log(record)
    except Exception:  # noqa: BLE001 - a tracker must never take training down
        log.exception("%s: logging the recovery of step %d failed", engine.adapter.name, number)
