"""Death notices: a launcher that saw a rank's process die says so in the job's store, at once.

A rank killed outright (SIGKILL, the OOM killer, a segfault) never reaches its commit, and the
survivors' commit would wait its whole bound for its statement (9.1 s of every kill in the failure
drill before this). The process that supervises the rank (:mod:`ncclguard.supervise`, the
``--ncclguard-restarts`` option of ``ncclguard run``; :func:`ncclguard.testing.launch.spawn`) sees the death
the moment it happens and posts a :class:`DeathNotice`; a commit waiting for that rank reads it and
settles at once (:mod:`ncclguard.recovery.commit`).

Keys, under ``ncclguard/dead/<restart>`` (``<restart>`` is ``TORCHELASTIC_RESTART_COUNT``, so a job
that torchrun restarted whole never reads its previous run's notices): a counter ``n`` and one
notice per death, ``<i>`` for ``i`` in ``1..n``. A reader remembers how many it has seen (a world
starts from the count at its rebuild: :attr:`ncclguard.world.World.deaths_seen`) and reads only the
new ones. The counter is bumped after the notice is written, so a reader never meets a number
whose notice is missing.

A notice is read as JSON into :class:`DeathNotice` (never unpickled) under :data:`MAX_NOTICE_BYTES`,
each field bounded; one that does not fit is skipped and logged once per key in this process (a
hostile value never names a rank dead). Nothing checks that the named process is gone: a notice may
name a live one by design (``STUCK_RC``: a rank judged stuck, which reads its own notice and exits;
a supervisor's notice for a SIGKILLed process the kernel has not let go), a pid is not unique across
the hosts of one name that containers and namespaces make, and the pid is never acted on, only
compared with the reader's own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store import node_store
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.clients import connect, unprefixed
from ncclguard.store.codec import DecodeError, decode, encode

__all__ = [
    "MAX_NOTICE_BYTES",
    "STUCK_RC",
    "DeathNotice",
    "DeathPoster",
    "DeathWatch",
    "death_count",
    "deaths_so_far",
    "notice_now",
    "post_death",
    "read_deaths",
    "relay_deaths",
    "relay_slot",
]

MAX_NOTICE_BYTES = 4 * 1024
# The returncode of a notice posted by a peer's verdict for a rank judged stuck for good (it is alive,
# SIGSTOP's number negated): the commit and the rebuild meeting settle without waiting for it.
STUCK_RC = -19
_MAX_READ = 256  # notices read in one call at most; the rest wait for the next poll
RELAY_S = 0.5  # a window of relay_deaths: one rank of a node reads the job's notices in each
_MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT on 64 bits
_MAX_COUNT = 1 << 20  # a bound on launch ranks and restarts no job reaches
_MAX_AT = 1e11  # seconds since 1970: the year 5138
_refused: set[str] = set()  # the keys of the notices refused and logged here (once each)
_MAX_REFUSED = 1024  # past it, refusals are still skipped but no longer logged


class DeathNotice(BaseModel):
    """One rank's process that died, as its launcher saw it.

    Attributes:
        origin: its launch rank (``RANK`` when it was started; a rebuild renumbers, this stays).
        pid: the process that died.
        returncode: how it ended (negative: killed by that signal, as ``Popen.returncode``; an exit
            status is 0-255).
        life: its restart number (``NCCLGUARD_RESTART_COUNT``: 0 for a rank's first process).
        host: the launcher's host.
        at: ``time.time()`` on that host when the death was seen.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    origin: int = Field(ge=0, le=_MAX_COUNT)
    pid: int = Field(ge=0, le=_MAX_PID)
    returncode: int = Field(ge=-128, le=255)
    life: int = Field(ge=0, le=_MAX_COUNT)
    host: str = Field(max_length=255)
    at: float = Field(ge=0, le=_MAX_AT)


def _prefix(restart: str | None = None) -> str:
    if restart is None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"ncclguard/dead/{restart}"


def post_death(store: dist.Store, notice: DeathNotice, restart: str | None = None) -> int:
    """Posts ``notice``; returns its number.

    Args:
        store: the job's store (unprefixed).
        notice: the death.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.

    Returns:
        The notice's number (1 for the job's first death).
    """
    prefix = _prefix(restart)
    # The number comes first, from a counter of its own, so two launchers never write one key;
    # the public counter ``n`` moves only once the notice is there.
    number = int(store.add(f"{prefix}/taken", 1))
    store.set(f"{prefix}/{number}", encode(notice))
    store.add(f"{prefix}/n", 1)
    return number


def death_count(store: dist.Store, restart: str | None = None) -> int:
    """How many notices are readable now (one store call).

    Args:
        store: the job's store.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.

    Returns:
        The count.
    """
    return int(store.add(f"{_prefix(restart)}/n", 0))


def deaths_so_far(store: dist.Store, deadline: Deadline) -> int:
    """:func:`death_count`, bounded by ``deadline``.

    Args:
        store: the job's store.
        deadline: when to stop waiting for the store.

    Returns:
        The count.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    return bounded_store_call(store, lambda: death_count(store), deadline, "the death count")


def read_deaths(store: dist.Store, seen: int, restart: str | None = None) -> tuple[int, list[DeathNotice]]:
    """The notices after the first ``seen``; a count read but no new notice costs one store call.

    Args:
        store: the job's store.
        seen: how many the caller has read already.
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.

    Returns:
        The new count of notices read, and the new notices (an unreadable one is skipped: a
        hostile value never names a rank dead).
    """
    prefix = _prefix(restart)
    if not store.check([f"{prefix}/n"]):  # none posted: a look leaves no key behind
        return seen, []
    count = death_count(store, restart)
    if count <= seen:
        return seen, []
    upto = min(count, seen + _MAX_READ)
    wanted = [f"{prefix}/{i}" for i in range(seen + 1, upto + 1)]
    present = [k for k in wanted if store.check([k])]
    found = []
    for key, raw in zip(present, store.multi_get(present) if present else [], strict=True):
        try:
            found.append(decode(DeathNotice, bytes(raw), f"the death notice under {key!r}", MAX_NOTICE_BYTES))
        except DecodeError as exc:
            if key not in _refused and len(_refused) < _MAX_REFUSED:  # once per key: readers re-read from a start
                _refused.add(key)
                log.warning("%s; refused: nobody is named dead by it", exc)
    return upto, found


def relay_slot(now: float | None = None) -> int:
    """The relay's window (:func:`relay_deaths`) that ``now`` (default: the clock) falls in."""
    return int((time.time() if now is None else now) / RELAY_S)


def relay_deaths(near: Any, job: dist.Store, slot: int, restart: str | None = None) -> bool:
    """Copies the job's new death notices into a node's store, from one rank of the node a window.

    Each rank of a node that looks at the notices (a take's waits look every 0.5 s) calls this with
    its node's store first, then reads the copy there (:func:`read_deaths` on ``near``): the first
    rank of the node to come in window ``slot`` reads the job's store, the others none. At 16,384
    ranks, 8 a node, that is 2,048 job-store reads a window, not 16,384. The notices are copied as
    they are (each read later under its bound, never unpickled; one over :data:`MAX_NOTICE_BYTES`
    is copied empty, so refused), then the node's count moves by compare-and-set to the last one
    copied: two ranks copying in turn never count a notice that is not there.

    Args:
        near: the node's store.
        job: the job's store.
        slot: the window (:func:`relay_slot`).
        restart: the job's restart count; default ``TORCHELASTIC_RESTART_COUNT``.

    Returns:
        True when this rank copied (it was the window's first).

    Raises:
        RuntimeError, DistStoreError: a store failed (callers bound each call).
    """
    prefix = _prefix(restart)
    if not node_store.claim_window(near, f"{prefix}/relay", slot):
        return False
    if not job.check([f"{prefix}/n"]):  # none posted
        return True
    count, copied = death_count(job, restart), death_count(near, restart)
    if count > copied:
        keys = [f"{prefix}/{i}" for i in range(copied + 1, min(count, copied + _MAX_READ) + 1)]
        raws = [bytes(v) for v in job.multi_get(keys)]  # the job's count moves once its notice is set
        near.multi_set(keys, [v if len(v) <= MAX_NOTICE_BYTES else b"" for v in raws])
        near.compare_set(f"{prefix}/n", str(copied), str(copied + len(keys)))
    return True


class DeathWatch:
    """The members of a world that their launchers reported dead since the world was made.

    Args:
        store: the job's store (prefixes are taken off).
        seen: the notices read before (the world's ``deaths_seen``).
        origins: each member's launch rank, by its number in the world.
        me: this rank's number (never named dead: a restarted process's own notice).
        near: this rank's node's store, or None, looked up at each look (the node tier,
            docs/scale.md): the notices are read through it (:func:`relay_deaths`); a node's store
            that fails is dropped for the job's. Default: the calling thread's client of the node's
            store this process's watchdog is linked to (:func:`~ncclguard.store.node_store.near_getter`),
            none where it is linked to none.

    Attributes:
        dead: ``{member: how it is known}``, what the looks found so far.
        notices: ``{member: its notice}``, the same members.
    """

    def __init__(
        self,
        store: dist.Store,
        seen: int,
        origins: dict[int, int],
        me: int,
        near: Callable[[], Any | None] | None = None,
    ) -> None:
        self._store = unprefixed(store)
        self._seen = seen
        self._by_origin = {origin: r for r, origin in origins.items()}
        self._me = me
        self._near: Callable[[], Any | None] | None = near if near is not None else node_store.near_getter()
        self.dead: dict[int, str] = {}
        self.notices: dict[int, DeathNotice] = {}

    def look(self) -> dict[int, str]:
        """Reads the new notices (unbounded: callers on a deadline run it through a bounded call).

        Returns:
            Every member known dead so far, with how it is known.
        """
        self._seen, notices = read_deaths(self._store, self._seen)
        return self._note(notices)

    def _look_near(self, near: Any) -> dict[int, str]:
        """:meth:`look` through the node's store ``near`` (:func:`relay_deaths`)."""
        relay_deaths(near, self._store, relay_slot())
        self._seen, notices = read_deaths(near, self._seen)
        return self._note(notices)

    def _note(self, notices: list[DeathNotice]) -> dict[int, str]:
        for n in notices:
            r = self._by_origin.get(n.origin)
            if r is not None and r != self._me:
                self.notices[r] = n
                self.dead[r] = (
                    f"its process died (pid {n.pid}, exit {n.returncode}, launch rank {n.origin} on {n.host}, "
                    "reported by its launcher)"
                )
        return self.dead

    def look_within(self, deadline: Deadline) -> dict[int, str]:
        """:meth:`look` within ``deadline``, through the node's store where there is one; what was
        known before when the store does not answer."""
        near = self._near() if self._near is not None else None
        if near is not None:
            try:
                what = "the death notices through the node's store"
                return bounded_store_call(near, lambda: self._look_near(near), deadline, what)
            except (StoreUnreachable, RuntimeError, ValueError, dist.DistStoreError) as exc:
                log.info("the death notices: the node's store failed (%s); read in the job's store from now on", exc)
                self._near = None
        try:
            return bounded_store_call(self._store, self.look, deadline, "the death notices")
        except (StoreUnreachable, RuntimeError, dist.DistStoreError):
            return self.dead


def notice_now(origin: int, pid: int, returncode: int, life: int, host: str) -> DeathNotice:
    """A notice stamped now (what a launcher posts)."""
    return DeathNotice(origin=origin, pid=pid, returncode=returncode, life=life, host=host, at=time.time())


class DeathPoster:
    """A launcher's line to the job's store (``MASTER_ADDR:MASTER_PORT`` of the ranks' environment),
    to post a rank's death the moment it happens.

    The client is made ahead, on a thread of its own, once something listens at the store's
    address (the store may not be up yet: under ``ncclguard.testing.launch`` rank 0 hosts it), so
    a death is posted without that delay; a job with no store costs a refused connection now and
    then, nothing more.

    Args:
        env: the ranks' environment (the store's address and ``TORCHELASTIC_RESTART_COUNT``).
        connect_s: how long the client keeps looking for the store.
        bound_s: the bound of one post.
    """

    def __init__(self, env: dict[str, str], *, connect_s: float = 120.0, bound_s: float = 5.0) -> None:
        self._addr, self._port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        self._restart = env.get("TORCHELASTIC_RESTART_COUNT")
        self._bound_s, self._connect_s = bound_s, connect_s
        self._store: dist.Store | None = None
        self._lock = threading.Lock()
        if self._addr and self._port.isdigit():
            threading.Thread(target=self._look, name="ncclguard-death-poster", daemon=True).start()

    def _listening(self) -> bool:
        try:
            with socket.create_connection((self._addr, int(self._port)), timeout=0.5):
                return True
        except OSError:
            return False

    def _connected(self) -> dist.Store | None:
        with self._lock:
            if self._store is None and self._addr and self._port.isdigit() and self._listening():
                try:
                    self._store = connect(self._addr, int(self._port), self._bound_s)
                except (RuntimeError, dist.DistStoreError):
                    self._store = None
            return self._store

    def _look(self) -> None:
        deadline = Deadline.within(self._connect_s)
        while self._connected() is None and deadline.sleep(0.5):
            pass

    def store(self) -> dist.Store | None:
        """The client of the job's store, or None while there is none (the supervisor reads its asks on it)."""
        return self._connected()

    def post(self, origin: int, pid: int, returncode: int, life: int) -> str | None:
        """Posts that launch rank ``origin``'s process ``pid`` ended with ``returncode``.

        Args:
            origin: the rank's launch rank.
            pid: the process that died.
            returncode: ``Popen.returncode`` (negative: the signal).
            life: its restart number.

        Returns:
            None when it was posted; else why not, in words (the launcher says it).
        """
        store = self._connected()
        if store is None:
            return f"no store at {self._addr}:{self._port} to post the death of launch rank {origin} to"
        notice = notice_now(origin, pid, returncode, life, socket.gethostname())
        try:
            bounded_store_call(
                store, lambda: post_death(store, notice, self._restart), Deadline.within(self._bound_s), "death notice"
            )
        except (StoreUnreachable, RuntimeError) as exc:
            return f"the death of launch rank {origin} was not posted: {exc}"
        return None
