"""The levers of the engine's verdict (:mod:`ncclguard.recovery._verdict.verdict`): the user's judge
bound, the world group's sequence number, the job's store, where a peer runs, ending a peer's op from
this side, and asking a peer's supervisor to judge and end it (:mod:`ncclguard.store.asks`).

A gloo op in flight ends only when its peer's connection fails: ``ProcessGroup.abort()`` wakes
nothing (docs/recovery.md). Shutting down this process's TCP connections to a stuck peer of this
host makes the op fail at once ("Connection closed by peer"; measured 2.0 s after the cut on 3
ranks, each waiting rank cutting its own).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Literal

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard._naming import HOSTNAME, node_address
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable, TorchCompatError
from ncclguard.incidents.model import Heartbeat
from ncclguard.store.asks import JudgeAnswer, JudgeAsk, post_ask, read_answer
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.deaths import STUCK_RC, DeathNotice, notice_now, post_death, read_deaths
from ncclguard.world import current_world

__all__ = [
    "DEFAULT_JUDGE_S",
    "STUCK_AFTER_VAR",
    "ask_supervisor",
    "cut_connections",
    "job_store",
    "judge_after",
    "on_this_host",
    "post_stuck_death",
    "stuck_notices",
    "supervisor_answer",
    "unprefixed",
    "world_seq",
]

DEFAULT_JUDGE_S = 30.0  # before the warm-up: a stuck rank still needs stuck evidence to be acted on
STUCK_AFTER_VAR = "NCCLGUARD_STUCK_AFTER_S"
STORE_BOUND_S = 5.0


def judge_after() -> float | None:
    """The user's judge bound from ``NCCLGUARD_STUCK_AFTER_S``: seconds, None when unset; 0 for ``off``.

    Raises:
        ValueError: a value that is neither ``off`` nor a positive number of seconds.
    """
    raw = os.environ.get(STUCK_AFTER_VAR, "").strip()
    if not raw:
        return None
    if raw.lower() == "off":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf")):
        raise ValueError(f"{STUCK_AFTER_VAR} must be a positive number of seconds or 'off', got {raw!r}")
    return value


def world_seq(names: dict[dist.ProcessGroup, str] | None = None) -> tuple[str, int] | None:
    """The world group's name and this rank's backend sequence number in it, or None."""
    try:
        pg = compat.default_group()
        name = (names or compat.group_names())[pg]
        return name, compat.sequence_number(pg)
    except (TorchCompatError, RuntimeError, KeyError, ValueError):
        return None


def cut_connections(pid: int) -> int:
    """Shuts down this process's TCP connections to process ``pid`` (on this host).

    Returns:
        How many were shut down.
    """
    import psutil

    try:
        theirs = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp") if c.raddr}
        mine = [c for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.fd >= 0]
    except (psutil.Error, OSError) as exc:
        log.warning("verdict: cannot read the connections to pid %d (%s)", pid, exc)
        return 0
    n = 0
    for c in mine:
        if (c.raddr.ip, c.raddr.port) not in theirs:
            continue
        try:
            with socket.socket(fileno=os.dup(c.fd)) as s:
                s.shutdown(socket.SHUT_RDWR)  # the socket itself, not the dup alone: gloo's pair sees it
            n += 1
        except OSError:
            continue
    return n


def unprefixed(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def job_store() -> dist.Store | None:
    """The job's store, unprefixed: the current world's, or the default group's in generation 0."""
    store = current_world().store
    if store is not None:
        return store
    try:
        return unprefixed(compat.default_store()) if dist.is_available() and dist.is_initialized() else None
    except (TorchCompatError, RuntimeError, ValueError):
        return None


def on_this_host(hb: Heartbeat) -> bool:
    """Whether the rank of heartbeat ``hb`` runs on this host: its hostname, and its address toward
    the master where both are known (two hosts may share a name: containers, namespaces; reading a
    pid of the other one in this host's ``/proc`` would judge the wrong process)."""
    if hb.host != HOSTNAME:
        return False
    mine = node_address()
    return hb.address is None or mine is None or hb.address == mine


def ask_supervisor(
    origin: int, hb: Heartbeat, judged: Literal["unknown", "stuck"], heal: bool, still_s: float, asker: int
) -> bool:
    """Asks the supervisor of launch rank ``origin`` to judge (``unknown``) or end (``stuck``) its
    process ``hb.pid`` (:mod:`ncclguard.store.asks`), within :data:`STORE_BOUND_S`.

    Returns:
        Whether the ask was posted (a failure is logged).
    """
    ask = JudgeAsk(
        origin=origin,
        pid=hb.pid,
        judged=judged,
        heal=heal,
        still_s=min(max(still_s, 1.0), 3600.0),
        asker=asker,
        site=hb.site[:300],
        at=time.time(),
    )
    try:
        job = job_store()
        if job is None:
            raise ValueError("no store")
        deadline = Deadline.within(STORE_BOUND_S)
        store = store_for_this_thread(job, deadline)
        bounded_store_call(store, lambda: post_ask(unprefixed(store), ask), deadline, "an ask to a supervisor")
    except (StoreUnreachable, RuntimeError, dist.DistStoreError, ValueError) as exc:
        log.warning("verdict: could not ask launch rank %d's supervisor (%s)", origin, exc)
        return False
    return True


def supervisor_answer(origin: int) -> JudgeAnswer | None:
    """The last answer of launch rank ``origin``'s supervisor, or None (none yet, or unreadable now)."""
    try:
        job = job_store()
        if job is None:
            return None
        deadline = Deadline.within(STORE_BOUND_S)
        store = store_for_this_thread(job, deadline)
        return bounded_store_call(store, lambda: read_answer(unprefixed(store), origin), deadline, "an answer")
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.debug("verdict: launch rank %d's supervisor's answer is unreadable now (%s)", origin, exc)
        return None


def post_stuck_death(world: Any, r: int, pid: int, host: str) -> bool:
    """Posts the death notice (``STUCK_RC``) of rank ``r`` of ``world``, process ``pid`` on ``host``.

    Returns:
        Whether it was posted (a failure is logged).
    """
    deadline = Deadline.within(STORE_BOUND_S)
    try:
        job = job_store()
        if job is None:
            raise ValueError("no store")
        store = store_for_this_thread(job, deadline)
        notice = notice_now(world.origin(r), pid, STUCK_RC, 0, host)
        bounded_store_call(
            store, lambda: post_death(unprefixed(store), notice), deadline, "a stuck rank's death notice"
        )
    except (StoreUnreachable, RuntimeError, dist.DistStoreError, ValueError) as exc:
        log.warning("verdict: could not post rank %d's death notice (%s)", r, exc)
        return False
    return True


def stuck_notices(world: Any) -> list[DeathNotice]:
    """The death notices posted as stuck (``STUCK_RC``) since ``world`` began; empty when unreadable now."""
    job, deadline = job_store(), Deadline.within(STORE_BOUND_S)
    if job is None:
        return []
    try:
        store = store_for_this_thread(job, deadline)
        _, notices = bounded_store_call(
            store, lambda: read_deaths(unprefixed(store), world.deaths_seen), deadline, "the death notices"
        )
    except (StoreUnreachable, RuntimeError, dist.DistStoreError) as exc:
        log.debug("verdict: the death notices are unreadable now (%s)", exc)
        return []
    return [n for n in notices if n.returncode == STUCK_RC]
