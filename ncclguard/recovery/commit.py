"""should_commit: every rank agrees, once per step, whether the step may be applied.

Call it on every rank after backward and before ``optimizer.step()``. Each rank states what it saw
since its last commit (:class:`~ncclguard.recovery._commit.statements.CommitStatement`): a failed or timed
out ncclguard call (the flight recorder), a failure mark on the group (a backend error or timeout
of a ``safe_*`` call), an incident the watchdog raised whose ladder acted (past ``report``), what
the caller reports, and the backend's sequence number on the group. One settle-once round in the group's store
(:func:`ncclguard.store.rounds.settle_round`) settles the outcome by compare-and-set: the rank
that completes the round (or, past the deadline, the first to give up waiting) decides it from the
statements present, and every rank, a late one included, reads that same outcome. The round never
touches the communicator, so it settles on a group whose communicator is dead.

Store traffic per rank: a ``set``, an ``add``, a ``wait`` and a ``get``; the settling rank makes a
``multi_get`` of every statement and a ``compare_set`` instead of the ``wait`` and ``get``. Nobody
else reads the statements. After a round that every rank reached, each rank deletes its statement
of the round before (rank 0 its counters and outcome too): every rank has left that one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch.distributed as dist
from torch.distributed import DistStoreError

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.collectives.groups import failure_of, group_info, group_timeout_s, no_group_reason
from ncclguard.config import get_config
from ncclguard.deadlines import Deadline, default_deadline, to_seconds
from ncclguard.errors import CommitFailed, StoreUnreachable
from ncclguard.recording.flight import recorder
from ncclguard.recording.rungs import ActedRung, acted
from ncclguard.recovery._commit.said import (
    generators_noted,
    note_point_to_point,
    numerics_noted,
    other_sequences,
    p2p_groups,
    replicas_noted,
    sequence,
)
from ncclguard.recovery._commit.statements import (
    MAX_PROBLEMS,
    MAX_STATEMENT_BYTES,
    CommitOutcome,
    CommitStatement,
    clip,
    commit_keys,
    decide,
    flag_nonfinite,
    only_nonfinite,
    outcome_limit,
    refused_text,
)
from ncclguard.recovery._commit.tier import forget_commit, settle_commit, tier_of, tier_peek
from ncclguard.recovery._numerics.drift import ReplicaDrift, only_drift
from ncclguard.recovery._numerics.findings import BucketFinding, NumericsSaid
from ncclguard.recovery.preempt import stop_requested
from ncclguard.results import Result
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.codec import decode_each, decode_outcome, encode
from ncclguard.store.deaths import DeathWatch
from ncclguard.store.rounds import GRACE_S, Members, Peek, Rule, settle_round
from ncclguard.store.values import delete_keys
from ncclguard.watching.base.metrics import count_commit
from ncclguard.world import Slot, World, WorldChange, current_world, subscribe

if TYPE_CHECKING:
    from ncclguard.collectives.groups import GroupInfo

__all__ = ["CommitResult", "committed_step", "note_point_to_point", "should_commit"]


@dataclass
class CommitResult(Result):
    """The outcome of one step's commit on this rank; truthy when the step may be applied.

    Attributes:
        ok: every rank of the group arrived in time with a clean step, and they agree.
        step: this commit's number in the current world (0 for the first; a new world restarts).
        generation: the world generation the commit was held in.
        failed_ranks: group ranks that failed the step or did not arrive (sorted; the same on every rank).
        reasons: why, by failed rank (the same on every rank).
        late: this rank's statement was not in the store when the outcome was settled.
        early: settled before the deadline: the ranks missing were known dead (their launcher
            posted their death, :mod:`ncclguard.store.deaths`), so nobody waited for them.
        elapsed_s: seconds from entry to return.
        error: a :class:`~ncclguard.errors.CommitFailed` when not ``ok``, else None.
        stop: a rank was asked to stop (SIGTERM): every rank stops after this step
            (:mod:`ncclguard.recovery.preempt`); the same on every rank.
        generators_apart: by generator name, the ranks whose generator differs from most ranks'
            (ranks seeded apart), where the recovery engine stated them; the same on every rank.
        nonfinite: by rank, the gradient buckets that held a NaN or an infinity before the
            reduction, where the recovery engine's check stated them (docs/numerics.md); those
            ranks are in ``failed_ranks`` too. The same on every rank.
        finite_ranks: the ranks whose checked gradient was finite.
        drift: the ranks whose replica digest differs from the majority's (docs/numerics.md); None: none.
    """

    ok: bool
    step: int
    generation: int
    failed_ranks: list[int] = field(default_factory=list)
    reasons: dict[int, list[str]] = field(default_factory=dict)
    late: bool = False
    elapsed_s: float = 0.0
    error: CommitFailed | None = None
    early: bool = False
    stop: bool = False
    generators_apart: dict[str, list[int]] = field(default_factory=dict)
    nonfinite: dict[int, list[BucketFinding]] = field(default_factory=dict)
    finite_ranks: list[int] = field(default_factory=list)
    drift: ReplicaDrift | None = None

    @property
    def only_nonfinite(self) -> bool:
        """The step failed for non-finite gradients alone: the world is fine, the values are not."""
        return not self.ok and only_nonfinite(self.reasons, self.nonfinite)

    @property
    def only_drift(self) -> bool:
        """The step failed for drifted replicas alone: heal them from the majority, not the world."""
        return not self.ok and only_drift(self.reasons, self.drift, self.nonfinite)


class _Commits:
    """This world's commits on this rank: the count, and since when problems count.

    Attributes:
        lock: held while a commit runs (a second thread is refused, never queued).
        n: the next commit's number.
        since: ``time.time()`` of the last commit's statement; problems from then on count. The
            world the job started with counts every problem; a rebuilt world those from its start.
        user_step: the step number the caller passed last, or None.
        committed: the number of the last commit that settled ok, or None.
    """

    def __init__(self, world: World) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.since = time.time() if world.generation > 0 else 0.0
        self.user_step: int | None = None
        self.committed: int | None = None


_COMMITS: Slot[_Commits] = Slot("commits", _Commits)


def _start_counting(change: WorldChange) -> None:
    # Built at the announcement, so a rebuilt world counts the problems from its start.
    change.new.get(_COMMITS)


subscribe(_start_counting)


def committed_step() -> int | None:
    """The number of the last step whose commit settled ok in this world, or None.

    Returns:
        The step (``CommitResult.step``), or None before the first.
    """
    return current_world().get(_COMMITS).committed


def _check_arguments(
    timeout: float | timedelta | None, step: int | None, failure: str | BaseException | None
) -> float | None:
    seconds = None if timeout is None else to_seconds(timeout, "timeout")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise TypeError(f"should_commit's step must be a non-negative int (your loop's step), got {step!r}")
    if failure is not None and not isinstance(failure, str | BaseException):
        raise TypeError(
            f"should_commit's failure must be a str or an exception (what went wrong here), got {type(failure).__name__}"
        )
    return seconds


def _live_group(group: dist.ProcessGroup | None) -> GroupInfo | None:
    """The group's description; refuses a group torch no longer knows (an abandoned world's)."""
    if group is not None and group is not dist.group.WORLD and dist.is_initialized():
        if group not in compat.group_names():
            raise ValueError(
                f"should_commit was given a process group of an abandoned world (this rank is in world "
                f"generation {current_world().generation} now); pass the group made in this world, or None"
            )
    return group_info(group)


def _problems(info: GroupInfo | None, since: float, failure: str | BaseException | None) -> list[str]:
    """What went wrong on this rank since ``since``, in words (at most MAX_PROBLEMS)."""
    found: list[str] = []
    if failure is not None:
        text = failure if isinstance(failure, str) else f"{type(failure).__name__}: {failure}"
        found.append(f"the caller reported: {text}")
    said = set()  # a failed safe_* call marks its group with the same error: said once
    if info is not None:
        mark = failure_of(info.group)
        if mark is not None:
            found.append(f"group {info.name!r} failed ({type(mark).__name__}: {mark})")
            said.add((str(mark) or type(mark).__name__)[:500])
    for rec in recorder.records():
        if rec.state == "failed" and (rec.end or rec.start) >= since and rec.error not in said:
            found.append(f"{rec.op} on group {rec.group!r} (call {rec.seq}) failed: {rec.error}")
    # Only a rung that acted (raise, abort, fence, exit, your own) can have touched the step: an
    # incident that was only reported (a busy rank past a learned hang bound) fails nothing.
    by_incident: dict[str, list[ActedRung]] = {}
    for rung in acted.since(since):
        by_incident.setdefault(rung.incident, []).append(rung)
    for ident, rungs in by_incident.items():
        names = ", ".join(r.rung for r in rungs)
        found.append(f"the watchdog raised incident {ident} ({rungs[0].kind}) and took {names}")
    if len(found) > MAX_PROBLEMS:
        found[MAX_PROBLEMS - 1 :] = [f"and {len(found) - MAX_PROBLEMS + 1} more problem(s)"]
    return [clip(p) for p in found]


def _rule(
    store: dist.Store, info: GroupInfo, generation: int, step: int, timeout_s: float, peek: Peek | None = None
) -> Rule[CommitOutcome]:
    keys = commit_keys(info.name, generation, step)
    size = info.size
    statements = peek or Peek(store, keys, size)  # the settling rank reads them; nobody else does
    watch = _known_dead(store, info, size)
    known = watch.look if watch is not None else None

    def statements_of(raw: dict[int, bytes]) -> dict[int, CommitStatement | None]:
        return decode_each(CommitStatement, raw, "commit statement", MAX_STATEMENT_BYTES, "should_commit")

    def everyone() -> str:
        return encode(decide(statements_of(statements.arrivals(complete=True)), size, step, timeout_s))

    def given_up(peek: Peek) -> str:
        dead = known() if known is not None else None
        return encode(decide(statements_of(peek.arrivals()), size, step, timeout_s, dead))

    def read(raw: bytes) -> CommitOutcome:
        return decode_outcome(CommitOutcome, raw, "the commit outcome", keys.outcome, outcome_limit(size))

    def early(peek: Peek) -> str | None:
        assert known is not None  # given to the rule only then
        dead = known()
        if not dead or peek.count() + len(dead) < size:
            return None
        present = peek.present()
        if any(r not in present for r in range(size) if r not in dead):
            return None  # a live rank is still on its way
        said = statements_of(peek.arrivals(present))
        return encode(decide(said, size, step, timeout_s, dead, early=True))

    # No members: only the settling rank reads the statements, and the keys stay until the next
    # round that every rank reached (see _forget), so a late rank still finds the outcome.
    return Rule(
        everyone=everyone,
        given_up=given_up,
        read=read,
        members=lambda v: Members((), True),
        early=early if known is not None else None,
    )


def _known_dead(store: dist.Store, info: GroupInfo, size: int) -> DeathWatch | None:
    """For a commit on the world group: a watch of the job's death notices posted since this world
    was made (:mod:`ncclguard.store.deaths`), ``{group rank: how it is known}``; None elsewhere (a
    subgroup's ranks are not mapped to launch ranks)."""
    world = current_world()
    if not dist.is_initialized() or info.group is not compat.default_group() or world.size not in (None, size):
        return None
    return DeathWatch(store, world.deaths_seen, {r: world.origin(r) for r in range(size)}, info.rank)


def should_commit(
    *,
    timeout: float | timedelta | None = None,
    group: dist.ProcessGroup | None = None,
    step: int | None = None,
    failure: str | BaseException | None = None,
) -> CommitResult:
    """Asks every rank of ``group`` whether this step was clean everywhere; all get the same answer.

    Call it once per step on every rank, after backward and before ``optimizer.step()``::

        loss.backward()
        if ncclguard.should_commit():
            optimizer.step()
        else:
            ...  # recover: rebuild_world, restore the step's state, redo it

    Args:
        timeout: seconds (or a timedelta) to wait for the other ranks. Default:
            ``Config.barrier_timeout_s`` capped below the group's timeout. A rank that comes after
            the others gave up reads their outcome (falsy, naming it) and is ``late``.
        group: the process group whose ranks commit together (default: the world group).
        step: your loop's step number, if you want it checked: the same on every rank, and
            above the one passed last (else ValueError, before any communication).
        failure: what went wrong on this rank (an exception caught in the step, a NaN loss): the
            step fails on every rank, with this rank named.

    Returns:
        A :class:`CommitResult`, truthy when the step may be applied on every rank; its ``stop``
        says a rank was asked to stop (SIGTERM under a recovery engine), the same on every rank.

    Raises:
        TypeError, ValueError: bad arguments, a ``step`` not above the last one, or a group of an
            abandoned world; raised before any communication.
        RuntimeError: another thread of this process is in should_commit.
        StoreUnreachable: the group's store did not answer (its host is gone); no outcome exists.
    """
    start = time.monotonic()
    timeout_s = _check_arguments(timeout, step, failure)
    world = current_world()
    state = world.get(_COMMITS)
    if not state.lock.acquire(blocking=False):
        raise RuntimeError("should_commit is already running in another thread of this process; call it once per rank")
    try:
        if step is not None and state.user_step is not None and step <= state.user_step:
            raise ValueError(
                f"should_commit was called for step={step} after step={state.user_step}: once per step, and the "
                "step must grow"
            )
        info = _live_group(group)
        n, since, now = state.n, state.since, time.time()
        problems = _problems(info, since, failure)
        generators = generators_noted()  # taken whatever the path: a note is for this commit only
        numerics, replicas = numerics_noted(), replicas_noted()
        # Counted before the round: a round that raised (the store gone) is not met again.
        state.n, state.since = n + 1, now
        if step is not None:
            state.user_step = step
        no_group = no_group_reason() if info is None else None
        if no_group is not None:  # committing alone would let each member train on by itself
            outcome, late = _no_group(world, n, no_group, problems), False
        elif info is None:  # a world of one: no one to agree with
            outcome, late = _alone(n, problems, numerics), False
        else:
            outcome, late = _agree(
                info, world.generation, n, step, (problems, generators, numerics, replicas), start, timeout_s
            )
        if outcome.ok:
            state.committed = n
        count_commit(outcome.ok)
    finally:
        state.lock.release()
    return _result(outcome, world.generation, late, time.monotonic() - start, info.rank if info else world.rank, step)


def _alone(n: int, problems: list[str], numerics: NumericsSaid | None) -> CommitOutcome:
    """The outcome of a world of one: what went wrong here, the gradient's values included."""
    failed = {0: problems} if problems else {}
    nonfinite, finite = flag_nonfinite({0: numerics}, failed)
    return CommitOutcome(
        ok=not failed, step=n, arrived=[0], failed=failed, stop=stop_requested(), nonfinite=nonfinite, finite=finite
    )


def _no_group(world: World, n: int, why: str, problems: list[str]) -> CommitOutcome:
    """The outcome, without any communication, in a world whose rebuild failed its handshake: no
    member has a group (a full mesh fails for all when one fails), so every member is named."""
    failed = {r: [why] for r in range(world.size or 1)}
    failed[world.rank or 0] = [why, *problems]
    return CommitOutcome(ok=False, step=n, arrived=[], failed=failed, stop=stop_requested())


def _agree(
    info: GroupInfo,
    generation: int,
    n: int,
    step: int | None,
    said: tuple[list[str], dict[str, str], NumericsSaid | None, dict[str, str]],
    start: float,
    timeout_s: float | None,
) -> tuple[CommitOutcome, bool]:
    """This rank's statement of commit ``n`` (what it saw, where its group's sequence stands), and
    the outcome every rank of ``info``'s group settles on.

    Args:
        info: the live group.
        generation: the world's generation.
        n: the commit's number in this world.
        step: the caller's step number, or None.
        said: what went wrong on this rank since its last commit, the generators' digests the
            engine noted for it (:func:`~ncclguard.recovery._commit.said.note_generators`), and
            what its numerical check saw (:func:`~ncclguard.recovery._commit.said.note_numerics`), its
            replica's digests (:func:`~ncclguard.recovery._commit.said.note_replicas`).
        start: ``time.monotonic()`` at the commit's entry (its deadline counts from there).
        timeout_s: the caller's bound, or None for the default.

    Returns:
        The settled outcome, and whether this rank came late.

    Raises:
        StoreUnreachable: the group's store did not answer.
    """
    if timeout_s is None:
        timeout_s = default_deadline(get_config().barrier_timeout_s, group_timeout_s(info.group))
    problems, generators, numerics, replicas = said
    statement = CommitStatement(
        rank=info.rank,
        step=n,
        user_step=step,
        generation=generation,
        group=info.name,
        group_size=info.size,
        seq=sequence(info.group, info.name),
        other_seqs=other_sequences(info),
        p2p_groups=p2p_groups(),
        problems=problems,
        stop=stop_requested(),
        generators=generators,
        numerics=numerics,
        replicas=replicas,
    )
    return _settle(info, generation, n, statement, Deadline(start + timeout_s), timeout_s)


def _settle(
    info: GroupInfo, generation: int, n: int, statement: CommitStatement, deadline: Deadline, timeout_s: float
) -> tuple[CommitOutcome, bool]:
    """Runs the commit round; returns the settled outcome and whether this rank came late."""
    keys = commit_keys(info.name, generation, n)
    try:
        store = store_for_this_thread(cast("dist.Store", info.store), deadline)
        tier = tier_of(info, current_world(), timeout_s, deadline)
        if tier is None:
            rule = _rule(store, info, generation, n, timeout_s)
            what, text = f"commit {n} on group {info.name!r}", encode(statement)
            outcome = settle_round(store, keys, info.rank, info.size, text, deadline, rule, what).outcome
        else:  # through the node tier (docs/scale.md): the node's ranks first, one carrier a node
            peek = tier_peek(store, keys, tier[0], MAX_STATEMENT_BYTES)
            rule, watch = _rule(store, info, generation, n, timeout_s, peek), _known_dead(store, info, info.size)
            known = (lambda: watch.look_within(deadline)) if watch is not None else None
            outcome = settle_commit(store, keys, tier, n, encode(statement), deadline, timeout_s, rule, peek, known)
    except (DistStoreError, RuntimeError) as exc:  # connection refused / reset surface as RuntimeError
        if isinstance(exc, StoreUnreachable):
            raise
        raise StoreUnreachable(f"the group's store did not answer during commit {n}: {exc}") from exc
    if n > 0 and len(outcome.arrived) == info.size:
        if tier is None:
            _forget(store, info, generation, n - 1, deadline.plus(GRACE_S))
        else:
            forget_commit(store, commit_keys(info.name, generation, n - 1), tier, n - 1, deadline.plus(GRACE_S))
    return outcome, info.rank not in outcome.arrived


def _forget(store: dist.Store, info: GroupInfo, generation: int, n: int, deadline: Deadline) -> None:
    """Deletes round ``n``'s keys, once round ``n + 1`` was settled with every rank in it: every
    rank has left round ``n`` then. Each rank deletes its own statement, rank 0 the rest, after
    its round, so the deletes are spread over the ranks and off the settling rank's path. Bounded
    by what is left of the commit's deadline (plus the round's grace), as the round was: a bound
    shorter than the store's answer under load would leave the store refused to the next round."""
    keys = commit_keys(info.name, generation, n)
    mine = [keys.arrival(info.rank), *((keys.count, keys.gone, keys.outcome) if info.rank == 0 else ())]
    try:  # bounded: a store whose host is cut off never answers
        delete_keys(store, mine, deadline, f"clean-up of commit {n}")
    except (DistStoreError, RuntimeError) as exc:  # the outcome stands; the keys only stay
        log.info("should_commit: the keys of commit %d stay in the store (%s)", n, exc)


def _result(
    outcome: CommitOutcome, gen: int, late: bool, elapsed_s: float, rank: int | None, step: int | None
) -> CommitResult:
    failed = sorted(outcome.failed)
    error = None
    if not outcome.ok:
        first = failed[0] if failed else rank or 0
        # A NaN or a drifted replica alone leaves the world whole: the engine says what it does (info here).
        values = only_nonfinite(outcome.failed, outcome.nonfinite) or only_drift(
            outcome.failed, outcome.drift, outcome.nonfinite
        )
        error = CommitFailed(
            refused_text(outcome, gen, step, first, late, values),
            step=outcome.step,
            failed_ranks=failed,
            reasons=dict(outcome.failed),
            late=late,
        )
        log.log(logging.INFO if values else logging.WARNING, "%s", error)
    return CommitResult(
        ok=outcome.ok,
        step=outcome.step,
        generation=gen,
        failed_ranks=failed,
        reasons={r: list(v) for r, v in outcome.failed.items()},
        late=late,
        elapsed_s=elapsed_s,
        error=error,
        early=outcome.early,
        stop=outcome.stop,
        generators_apart={k: list(v) for k, v in outcome.generators_apart.items()},
        nonfinite={r: list(v) for r, v in outcome.nonfinite.items()},
        finite_ranks=list(outcome.finite),
        drift=outcome.drift,
    )
