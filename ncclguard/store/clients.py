"""Store clients: a client of the job's store for a process that has none (:func:`connect`), and
a store client per thread, the store as the calling thread should use it (:func:`store_for_this_thread`).

A ``TCPStore`` client runs one request at a time and keeps its connection for the whole of a
``wait``: measured on torch 2.13, a ``set`` from a second thread waited 1.8 s behind another
thread's 2 s ``wait`` on the same client, so two threads in rounds on two groups (whose stores
share the job's client) stalled each other until their deadlines. ``Store.clone()`` gives a thread
its own connection, which is what torch provides it for.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

from ncclguard.deadlines import Deadline
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.rounds import GRACE_S

__all__ = ["connect", "job_address", "serves_here", "store_for_this_thread", "unprefixed"]


def unprefixed(store: dist.Store) -> dist.Store:
    """The job's store under ``store``'s prefixes: torch wraps it in PrefixStores (``default_pg``,
    ncclguard's ``ncclguard/world/g<n>``), and what every world reads lives under the unwrapped one."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def job_address(env: dict[str, str] | None = None) -> tuple[str, int] | None:
    """The job's store address from a launcher's environment (``MASTER_ADDR``, ``MASTER_PORT``).

    Args:
        env: the environment to read; default ``os.environ``.

    Returns:
        ``(host, port)``, or None when either is missing or the port is not a number.
    """
    env = dict(os.environ) if env is None else env
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    return (addr, int(port)) if addr and port.isdigit() else None


def connect(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the store at ``host:port`` (never its server), whose own calls time out after
    ``timeout_s``; it does not wait for other workers.

    Args:
        host: the store's host.
        port: its port.
        timeout_s: the client's timeout (its connect and its ``get``/``wait``; the rest are bounded
            by :func:`~ncclguard.store.bounded.bounded_store_call`).

    Returns:
        The client.

    Raises:
        RuntimeError, DistStoreError: no store answered there in time.
    """
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def serves_here(port: int) -> bool:
    """Whether this process listens on TCP ``port``: it hosts the store there (rank 0 under a plain
    launcher, whose ``init_process_group`` starts the server in its own process; the agent, a process
    of its own, under torchrun).

    Args:
        port: the store's port.

    Returns:
        True when one of this process's sockets listens on it; False when none does, or when the
        process's sockets cannot be read (then nothing is claimed).
    """
    import psutil

    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


_local = threading.local()  # .stores: id(store) -> (store, this thread's clone of it)


def store_for_this_thread(store: dist.Store, deadline: Deadline) -> dist.Store:
    """The store as the calling thread should use it: itself on the main thread, a clone of it
    (made once per thread and store) on any other.

    Args:
        store: a group's store.
        deadline: when a clone must have connected (plus :data:`~ncclguard.store.rounds.GRACE_S`).

    Returns:
        The store, or this thread's clone of it.

    Raises:
        StoreUnreachable: the clone could not connect by ``deadline``.
        RuntimeError: the clone failed (connection refused).
    """
    if threading.current_thread() is threading.main_thread() or not hasattr(store, "clone"):
        return store
    cache: dict[int, tuple[dist.Store, dist.Store]] | None = getattr(_local, "stores", None)
    if cache is None:
        cache = _local.stores = {}
    entry = cache.get(id(store))
    if entry is None or entry[0] is not store:  # (the id of a store that is gone may come back)
        clone = bounded_store_call(store, store.clone, deadline.plus(GRACE_S), "clone")
        entry = cache[id(store)] = (store, clone)
    return entry[1]
