"""The world this process belongs to, and everything ncclguard keeps per world.

A :class:`World` is one generation of the job: its members, this rank's number among them, the
job's store and backend, and the per-world state of every part of ncclguard (failure marks, call
counts, learned hostnames, atomic buffers, the recorder's numbering, the watchdog's members).
Each part declares its state once as a :class:`Slot` and reads it with :meth:`World.get`; the
state is built the first time a world is asked for it. A new world therefore starts every part
afresh, and nothing resets another package's cache by hand.

Every change of this process's world is told through one hook, :func:`subscribe`, as one event
type, :class:`WorldChange`, whose ``kind`` says what happened:

- ``"announced"``: :func:`announce` made a new world current (``rebuild_world`` and
  ``rejoin_world`` call it before the new group's handshake). The watchdog then watches the new
  members under their new numbers, and whatever holds resources of the old world lets them go;
- ``"rebuilt"``: ``rebuild_world`` finished: this rank is in the new world and its group is the
  default (a recovery engine's redo comes next);
- ``"left_out"``: this rank came to a rebuild after the others had settled without it: it stays
  in the world it was in, and should end.

The last two are told with :func:`notify`. A subscriber is told the kinds it asked for, by
default ``"announced"`` alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, get_args

from ncclguard._log import log
from ncclguard.errors import NcclGuardError

if TYPE_CHECKING:
    import weakref

    from torch.distributed import ProcessGroup, Store

__all__ = ["ChangeKind", "Slot", "World", "WorldChange", "announce", "current_world", "notify", "subscribe"]

T = TypeVar("T")

#: What a :class:`WorldChange` tells (see the module doc).
ChangeKind = Literal["announced", "rebuilt", "left_out"]
_KINDS: frozenset[str] = frozenset(get_args(ChangeKind))
_ANNOUNCED: tuple[ChangeKind, ...] = ("announced",)  # what a subscriber is told by default


class Slot(Generic[T]):
    """One part's per-world state: ``factory(world)`` builds it the first time a world is asked.

    Args:
        name: what the state is, for logs and errors.
        factory: builds the state for a world.
    """

    __slots__ = ("factory", "name")

    def __init__(self, name: str, factory: Callable[[World], T]) -> None:
        self.name = name
        self.factory = factory

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


@dataclass(eq=False)
class World:
    """One generation of the job as this process sees it.

    Attributes:
        generation: 0 for the world the job started with, then 1, 2, ... after each rebuild.
        rank: this process's rank in it; None while torch's default group says (generation 0).
        size: its member count; None while torch's default group says (generation 0).
        rank_map: previous generation's rank to this one's, for every member (empty in generation 0).
        left_out: previous generation's ranks that are not members of this one (sorted).
        joined: this generation's ranks that are restarted processes which joined at the rebuild
            that made it: they hold no training state until healed (sorted).
        origins: each member's launch rank (its rank in generation 0), by rank in this world;
            empty in generation 0, where the two are the same.
        deaths_seen: the job's death notices posted before this world was made
            (:mod:`ncclguard.store.deaths`): only later ones can be about its members.
        backend: the backend of its default group, once known.
        store: the job's store (unprefixed), once known: every generation keys its rounds under it.
        timeout: its collectives' timeout, once known.
        group: its default process group, weakly (a strong reference would keep an abandoned
            group alive past its reaper); None before it is built.
        left_behind: this process learned that the others went on to a newer generation without
            it (its ``rebuild_world`` came late): its own code handles that, so the watchdog's
            left-behind fence (:mod:`ncclguard.watching.desk.left_behind`) leaves it alone.
    """

    generation: int = 0
    rank: int | None = None
    size: int | None = None
    rank_map: Mapping[int, int] = field(default_factory=dict)
    left_out: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    origins: tuple[int, ...] = ()
    deaths_seen: int = 0
    backend: str | None = None
    store: Store | None = None
    timeout: timedelta | None = None
    group: weakref.ref[ProcessGroup] | None = None
    left_behind: bool = False
    _state: dict[Slot[Any], Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def get(self, slot: Slot[T]) -> T:
        """This world's state of ``slot``, built on first use (once, whichever thread asks first)."""
        try:
            return self._state[slot]
        except KeyError:
            pass
        with self._lock:
            if slot not in self._state:
                self._state[slot] = slot.factory(self)
            return self._state[slot]

    def drop(self, slot: Slot[T]) -> T | None:
        """Forgets this world's state of ``slot`` (the next :meth:`get` builds it again).

        Returns:
            The state dropped, or None where it was never built.
        """
        with self._lock:
            return self._state.pop(slot, None)

    def retire(self) -> None:
        """Drops this world's per-world state (``rebuild_world`` calls it on the abandoned world,
        so that the last references to its groups are the reaper's, never a cache's)."""
        with self._lock:
            self._state.clear()

    @property
    def awaits_group(self) -> bool:
        """A world a rebuild announced whose group was never built (its handshake failed): its
        members have no process group to agree in, so each must rebuild again before any step."""
        return self.generation > 0 and self.group is None

    def origin(self, rank: int) -> int:
        """The launch rank of this world's member ``rank``."""
        return self.origins[rank] if self.origins else rank

    def old_rank(self, rank: int) -> int | None:
        """The previous generation's number of this generation's ``rank`` (None if unknown)."""
        for old, new in self.rank_map.items():
            if new == rank:
                return old
        return None


@dataclass(frozen=True)
class WorldChange:
    """What each subscriber is told (:func:`subscribe`): one change of this process's world.

    Which ranks left and which joined are the new world's: ``new.left_out`` (the old world's
    numbering), ``new.joined`` (the new world's); ``new.rank_map`` renumbers the old ranks.

    Attributes:
        old: the world before (for ``"left_out"``, the world this rank stays in).
        new: the world now current (for ``"left_out"``, the same as ``old``).
        kind: what happened: ``"announced"``, ``"rebuilt"`` or ``"left_out"`` (the module doc).
        step: the step a recovery engine redoes after this change (it rebuilt for it); None
            otherwise.
        error: with ``"left_out"``, why this rank is in no new world (a
            :class:`~ncclguard.errors.RebuildFailed` with ``late=True``); None otherwise.
    """

    old: World
    new: World
    kind: ChangeKind = "announced"
    step: int | None = None
    error: NcclGuardError | None = None


@dataclass(frozen=True, eq=False)
class _Subscriber:
    """One :func:`subscribe` call: the function and the kinds it is told (its identity is the
    subscription, so the same function subscribed twice is told twice and unsubscribed once)."""

    fn: Callable[[WorldChange], None]
    kinds: frozenset[str]


class _Worlds:
    """The process's current world and its subscribers (one per process: a process is one rank)."""

    def __init__(self) -> None:
        self.current = World()
        self.subscribers: list[_Subscriber] = []
        self.lock = threading.Lock()


_worlds = _Worlds()


def current_world() -> World:
    """The world this process is in now."""
    return _worlds.current


def subscribe(fn: Callable[[WorldChange], None], *, kinds: Collection[ChangeKind] = _ANNOUNCED) -> Callable[[], None]:
    """Calls ``fn(change)`` on each change of this process's world of one of ``kinds``, in the
    thread that made the change (``"announced"``: :func:`announce`; the others: :func:`notify`).

    Args:
        fn: the subscriber; an exception in it is logged, never raised into the announcer.
        kinds: the kinds of :class:`WorldChange` it is told (default: the announcements alone,
            what a part holding per-world resources follows).

    Returns:
        A function that unsubscribes ``fn`` (calling it twice is harmless).

    Raises:
        TypeError: ``fn`` is not callable, or ``kinds`` is a string rather than a collection.
        ValueError: ``kinds`` is empty or names an unknown kind.
    """
    if not callable(fn):
        raise TypeError(f"subscribe needs a callable taking a WorldChange, got {type(fn).__name__}")
    if isinstance(kinds, str) or not isinstance(kinds, Collection):
        raise TypeError(f"kinds must be a collection of kinds such as ('rebuilt',), got {kinds!r}")
    wanted = frozenset(kinds)
    if not wanted or not wanted <= _KINDS:
        raise ValueError(f"kinds must name some of {sorted(_KINDS)}, got {sorted(map(str, kinds))}")
    entry = _Subscriber(fn, wanted)
    with _worlds.lock:
        _worlds.subscribers.append(entry)

    def unsubscribe() -> None:
        with _worlds.lock:
            if entry in _worlds.subscribers:
                _worlds.subscribers.remove(entry)

    return unsubscribe


def announce(new: World) -> WorldChange:
    """Makes ``new`` the current world and tells every subscriber of ``"announced"``.

    Args:
        new: the world now in force (its generation must be above the current one's, or equal
            when it only fills in what the current one did not know).

    Returns:
        The change, as the subscribers saw it.

    Raises:
        ValueError: ``new`` is of an older generation than the current world.
    """
    with _worlds.lock:
        old = _worlds.current
        if new.generation < old.generation:
            raise ValueError(f"world generation {new.generation} is older than the current {old.generation}")
        _worlds.current = new
        told = _subscribers_of("announced")  # with the swap: whoever subscribed before it is told
    change = WorldChange(old=old, new=new)
    _tell(change, told)
    return change


def notify(change: WorldChange) -> None:
    """Tells the subscribers of ``change.kind`` what happened to a world made current before
    (``rebuild_world`` tells ``"rebuilt"`` and ``"left_out"`` this way).

    Args:
        change: the change; its kind is not ``"announced"``.

    Raises:
        ValueError: ``change`` is an announcement: only :func:`announce` makes a world current.
    """
    if change.kind == "announced" or change.kind not in _KINDS:
        raise ValueError(f"notify tells a world's rebuild or its rank's leaving, got kind {change.kind!r}")
    with _worlds.lock:
        told = _subscribers_of(change.kind)
    _tell(change, told)


def _subscribers_of(kind: str) -> list[Callable[[WorldChange], None]]:
    """The subscribers told of ``kind``, copied (the caller holds the lock)."""
    return [s.fn for s in _worlds.subscribers if kind in s.kinds]


def _tell(change: WorldChange, subscribers: list[Callable[[WorldChange], None]]) -> None:
    # Called outside the lock: a subscriber may subscribe or unsubscribe without deadlocking.
    for fn in subscribers:
        try:
            fn(change)
        except Exception:  # noqa: BLE001 - the world has changed whatever a subscriber does
            log.exception(
                "world: the subscriber %r raised on generation %d (%s)", fn, change.new.generation, change.kind
            )
