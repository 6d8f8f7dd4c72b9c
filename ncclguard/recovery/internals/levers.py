"""The levers of the engine's verdict (:mod:`ncclguard.recovery.internals.verdict`): the user's judge
bound, the world group's sequence number, the job's store, and ending a peer's op from this side.

A gloo op in flight ends only when its peer's connection fails: ``ProcessGroup.abort()`` wakes
nothing (docs/recovery.md). Shutting down this process's TCP connections to a stuck peer of this
host makes the op fail at once ("Connection closed by peer"; measured 2.0 s after the cut on 3
ranks, each waiting rank cutting its own).
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._log import log
from ncclguard.errors import TorchCompatError
from ncclguard.world import current_world

__all__ = [
    "DEFAULT_JUDGE_S",
    "STUCK_AFTER_VAR",
    "cut_connections",
    "job_store",
    "judge_after",
    "unprefixed",
    "world_seq",
]

DEFAULT_JUDGE_S = 30.0  # before the warm-up: a stuck rank still needs stuck evidence to be acted on
STUCK_AFTER_VAR = "NCCLGUARD_STUCK_AFTER_S"


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
