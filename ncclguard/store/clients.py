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
from functools import partial
from typing import Any

import torch.distributed as dist

from ncclguard.deadlines import Deadline
from ncclguard.store.bounded import bounded_store_call, in_torch_call
from ncclguard.store.rounds import GRACE_S

__all__ = ["Connecting", "connect", "job_address", "serves_here", "store_for_this_thread", "unprefixed"]

# One try's bound in :class:`Connecting`. A try is a torch call that the interpreter's exit waits for,
# 10 s at most (store/bounded.py, EXIT_WAIT_S), and a c10d connect overruns its bound: it tries twice
# (torch 2.13: a 4 s bound gave up after 8.6 s with nothing listening; in CI a 0.3 s one after 5 s).
TRY_S = 3.0


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


class Connecting:
    """A client of the store at ``host:port`` made on a thread of its own, tried again until
    ``within_s`` has passed: on a loaded host a c10d client's connect now and then takes seconds
    (measured: 0.3 s was too short for rank 0 to reach the store its own process served, CI, torch
    2.13), and a caller bounded tighter than that must not lose the store for good.

    Args:
        host: the store's host.
        port: its port.
        within_s: how long to keep trying.
        timeout_s: the client's own timeout once connected (see :func:`connect`).
    """

    def __init__(self, host: str, port: int, within_s: float, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._client: dist.Store | None = None
        self._stop = threading.Event()
        self._tried = threading.Event()  # set once the client is made or the tries are over
        self._why = ""
        if port >= 0:  # (-1: no tries, the client is given: ``made``)
            args = (host, port, Deadline.within(within_s), timeout_s)
            threading.Thread(target=self._try, args=args, name="ncclguard-store-connect", daemon=True).start()

    @classmethod
    def made(cls, client: Any) -> Connecting:
        """One that is done: ``client`` (a store the caller was given) is its client."""
        done = cls("", -1, 0.0, 0.0)
        done._client = client
        done._tried.set()
        return done

    def _try(self, host: str, port: int, deadline: Deadline, timeout_s: float) -> None:
        try:
            while not self._stop.is_set() and not deadline.passed():
                bound, done = min(TRY_S, max(deadline.left(), 0.1)), threading.Event()
                client = None
                try:  # counted as under way: exit waits for it rather than finalize under a torch call
                    client = in_torch_call(partial(connect, host, port, bound), done)
                except (RuntimeError, dist.DistStoreError) as exc:  # refused, or no answer within the try
                    self._why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                finally:
                    done.set()
                if client is None:
                    self._stop.wait(min(1.0, deadline.left()))
                    continue
                client.set_timeout(timedelta(seconds=timeout_s))
                with self._lock:
                    if not self._stop.is_set():
                        self._client = client
                return
        finally:
            self._tried.set()

    # Any: a c10d Store, or what ``made`` was given (a proxy or test double with a Store's methods).
    def client(self) -> Any:
        """The client, once made (never waits); None before."""
        with self._lock:
            return self._client

    @property
    def trying(self) -> bool:
        """True while no client is made and the tries go on."""
        return not self._tried.is_set()

    @property
    def why(self) -> str:
        """The last try's failure, in one line ("" before any)."""
        return self._why

    def wait(self, timeout_s: float) -> Any:
        """Waits ``timeout_s`` at most for the tries to end; the client, or None."""
        self._tried.wait(timeout_s)
        return self.client()

    def close(self) -> None:
        """Stops the tries: a client made from now on is dropped."""
        with self._lock:
            self._stop.set()


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
