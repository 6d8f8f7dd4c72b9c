"""The node tier's own store (docs/scale.md): the ``TCPStore`` a node's agent serves its node's ranks,
and the few exchanges made with it.

One server per process for the process's life: ``ncclguard run``'s watchdog gives way to the
script's, and the ranks linked to the store the first one served stay linked. Unbounded calls: make
them inside a bounded call (:class:`~ncclguard.store.bounded_calls.BoundedCalls`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["get_present", "put", "put_all", "serve"]


class _Served:
    """The node's store this process serves (made at the first :func:`serve`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Any = None  # a c10d TCPStore server


_served = _Served()


def serve(timeout_s: float, fresh: bool = False) -> Any:
    """The ``TCPStore`` server this process serves its node's ranks, on a free port of this host's
    loopback.

    Args:
        timeout_s: the server's own clients' timeout.
        fresh: a new server, not the process's (tests that play several nodes in one process).

    Returns:
        The server (a c10d Store; its ``port`` is where the node's ranks connect).

    Raises:
        RuntimeError, DistStoreError: no port could be served.
    """
    with _served.lock:
        if _served.store is None or fresh:
            store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
            if fresh:
                return store
            _served.store = store
        return _served.store


def put(store: Any, key: str, value: str) -> None:
    """Sets ``value`` under ``key``."""
    store.set(key, value)


def put_all(store: Any, keys: Sequence[str], values: Sequence[str]) -> None:
    """Sets each of ``values`` under its key, in one request."""
    store.multi_set(list(keys), list(values))


def get_present(store: Any, key: str) -> bytes | None:
    """The value under ``key``, or None when there is none (a ``check``, then a ``get``)."""
    return bytes(store.get(key)) if store.check([key]) else None
