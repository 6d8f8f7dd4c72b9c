"""Store calls with a deadline, even when the store's host is unreachable.

A ``TCPStore`` client bounds ``wait`` and ``get`` by its timeout, but ``add``, ``set`` and the
reply of ``compare_set`` read the socket with a plain blocking ``recv``: with the store's host cut
off (a link down, a host frozen) the calling thread waits until TCP gives up, many minutes later
(measured with py-spy on torch 2.13: ``TCPStore::incrementValueBy`` -> ``recvBytes`` -> ``recv``).
So a call that must return by a deadline runs the store call on a helper thread and waits for it
with the time left. The store releases the GIL while it waits, so the helper costs the caller
nothing but the thread hop.

A call that misses its deadline is abandoned (the helper stays blocked until the socket gives
up); while it is still pending, later calls on the same store fail at once instead of piling up
one blocked thread each. Not for hot paths: a call costs a thread hop (tens of microseconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ncclguard.errors import StoreUnreachable

__all__ = ["bounded_store_call", "no_answer", "run_into", "still_stuck"]

T = TypeVar("T")

_lock = threading.Lock()
# id(store) -> the helper thread of a call that missed its deadline and has not returned yet
# (by id: torch's stores take no weak references; an entry goes when its thread ends)
_stuck: dict[int, threading.Thread] = {}


def _stuck_on(store: Any) -> threading.Thread | None:
    with _lock:
        thread = _stuck.get(id(store))
        if thread is not None and not thread.is_alive():
            del _stuck[id(store)]
            return None
        return thread


def still_stuck(what: str) -> StoreUnreachable:
    """The error for a call refused because an earlier one on the same store has not returned."""
    return StoreUnreachable(f"{what}: an earlier call to the store has not returned; the store's host is unreachable")


def no_answer(what: str, waited_s: float) -> StoreUnreachable:
    """The error for a call that did not return within its deadline."""
    return StoreUnreachable(
        f"{what}: the store did not answer within {waited_s:.2f} s; its host is unreachable "
        "or frozen (TCPStore's add/set/compare_set are not bounded by the store's own timeout)"
    )


def run_into(fn: Callable[[], Any], box: dict[str, Any], done: threading.Event) -> None:
    """Runs ``fn()`` and leaves its value (``box["value"]``) or error (``box["error"]``) in
    ``box``, then sets ``done``: the body of a helper thread."""
    try:
        box["value"] = fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
        box["error"] = exc
    finally:
        done.set()


def bounded_store_call(store: Any, fn: Callable[[], T], timeout_s: float, what: str = "store call") -> T:
    """Runs ``fn()`` (a call on ``store``) and returns its result within ``timeout_s`` seconds.

    Args:
        store: the store ``fn`` talks to; the key under which a stuck call is remembered.
        fn: the call, e.g. ``lambda: store.add(key, 1)``.
        timeout_s: seconds to wait at most (at least 1 ms is given).
        what: how to name the call in the error.

    Returns:
        What ``fn()`` returned.

    Raises:
        StoreUnreachable: ``fn()`` did not return in time, or an earlier call on ``store`` is still
            stuck. The error ``fn()`` raised, if it raised one in time.
    """
    if _stuck_on(store) is not None:
        raise still_stuck(what)
    box: dict[str, Any] = {}
    done = threading.Event()
    thread = threading.Thread(target=run_into, args=(fn, box, done), name="ncclguard-store-call", daemon=True)
    start = time.monotonic()
    thread.start()
    if not done.wait(max(timeout_s, 0.001)):
        with _lock:
            _stuck[id(store)] = thread
        raise no_answer(what, time.monotonic() - start)
    if "error" in box:
        raise box["error"]
    return box["value"]
