"""A store client per thread: the store as the calling thread should use it.

A ``TCPStore`` client runs one request at a time and keeps its connection for the whole of a
``wait``: measured on torch 2.13, a ``set`` from a second thread waited 1.8 s behind another
thread's 2 s ``wait`` on the same client, so two threads in rounds on two groups (whose stores
share the job's client) stalled each other until their deadlines. ``Store.clone()`` gives a thread
its own connection, which is what torch provides it for.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.rounds import GRACE_S

__all__ = ["store_for_this_thread"]

_local = threading.local()  # .stores: id(store) -> (store, this thread's clone of it)


def store_for_this_thread(store: dist.Store, deadline: float) -> dist.Store:
    """The store as the calling thread should use it: itself on the main thread, a clone of it
    (made once per thread and store) on any other.

    Args:
        store: a group's store.
        deadline: ``time.monotonic()`` value by which a clone must have connected (plus
            :data:`~ncclguard.store.rounds.GRACE_S`).

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
        clone = bounded_store_call(store, store.clone, max(deadline - time.monotonic(), 0.0) + GRACE_S, "clone")
        entry = cache[id(store)] = (store, clone)
    return entry[1]
