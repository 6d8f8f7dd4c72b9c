"""What ncclguard knows of a process group: its name, ranks, store, backend, and whether it failed."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.errors import TorchCompatError
from ncclguard.world import Slot, World, WorldChange, current_world, subscribe

__all__ = [
    "GroupInfo",
    "GROUPS",
    "GroupTable",
    "resolve_group",
    "group_info",
    "group_timeout_s",
    "no_group_reason",
    "mark_failed",
    "failure_of",
    "clear_failure",
]

# Devices each backend can move, for the up-front check of safe_all_reduce.
BACKEND_DEVICES: dict[str, frozenset[str]] = {
    "gloo": frozenset({"cpu", "cuda"}),
    "nccl": frozenset({"cuda"}),
    "mpi": frozenset({"cpu", "cuda"}),
    "ucc": frozenset({"cpu", "cuda"}),
    "xccl": frozenset({"xpu"}),
}


@dataclass(frozen=True)
class GroupInfo:
    """A process group as ncclguard sees it from this rank."""

    # A live group (a world of one has no GroupInfo); tests build stand-ins with None, which
    # global_rank allows for.
    group: dist.ProcessGroup
    name: str
    rank: int  # this process's rank in the group
    size: int
    backend: str
    store: dist.Store | None  # the group's c10d Store (already prefixed by torch for subgroups), or None

    def global_rank(self, group_rank: int) -> int:
        """Maps a rank in this group to its global rank."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def resolve_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The process group ``group`` stands for: the default group for None or ``dist.group.WORLD``.

    Raises:
        ValueError: no process group is initialized (torch's message).
    """
    return compat.default_group() if group is None or group is dist.group.WORLD else group


def group_timeout_s(group: dist.ProcessGroup | None = None) -> float | None:
    """The timeout in force of a live process group, read from its backend's options.

    Args:
        group: a process group; default the world group.

    Returns:
        Seconds, or None when no group is initialized or torch does not expose it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = resolve_group(group)
    # torch keeps the timeout in each device backend's options (ProcessGroupGloo/NCCL::Options).
    for device in getattr(pg, "_device_types", []):
        try:
            return compat.backend_timeout(pg, device).total_seconds()
        except (TorchCompatError, RuntimeError):
            continue
    return None


def no_group_reason() -> str | None:
    """Why this rank, with no process group, is not a world of one: the current world was made by a
    rebuild whose handshake failed (no member has its group), so a call must fail, not succeed
    alone; None when no such world is current, or a group is initialized.

    Returns:
        The reason, naming the world and what to do, or None.
    """
    world = current_world()
    if not world.awaits_group or (dist.is_available() and dist.is_initialized()):
        return None
    return (
        f"world generation {world.generation} has no process group (the handshake of the rebuild that made it "
        "failed): call rebuild_world again on every rank"
    )


def group_info(group: dist.ProcessGroup | None = None) -> GroupInfo | None:
    """Describes ``group`` (default: the world group).

    Returns:
        The group's description, or None when no process group is initialized (a world of one).

    Raises:
        ValueError: this rank is not a member of ``group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = resolve_group(group)
    if compat.rank_not_in_group(pg):
        raise ValueError(
            "this rank is not a member of the group it passed; call the collective only on the "
            "ranks given to new_group(ranks=...), or pass group=None for the world group"
        )
    return GroupInfo(
        group=pg,
        name=pg.group_name,
        rank=dist.get_rank(pg),
        size=dist.get_world_size(pg),
        backend=str(dist.get_backend(pg)),
        store=compat.group_store(pg),
    )


class GroupTable:
    """What this world's ranks know of its groups: their failure marks.

    One per :class:`~ncclguard.world.World` (:data:`GROUPS`): a rebuilt world starts with none, and
    the abandoned world's table goes with it, so nothing here keeps an abandoned group alive.

    Attributes:
        lock: guards the marks.
        failed: why a group was marked failed, by group (weakly: a mark never keeps a group alive).
    """

    def __init__(self, world: World) -> None:
        self.lock = threading.Lock()
        self.failed: weakref.WeakKeyDictionary[dist.ProcessGroup, Exception] = weakref.WeakKeyDictionary()
        # True once any group was marked: until then a safe call asks nothing of ``failed`` (its
        # emptiness is a WeakKeyDictionary method call; this is one attribute read).
        self.marked = False


GROUPS: Slot[GroupTable] = Slot("groups", GroupTable)


class _Hot:
    """The current world's table as the hot path reads it (``hot.table.marked``), re-pointed by
    subscription when the world changes, as ``plan.hot`` is."""

    __slots__ = ("table",)

    def __init__(self, table: GroupTable) -> None:
        self.table = table


hot = _Hot(current_world().get(GROUPS))


def _follow_world(change: WorldChange) -> None:
    hot.table = change.new.get(GROUPS)


subscribe(_follow_world)


def _table() -> GroupTable:
    return current_world().get(GROUPS)


def mark_failed(group: dist.ProcessGroup, reason: Exception) -> None:
    """Records that ``group`` timed out or failed; later safe_* calls on it refuse at once."""
    table = _table()
    with table.lock:
        table.failed.setdefault(group, reason)
        table.marked = True


def failure_of(group: dist.ProcessGroup) -> Exception | None:
    """Returns why ``group`` was marked failed, or None."""
    table = _table()
    if not table.failed:  # the hot path of every safe call: no group ever failed, no lock to take
        return None
    with table.lock:
        return table.failed.get(group)


def clear_failure(group: dist.ProcessGroup) -> None:
    """Forgets a failure mark (for a group whose communicator the caller has rebuilt itself)."""
    table = _table()
    with table.lock:
        table.failed.pop(group, None)
