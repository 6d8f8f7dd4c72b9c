"""rebuild_world: the live ranks of a failed job meet, drop the failed world group, and build a
new one in the same process, so training goes on without a restart.

Steps (docs/reference/recovery-mechanism.md has the long form):

1. the arguments are checked, before any communication;
2. the ranks meet in the job's store (:mod:`ncclguard.recovery._rebuild.meeting`); without every rank
   there (and without ``allow_shrink``) the call returns a falsy result and nothing changes;
3. every group of the old world is abandoned: torch forgets them (``destroy_process_group``, which
   does not wait while ncclguard still holds the groups) and the reaper releases them off this
   thread (:mod:`ncclguard.recovery._rebuild.reaper`), so no rank ever waits on a dead or stalled peer;
4. a new :class:`~ncclguard.world.World` is announced: the members renumbered densely, every
   part's per-world state (failure marks, round counts, flight records) fresh, and the subscribers
   (the watchdog) told (``"announced"``); a new default group of the same backend is built on a
   fresh prefix of the job's store, and the subscribers of ``"rebuilt"`` are told
   (:func:`ncclguard.world.subscribe`, the one hook of a world change). A rank that came too late
   tells those of ``"left_out"`` instead.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import HOSTNAME, rank_ranges
from ncclguard.deadlines import Deadline
from ncclguard.errors import RebuildFailed, StoreUnreachable
from ncclguard.recovery._commit.tier import meeting_place
from ncclguard.recovery._rebuild import stand_in
from ncclguard.recovery._rebuild.meeting import (
    Arrival,
    Meeting,
    deaths_before,
    dense_rank_map,
    forget_meeting,
    handshake_timeout,
    meet,
    record_new_world,
    validate_arguments,
    world_prefix,
)
from ncclguard.recovery._rebuild.reaper import reaper
from ncclguard.results import Result
from ncclguard.store.clients import unprefixed
from ncclguard.store.values import delete_prefix
from ncclguard.world import Slot, World, WorldChange, announce, current_world, notify

__all__ = ["RebuildResult", "generation", "origin_rank", "rebuild_for_step", "rebuild_world"]


@dataclass
class RebuildResult(Result):
    """The outcome of :func:`rebuild_world` on this rank; truthy when this rank is in a new world.

    Attributes:
        ok: a new default group was built and this rank is a member.
        generation: the world's generation now (0 before any rebuild; unchanged on failure).
        rank: this rank in the world it is in now (unchanged on failure).
        world_size: the size of that world.
        rank_map: old rank to new rank, for every member of the new world (empty on failure).
        missing_ranks: old ranks that had not arrived: left out of the new world, or the reason
            it was not built (sorted).
        elapsed_s: seconds from entry to return.
        late: this rank arrived after the others had settled without it; it is in no world now
            and should end (its peers went on, or gave up, without it).
        error: why it failed (a :class:`~ncclguard.errors.RebuildFailed`), or None.
        joined_ranks: ranks of the new world taken by restarted processes
            (:func:`ncclguard.rejoin_world`): they hold no state until healed
            (:func:`ncclguard.heal_from_peer`, which ``RecoveringStep(heal=True)`` calls).
    """

    ok: bool
    generation: int
    rank: int
    world_size: int
    rank_map: dict[int, int] = field(default_factory=dict)
    missing_ranks: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    late: bool = False
    error: RebuildFailed | None = None
    joined_ranks: list[int] = field(default_factory=list)


class _Attempts:
    """Meetings this rank has called toward the next generation (a late rank's next call meets in
    the next attempt, like everyone else's)."""

    def __init__(self, world: World) -> None:
        self.n = 0


_ATTEMPTS: Slot[_Attempts] = Slot("rebuild attempts", _Attempts)


class _Origin:
    """This process's launch rank: its rank in generation 0, the same whatever the rebuilds
    renumber (a restarted process's is the rank it was launched as). A fact of the process, not
    of one world."""

    def __init__(self) -> None:
        self.rank: int | None = None


_ORIGIN = _Origin()
# Held while this process rebuilds: one rebuild at a time, whatever its world.
_lock = threading.Lock()


def origin_rank() -> int | None:
    """This process's launch rank (its rank in generation 0), once known: after the first
    rebuild or ``RecoveringStep(heal=True)``, or in a process that rejoined."""
    return _ORIGIN.rank


def generation() -> int:
    """The generation of this process's world: 0 until a rebuild succeeds, then 1, 2, ..."""
    return current_world().generation


def _job_store(store: dist.Store) -> dist.Store:
    # the meeting and every generation live under the job's store, the same on every rank
    return unprefixed(store)


def _collective_timeout(pg: dist.ProcessGroup) -> timedelta:
    """The timeout of ``pg``'s collectives, read from its CPU backend, else its CUDA one (NCCL)."""
    for device in ("cpu", "cuda"):
        try:
            return compat.backend_timeout(pg, torch.device(device))
        except RuntimeError:  # no backend for that device (TorchCompatError is one too)
            continue
    log.warning("rebuild_world: could not read the world group's timeout; the new world gets 10 min")
    return timedelta(minutes=10)


def _current_world() -> World:
    """The world to rebuild, with what a rebuild needs of it known: the one ncclguard built last,
    or the default group torch has now (learnt into the current world).

    Raises:
        ValueError: there is no process group and no earlier rebuild.
    """
    world = current_world()
    if dist.is_available() and dist.is_initialized():
        pg = compat.default_group()
        if world.group is None or world.group() is not pg:
            # A world we did not build (the first one, or one the user made): learn it.
            learned = World(
                generation=world.generation,
                rank=dist.get_rank(),
                size=dist.get_world_size(),
                backend=str(dist.get_backend(pg)),
                store=_job_store(compat.default_store()),
                timeout=_collective_timeout(pg),
                group=weakref.ref(pg),
            )
            if world.generation == 0 and _ORIGIN.rank is None:
                _ORIGIN.rank = learned.rank  # the launch rank: what a restart of this process keeps
            if world.group is None:
                # The world ncclguard has known since import: what it holds is of this group.
                world.rank, world.size, world.backend = learned.rank, learned.size, learned.backend
                world.store, world.timeout, world.group = learned.store, learned.timeout, learned.group
            else:  # the user replaced the group ncclguard built: a world of its own, state and all
                world = announce(learned).new
        return world
    if world.store is None:
        raise ValueError(
            "rebuild_world has no world to rebuild: no default process group is initialized. Call "
            "torch.distributed.init_process_group (or ncclguard.init_process_group) first."
        )
    return world  # an earlier handshake failed; meet again as that world's members


def _abandon(world: World) -> None:
    """Makes torch and ncclguard forget every group of ``world`` without waiting on any peer.

    Args:
        world: the old world (its backend, and its collective timeout: by then every op it still
            ran has ended).
    """
    backend, timeout = world.backend or "gloo", world.timeout or timedelta(minutes=10)
    if not (dist.is_available() and dist.is_initialized()):
        return
    # Held while torch lets go of them: their destructors then run on the reaper's thread.
    abandoned = list(compat.group_names())
    if backend != "gloo":
        # NCCL: a hung op ends only when its communicator is aborted (untested here: no GPU).
        # On gloo abort() does not end an op in flight, and the reaper handles the wait instead.
        _, failed = compat.abort_all_groups()
        if failed:
            log.warning("rebuild: aborting the old groups: %s", "; ".join(failed))
    compat.destroy_world_quietly()  # a rebuild is no end: the store's host tells nobody
    # ncclguard's own references to the old groups and what it counted on them.
    world.retire()  # its per-world state (group states, plans, buffers) holds no group past here
    compat.rebind_group_defaults(abandoned)
    reaper.bury(abandoned, hold_s=timeout.total_seconds() + 5.0, label=f"{backend} process group")
    del abandoned


def _forget_generation(store: dist.Store, gen: int, deadline: Deadline) -> int:
    """Deletes the keys torch and ncclguard wrote under generation ``gen``'s prefix (every member
    has left it), so that rebuilds do not grow the store. Returns the count deleted."""
    try:
        return delete_prefix(store, world_prefix(gen) + "/", deadline, f"the keys of generation {gen}")
    except (RuntimeError, AttributeError) as exc:  # a store without list_keys: the keys stay
        log.info("rebuild_world: the keys of generation %d stay in the store (%s)", gen, exc)
        return 0


def _failed(world: World, start: float, missing: list[int], error: str, late: bool = False) -> RebuildResult:
    log.error("rebuild_world: %s", error)
    return RebuildResult(
        ok=False,
        generation=world.generation,
        rank=world.rank if world.rank is not None else -1,
        world_size=world.size if world.size is not None else 0,
        missing_ranks=missing,
        elapsed_s=time.monotonic() - start,
        late=late,
        error=RebuildFailed(error, missing_ranks=missing, late=late),
    )


def _outcome_error(world: World, meeting: Meeting, timeout_s: float) -> tuple[list[int], str]:
    outcome = meeting.outcome
    missing = outcome.missing(world.size or 0)
    target = world.generation + 1
    if meeting.late and outcome.ok:
        return missing, (
            f"rank {world.rank} arrived after ranks {rank_ranges(outcome.arrived)} had gone on to generation "
            f"{target} without it; this process is in no world now: save what you need and exit"
        )
    if meeting.late:
        return missing, (
            f"rank {world.rank} arrived after the others gave up waiting for ranks {rank_ranges(missing)}; "
            "nothing changed. Call rebuild_world again on every rank"
        )
    if meeting.problem is not None:
        return missing, f"the rebuild toward generation {target} was refused: {meeting.problem}"
    return missing, (
        f"ranks {missing} did not reach rebuild_world within {timeout_s:g} s; nothing changed (the old "
        "world is still the default). Call rebuild_world again on every rank, pass allow_shrink=True to go "
        "on without them, or checkpoint and exit 75 so that torchrun restarts the job"
    )


def rebuild_world(*, timeout: float | timedelta = 60.0, allow_shrink: bool = False) -> RebuildResult:
    """Replaces a failed world group with a new one of the live ranks, in this process.

    Call it on every live rank after the world group failed (a safe call's ``GroupFailed`` or
    ``CollectiveTimeout``, the watchdog's abort rung, a lost peer). Afterwards
    ``dist.get_rank()``, ``dist.get_world_size()``, plain collectives and ``safe_*`` all use
    the new group. Everything built on the old one must be made again: DDP wrappers (re-wrap;
    DDP broadcasts the parameters of the new rank 0), subgroups (``new_group``) and groups held
    by frameworks (see docs/reference/recovery-mechanism.md). The world's subscribers
    (:func:`ncclguard.world.subscribe`) are told ``"announced"`` before the new group's
    handshake, ``"rebuilt"`` once it is the default, or ``"left_out"`` when this rank came late.

    Args:
        timeout: seconds (or a timedelta) to wait for the other ranks at the meeting.
        allow_shrink: when some ranks have not arrived by ``timeout``, go on without them: the
            ranks that arrived are renumbered densely in their old order. Pass the same value
            on every rank.

    Returns:
        A :class:`RebuildResult`, truthy when this rank is in the new world. Falsy, with
        ``missing_ranks`` and ``error``, when ranks were missing (without ``allow_shrink``:
        nothing changed), when this rank came too late, or when the store or the new group's
        handshake failed.

    Raises:
        TypeError, ValueError: bad arguments, or no process group to rebuild; raised before any
            communication.
        RuntimeError: another thread of this process is already rebuilding.
    """
    return rebuild_for_step(None, timeout=timeout, allow_shrink=allow_shrink)


def rebuild_for_step(
    step: int | None, *, timeout: float | timedelta = 60.0, allow_shrink: bool = False
) -> RebuildResult:
    """:func:`rebuild_world` for a recovery engine: the same rebuild, and the subscribers'
    :class:`~ncclguard.world.WorldChange` names the step the new world redoes.

    Args:
        step: the step redone after this rebuild (``WorldChange.step``), or None.
        timeout: as :func:`rebuild_world`'s.
        allow_shrink: as :func:`rebuild_world`'s.

    Returns:
        The :class:`RebuildResult`, as :func:`rebuild_world` returns it.

    Raises:
        TypeError, ValueError: bad arguments, or no process group to rebuild; raised before any
            communication.
        RuntimeError: another thread of this process is already rebuilding.
    """
    timeout_s = validate_arguments(timeout, allow_shrink)
    if not _lock.acquire(blocking=False):
        raise RuntimeError("rebuild_world is already running in another thread of this process; call it once per rank")
    try:
        world = _current_world()
        result, now = _rebuild(world, timeout_s, allow_shrink)
    finally:
        _lock.release()
    # Outside the lock: a subscriber may read the world, or even rebuild again.
    _tell(world, now, result, step)
    return result


def _rebuild(world: World, timeout_s: float, allow_shrink: bool) -> tuple[RebuildResult, World]:
    """The rebuild of ``world``, under the process's rebuild lock: the meeting, then the new world.

    Returns:
        The result, and the world this rank is in now (the new one once it was announced, even
        when its handshake failed).
    """
    assert world.rank is not None and world.size is not None and world.backend is not None
    assert world.store is not None  # _current_world raises without one
    start = time.monotonic()
    deadline = Deadline(start + timeout_s)
    me = _arrival(world, allow_shrink)
    attempts = world.get(_ATTEMPTS)
    attempt = attempts.n
    attempts.n += 1  # late or not, the next call of every rank meets in the next attempt
    try:
        origins = [world.origin(r) for r in range(world.size)]
        tier = meeting_place(origins, world.rank, timeout_s, deadline)  # the node tier's, from 512 ranks
        meeting = meet(world.store, me, attempt, deadline, tier)
    except StoreUnreachable as exc:
        return _failed(
            world,
            start,
            [],
            f"{exc}. The store lives in torchrun's agent, or (other launchers) in rank 0's process: "
            "without it no rank can rebuild; checkpoint and exit 75",
        ), world
    if not meeting.goes_on:
        if meeting.late and meeting.outcome.ok:
            world.left_behind = True  # told here: the caller handles it, the watchdog need not fence
        missing, error = _outcome_error(world, meeting, timeout_s)
        return _failed(world, start, missing, error, late=meeting.late), world

    rank_map = dense_rank_map(meeting.outcome.arrived)
    missing = meeting.outcome.missing(world.size)
    _abandon(world)
    # From here the old world is gone: the new one is current even if its handshake fails, so
    # a later call meets as its members, and the subscribers (the watchdog) follow it now.
    new = _next_world(world, meeting, rank_map, missing, deadline)
    announce(new)
    record_new_world(world, new, deadline)
    # Every member bounds its handshake by the caller's timeout, the rank that recorded the world
    # too: a longer bound there (the world's collective timeout, 1,800 s on gloo by default) kept
    # it in the handshake long after the others had given up, and their next meeting left it out.
    handshake_s = handshake_timeout(timeout_s, deadline.left())
    handshake_end = Deadline.within(handshake_s)
    problem = _build_group(world, new, handshake_s)
    if problem is not None:
        # The members still in the handshake leave it only at its bound. A rank whose handshake
        # failed at once would reach the next meeting a whole bound before them, and its deadline
        # there could pass just as they arrive: it waits the bound out, so they meet together.
        handshake_end.sleep(handshake_end.left())
        return _failed(new, start, missing, problem), new
    forget_meeting(world.store, meeting, Deadline.within(max(deadline.left(), 1.0)))  # its members all left it
    if new.rank == 0 and world.generation >= 1:
        _forget_generation(world.store, world.generation, Deadline.within(max(deadline.left(), 1.0)))
    return RebuildResult(
        ok=True,
        generation=new.generation,
        rank=rank_map[world.rank],
        world_size=len(rank_map),
        rank_map=rank_map,
        missing_ranks=missing,
        elapsed_s=time.monotonic() - start,
        joined_ranks=list(new.joined),
    ), new


def _arrival(world: World, allow_shrink: bool) -> Arrival:
    """What this rank says of itself at the meeting (its launch rank too, for a restart to find)."""
    assert world.rank is not None and world.size is not None and world.backend is not None
    return Arrival(
        rank=world.rank,
        world_size=world.size,
        generation=world.generation,
        backend=world.backend,
        allow_shrink=allow_shrink,
        host=HOSTNAME,
        pid=os.getpid(),
        origin=_ORIGIN.rank if _ORIGIN.rank is not None else world.rank,
    )


def _next_world(
    world: World, meeting: Meeting, rank_map: dict[int, int], missing: list[int], deadline: Deadline
) -> World:
    """The world the meeting agreed on: its members renumbered densely, the restarted ones named.

    Args:
        world: the old world (abandoned by now).
        meeting: the meeting that goes on.
        rank_map: old rank to new, for every member.
        missing: the old ranks left out.
        deadline: bounds the read of the job's death count.

    Returns:
        The next :class:`~ncclguard.world.World` (not announced yet; its group not built).
    """
    assert world.rank is not None and world.store is not None
    rejoined = set(meeting.rejoined())
    return World(
        generation=world.generation + 1,
        rank=rank_map[world.rank],
        size=len(rank_map),
        rank_map=rank_map,
        left_out=tuple(missing),
        joined=tuple(rank_map[r] for r in meeting.outcome.arrived if r in rejoined),
        origins=tuple(meeting.origins()),
        deaths_seen=deaths_before(world.store, deadline),
        backend=world.backend,
        store=world.store,
        timeout=world.timeout,
    )


def _build_group(world: World, new: World, handshake_s: float) -> str | None:
    """Builds ``new``'s default group (the handshake, bounded by ``handshake_s``), with the old
    world's collective timeout.

    Returns:
        Why it could not be built, or None once it is the default group.
    """
    assert world.backend is not None and world.store is not None and new.rank is not None and new.size is not None
    try:
        stand_in.torch_init_process_group(
            world.backend,
            store=dist.PrefixStore(world_prefix(new.generation), world.store),
            rank=new.rank,
            world_size=new.size,
            timeout=timedelta(seconds=handshake_s),
        )
    except Exception as exc:  # noqa: BLE001 - any handshake failure becomes a result
        compat.destroy_world_quietly()  # torch counted the failed group's name: the next try names it anew
        return (
            f"the new group of generation {new.generation} could not be built within {handshake_s:g} s "
            f"({exc}); a member may have died meanwhile: call rebuild_world again (allow_shrink=True to "
            "go on without it)"
        )
    pg = compat.default_group()
    new.group = weakref.ref(pg)
    # The handshake bound is not the collectives' bound: they get the old world's.
    if world.timeout is not None:
        compat.set_group_timeout(pg, world.timeout)
    del pg
    return None


def _tell(old: World, now: World, result: RebuildResult, step: int | None) -> None:
    """Logs a rebuild that put this rank in a new world and tells the world's subscribers:
    ``"rebuilt"`` then, ``"left_out"`` when this rank came after the others had settled."""
    if result:
        log.warning(
            "rebuild_world: generation %d, rank %d of %d (was %d of %d)%s, in %.3f s",
            result.generation,
            result.rank,
            result.world_size,
            old.rank,
            old.size,
            (f", without ranks {rank_ranges(result.missing_ranks)}" if result.missing_ranks else "")
            + (f", restarted ranks {rank_ranges(result.joined_ranks)} joined" if result.joined_ranks else ""),
            result.elapsed_s,
        )
        notify(WorldChange(old, now, "rebuilt", step=step))
    elif result.late:
        notify(WorldChange(now, now, "left_out", step=step, error=result.error))
