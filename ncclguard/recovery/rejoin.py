"""rejoin_world: a process restarted after its rank died takes that rank's place at the live
ranks' next rebuild.

The survivors notice the death (their step fails: gloo says "Connection closed by peer"), their
commit fails and they call :func:`~ncclguard.recovery.rebuild.rebuild_world`. The restarted process
reads the job's current world from the store (:class:`~ncclguard.recovery._rebuild.meeting.WorldRecord`;
none yet: generation 0, ranks ``0..WORLD_SIZE-1``), finds the rank its launch rank holds there,
and arrives at the survivors' meeting as that rank, flagged ``rejoined``. The meeting then sees
everyone and the new world has the old size and the old numbering (the newcomer in its old
place), so a DDP all_reduce sums in the same order as before the death. Then it builds the new
group with the others. It holds no training state: :func:`ncclguard.heal_from_peer` copies it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import DistStoreError

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import HOSTNAME
from ncclguard.deadlines import Deadline, to_seconds
from ncclguard.errors import DecodeError, RebuildFailed, StoreUnreachable
from ncclguard.recovery._commit.tier import meeting_place
from ncclguard.recovery._rebuild import stand_in
from ncclguard.recovery._rebuild.meeting import (
    MAX_OUTCOME_BYTES,
    Arrival,
    Meeting,
    MeetingKeys,
    MeetingOutcome,
    WorldRecord,
    deaths_before,
    dense_rank_map,
    forget_meeting,
    handshake_timeout,
    meet,
    world_prefix,
)
from ncclguard.recovery._rebuild.restarts import RESTART_COUNT_VAR, restart_count
from ncclguard.recovery.rebuild import _ORIGIN, RebuildResult
from ncclguard.store.clients import connect, job_address
from ncclguard.store.values import read_value
from ncclguard.store.world_record import read_world_record, wait_world_record
from ncclguard.world import World, announce

__all__ = ["RESTART_COUNT_VAR", "rejoin_world", "restart_count"]

_lock = threading.Lock()


def _connect(timeout_s: float) -> dist.Store:
    address = job_address()
    if address is None:
        raise ValueError(
            "rejoin_world needs the job's store: pass store=, or run under a launcher that sets MASTER_ADDR and "
            f"MASTER_PORT (got MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')!r})"
        )
    return connect(*address, timeout_s)


def _live_attempt(store: dist.Store, generation: int, deadline: Deadline) -> tuple[int, MeetingOutcome | None]:
    """The first attempt toward ``generation`` with no outcome yet, and the last settled outcome."""
    attempt, last = 0, None
    while True:
        key = MeetingKeys(generation, attempt).outcome
        try:
            found = read_value(store, key, MeetingOutcome, MAX_OUTCOME_BYTES, deadline, "a rebuild outcome")
        except DecodeError as exc:
            raise StoreUnreachable(f"a rebuild outcome of generation {generation} cannot be read: {exc}") from exc
        if found is None:
            return attempt, last
        last, attempt = found, attempt + 1


def _failure(start: float, message: str, missing: list[int] | None = None, late: bool = False) -> RebuildResult:
    log.error("rejoin_world: %s", message)
    return RebuildResult(
        ok=False,
        generation=0,
        rank=-1,
        world_size=0,
        missing_ranks=list(missing or []),
        elapsed_s=time.monotonic() - start,
        late=late,
        error=RebuildFailed(message, missing_ranks=missing, late=late),
    )


def rejoin_world(
    *,
    timeout: float | timedelta = 60.0,
    rank: int | None = None,
    backend: str = "gloo",
    store: dist.Store | None = None,
) -> RebuildResult:
    """Joins the live ranks at their next rebuild, in a process restarted after its rank died.

    Call it instead of ``init_process_group`` in the restarted process (``RecoveringStep(...,
    heal=True)`` does when ``NCCLGUARD_RESTART_COUNT`` is above 0), then receive the training
    state with :func:`ncclguard.heal_from_peer`. It waits until the survivors rebuild (their
    failed commit makes them), takes the place of its launch rank, and builds the new default
    group with them: afterwards ``dist.get_rank()`` and ``dist.get_world_size()`` are the new
    world's, as on every other rank.

    Args:
        timeout: seconds (or a timedelta) to wait for the survivors' rebuild and to build the group.
        rank: this process's launch rank (its rank in generation 0); default ``RANK``.
        backend: the backend when the job's world is still generation 0 (no world record yet);
            afterwards the record's is used.
        store: the job's store; default a client of ``MASTER_ADDR:MASTER_PORT`` (under torchrun
            the agent's store, under :func:`ncclguard.testing.launch.spawn` rank 0's).

    Returns:
        A :class:`~ncclguard.recovery.rebuild.RebuildResult`, truthy when this process is in the
        new world; ``joined_ranks`` names the restarted ranks in it, this one included. Falsy
        with ``error`` when no rebuild admitted it by ``timeout``, when the world went on without
        its launch rank (a shrink: joining as an extra rank is not supported), or when the store
        or the handshake failed.

    Raises:
        TypeError, ValueError: bad arguments, a process group already initialized, or no store to
            reach; raised before any communication.
        RuntimeError: another thread is already rejoining.
    """
    timeout_s = to_seconds(timeout, "timeout")
    if rank is None:
        raw = os.environ.get("RANK", "")
        if not raw.isdigit():
            raise ValueError(f"rejoin_world needs this process's launch rank: pass rank= or set RANK (got {raw!r})")
        rank = int(raw)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be the launch rank, an int >= 0, got {rank!r}")
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a backend name such as 'gloo', got {backend!r}")
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "rejoin_world is for a restarted process that has no process group; this one has one: "
            "call rebuild_world on every rank instead"
        )
    if not _lock.acquire(blocking=False):
        raise RuntimeError("rejoin_world is already running in another thread of this process")
    try:
        start = time.monotonic()
        deadline = Deadline(start + timeout_s)
        if store is None:
            store = _connect(timeout_s)
        try:
            return _rejoin(store, rank, backend, start, deadline, timeout_s)
        except (StoreUnreachable, DistStoreError, RuntimeError) as exc:  # reset/refused is a RuntimeError
            return _failure(start, f"the job's store failed while rejoining: {exc}")
    finally:
        _lock.release()


def _rejoin(
    store: dist.Store, origin: int, backend: str, start: float, deadline: Deadline, timeout_s: float
) -> RebuildResult:
    size_env = os.environ.get("WORLD_SIZE", "")
    while True:
        rec = read_world_record(store, deadline)
        if rec is None:  # the job's first world: the launch numbering
            if not size_env.isdigit() or int(size_env) < 1:
                raise ValueError(f"rejoin_world needs WORLD_SIZE before the first rebuild (got {size_env!r})")
            rec = WorldRecord(generation=0, origins=list(range(int(size_env))), backend=backend, timeout_s=600.0)
        slot = rec.rank_of(origin)
        if slot is None:
            return _failure(
                start,
                f"launch rank {origin} is not a member of world generation {rec.generation} (ranks launched as "
                f"{rec.origins}): the others went on without it, and joining as an extra rank is not supported; "
                "exit 0 and let the job finish without it",
            )
        target = rec.generation + 1
        attempt, settled = _live_attempt(store, target, deadline)
        if settled is not None and settled.ok:
            # That generation was agreed without this process: wait for its record, then meet next.
            if wait_world_record(store, target, deadline) is None:
                return _failure(start, f"generation {target} was agreed without this rank and never recorded")
            continue
        me = Arrival(
            rank=slot,
            world_size=len(rec.origins),
            generation=rec.generation,
            backend=rec.backend,
            allow_shrink=False,
            host=HOSTNAME,
            pid=os.getpid(),
            origin=origin,
            rejoined=True,
        )
        log.warning(
            "rejoin_world: launch rank %d waits to rejoin as rank %d toward generation %d (attempt %d)",
            origin,
            slot,
            target,
            attempt,
        )
        meeting = meet(store, me, attempt, deadline, meeting_place(rec.origins, slot, timeout_s, deadline))
        if meeting.goes_on:
            return _build(store, rec, meeting, slot, origin, start, deadline, timeout_s)
        if deadline.passed():
            missing = meeting.outcome.missing(len(rec.origins))
            return _failure(
                start,
                f"no rebuild admitted launch rank {origin} within {timeout_s:g} s (last meeting: ranks "
                f"{meeting.outcome.arrived} arrived, {missing} missing)",
                missing,
                meeting.late,
            )
        # The others gave up on someone, or went on just before this arrival: meet again.


def _build(
    store: dist.Store,
    rec: WorldRecord,
    meeting: Meeting,
    slot: int,
    origin: int,
    start: float,
    deadline: Deadline,
    timeout_s: float,
) -> RebuildResult:
    members = meeting.outcome.arrived
    rank_map = dense_rank_map(members)
    rejoined = set(meeting.rejoined())
    joined = [rank_map[r] for r in members if r in rejoined]
    target = rec.generation + 1
    if len(joined) == len(members):
        # No survivor among them: nobody holds the training state to heal from, and nobody records
        # the new world (a survivor's rebuild does), so waiting for that record would only time out.
        return _failure(
            start,
            f"every member of generation {target} is a restarted process (launch ranks "
            f"{sorted(meeting.origins())}): no survivor holds the "
            "training state to heal from; the job cannot go on from memory: resume it from its last checkpoint",
        )
    new_rec = wait_world_record(store, target, deadline)  # the survivors record it before connecting
    if new_rec is None or new_rec.generation != target:
        return _failure(start, f"the survivors did not record generation {target} by the deadline")
    new = World(
        generation=target,
        rank=rank_map[slot],
        size=len(members),
        rank_map=rank_map,
        left_out=tuple(r for r in range(len(rec.origins)) if r not in rank_map),
        joined=tuple(joined),
        origins=tuple(new_rec.origins),
        deaths_seen=deaths_before(store, deadline),
        backend=new_rec.backend,
        store=store,
        timeout=timedelta(seconds=new_rec.timeout_s),
    )
    _ORIGIN.rank = origin
    announce(new)
    handshake_s = handshake_timeout(timeout_s, deadline.left())
    try:
        stand_in.torch_init_process_group(
            new_rec.backend,
            store=dist.PrefixStore(world_prefix(target), store),
            rank=rank_map[slot],
            world_size=len(members),
            timeout=timedelta(seconds=handshake_s),
        )
    except Exception as exc:  # noqa: BLE001 - any handshake failure becomes a result
        compat.destroy_world_quietly()  # torch counted the failed group's name: the next try names it anew
        return _failure(start, f"the new group of generation {target} could not be built ({exc})")
    pg = compat.default_group()
    new.group = weakref.ref(pg)
    compat.set_group_timeout(pg, timedelta(seconds=new_rec.timeout_s))
    del pg
    forget_meeting(store, meeting, Deadline.within(max(deadline.left(), 1.0)))  # its members all left it
    result = RebuildResult(
        ok=True,
        generation=target,
        rank=rank_map[slot],
        world_size=len(members),
        rank_map=rank_map,
        missing_ranks=list(new.left_out),
        elapsed_s=time.monotonic() - start,
        joined_ranks=joined,
    )
    log.warning(
        "rejoin_world: launch rank %d is rank %d of %d in generation %d, in %.3f s",
        origin,
        result.rank,
        result.world_size,
        target,
        result.elapsed_s,
    )
    return result
