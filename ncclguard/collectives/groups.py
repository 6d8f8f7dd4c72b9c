"""What ncclguard knows of a process group: its name, ranks, store, backend, and whether it failed."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.config import Config
from ncclguard.deadlines import adaptive_timeout, group_cap_s
from ncclguard.errors import TorchCompatError
from ncclguard.world import Slot, World, current_world

__all__ = [
    "GroupInfo",
    "GroupState",
    "group_state",
    "GROUPS",
    "GroupTable",
    "cached_state",
    "resolve_group",
    "group_info",
    "group_timeout_s",
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

    group: Any  # a torch ProcessGroup; None only for a world of one
    name: str
    rank: int  # this process's rank in the group
    size: int
    backend: str
    store: Any  # the group's c10d Store (already prefixed by torch for subgroups), or None

    def global_rank(self, group_rank: int) -> int:
        """Maps a rank in this group to its global rank."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def resolve_group(group: Any = None) -> Any:
    """The process group ``group`` stands for: the default group for None or ``dist.group.WORLD``.

    Raises:
        ValueError: no process group is initialized (torch's message).
    """
    return compat.default_group() if group is None or group is dist.group.WORLD else group


def group_timeout_s(group: Any = None) -> float | None:
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


def group_info(group: Any = None) -> GroupInfo | None:
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
    """What this world's ranks know of its groups: their cached states and failure marks.

    One per :class:`~ncclguard.world.World` (:data:`GROUPS`): a rebuilt world starts with none, and
    the abandoned world's table goes with it, so nothing here keeps an abandoned group alive.

    Attributes:
        lock: guards both maps.
        failed: why a group was marked failed, by group (weakly: a mark never keeps a group alive).
        states: the hot path's cached :class:`GroupState` per group (each holds its group).
    """

    def __init__(self, world: World) -> None:
        self.lock = threading.Lock()
        self.failed: weakref.WeakKeyDictionary[Any, Exception] = weakref.WeakKeyDictionary()
        self.states: dict[Any, GroupState] = {}


GROUPS: Slot[GroupTable] = Slot("groups", GroupTable)


def _table() -> GroupTable:
    return current_world().get(GROUPS)


def mark_failed(group: Any, reason: Exception) -> None:
    """Records that ``group`` timed out or failed; later safe_* calls on it refuse at once."""
    table = _table()
    with table.lock:
        first = table.failed.setdefault(group, reason)
        state = table.states.get(group)
        if state is not None:
            state.failed = first


def failure_of(group: Any) -> Exception | None:
    """Returns why ``group`` was marked failed, or None."""
    table = _table()
    if not table.failed:  # the hot path of every safe call: no group ever failed, no lock to take
        return None
    with table.lock:
        return table.failed.get(group)


def clear_failure(group: Any) -> None:
    """Forgets a failure mark (for a group whose communicator the caller has rebuilt itself)."""
    table = _table()
    with table.lock:
        table.failed.pop(group, None)
        state = table.states.get(group)
        if state is not None:
            state.failed = None


# How old the group timeout behind a default deadline may be (see GroupState.default_deadline).
TIMEOUT_TTL_S = 0.01


class GroupState:
    """What the hot path of a safe call needs about one live group, looked up once.

    Attributes:
        info: the group's description.
        multi: the group has more than one rank (a world of one reduces nothing).
        nccl: the group's backend is NCCL (its wait is not gloo's ``wait(timeout)``).
        cpu_ok, cuda_ok: tensors on that device type can go on the group's wire as they are.
        count: this rank's call count on the group (see :mod:`ncclguard.collectives.rendezvous`).
        failed: why the group was marked failed, or None (kept in step by :func:`mark_failed`).
    """

    __slots__ = (
        "info",
        "multi",
        "cpu_ok",
        "cuda_ok",
        "count",
        "failed",
        "_read_timeout",
        "_cap_config",
        "_group_timeout",
        "_read_at",
        "_cap",
        "_small",
        "_small_below",
        "nccl",
        "_wait_s",
        "_wait",
    )

    def __init__(self, info: GroupInfo, count: Any) -> None:
        self.info = info
        self.multi = info.size > 1
        self.nccl = info.backend == "nccl"
        devices = BACKEND_DEVICES.get(info.backend, frozenset())
        self.cpu_ok = "cpu" in devices
        self.cuda_ok = "cuda" in devices
        self.count = count
        self.failed: Exception | None = failure_of(info.group)
        self._read_timeout: Callable[[], float] | None = None
        self._cap_config: Config | None = None
        self._group_timeout: float | None = None
        self._read_at = -math.inf
        self._cap = math.inf
        self._small = math.inf
        self._small_below = 0
        self._wait_s = -1.0
        self._wait = timedelta(0)

    def timeout_s(self) -> float | None:
        """The group's timeout in force, read live (``_set_pg_timeout`` may change it any time),
        from the first device backend that answers (its reader is cached: the scan costs more)."""
        if self._read_timeout is not None:
            try:
                return self._read_timeout()
            except RuntimeError:
                self._read_timeout = None
        for device in getattr(self.info.group, "_device_types", []):
            try:
                reader = compat.backend_timeout_reader(self.info.group, device)
                seconds = reader()
            except (TorchCompatError, RuntimeError):
                continue
            self._read_timeout = reader
            return seconds
        return None

    def whole_wait(self, seconds: float) -> timedelta:
        """``timedelta(seconds=seconds)``, cached for the last value (a default deadline repeats)."""
        if self._wait_s != seconds:
            self._wait, self._wait_s = timedelta(seconds=seconds), seconds
        return self._wait

    @property
    def group_timeout(self) -> float | None:
        """The group's timeout as :meth:`default_deadline` last read it."""
        return self._group_timeout

    def default_deadline(self, numel: int, nbytes: int, config: Config, now: float) -> float:
        """The default deadline of a call on ``numel`` elements (``nbytes`` bytes): the policy's
        (:func:`~ncclguard.deadlines.adaptive_timeout`), capped below the group's
        timeout (:func:`~ncclguard.deadlines.group_cap_s`).

        The group's timeout is read again when the last read is :data:`TIMEOUT_TTL_S` old (``now``
        is ``time.monotonic()``) or the configuration changed, so a default deadline follows a
        changed group timeout within that time; an explicit deadline is checked against a live read.
        """
        # Identity, not equality: comparing two pydantic Configs compares every field.
        if now - self._read_at >= TIMEOUT_TTL_S or self._cap_config is not config:
            self._refresh(config, now)
        if numel < self._small_below:  # the size policy's first tier, precomputed
            return self._small
        policy = adaptive_timeout(numel, nbytes, config)
        return policy if self._group_timeout is None else min(policy, self._cap)

    def _refresh(self, config: Config, now: float) -> None:
        self._group_timeout = self.timeout_s()
        self._cap = math.inf if self._group_timeout is None else group_cap_s(self._group_timeout, config)
        self._small = min(config.timeout_small_s, self._cap)
        self._small_below = config.timeout_small_below if config.timeout_policy == "size" else 0
        self._cap_config, self._read_at = config, now


def cached_state(key: Any) -> GroupState | None:
    """The hot path's lookup: the cached state of the group ``key`` in this world, or None."""
    return current_world().get(GROUPS).states.get(key)


def group_state(group: Any, count_of: Any) -> GroupState | None:
    """The cached :class:`GroupState` of ``group`` (None: the default group), built on first use.

    Args:
        group: a process group, ``dist.group.WORLD`` or None.
        count_of: ``GroupInfo -> call count`` (the rendezvous' counter for this rank on the group).

    Returns:
        The state, or None when no process group is initialized (a world of one).

    Raises:
        ValueError: this rank is not a member of ``group``.
    """
    key = compat.world().default_pg if group is None else group
    table = _table()
    try:
        state = table.states.get(key)
    except TypeError:  # an unhashable argument: group_info says what is wrong with it
        state = None
    if state is not None:
        return state
    info = group_info(group)
    if info is None:
        return None
    fresh = GroupState(info, count_of(info))  # built outside the lock: it reads the failure marks
    with table.lock:
        state = table.states.setdefault(info.group, fresh)
    if state.failed is None:  # marked failed between building the state and caching it
        state.failed = failure_of(info.group)
    return state
