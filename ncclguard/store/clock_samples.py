"""The straggler clock's samples in the job's store (:mod:`ncclguard.watching.sensors.straggler.clocks`).

The reference rank posts its clock under ``<prefix>/<tick>`` every period and the newest tick
under ``<prefix>/last``, keeping the last ``keep`` ticks; every other rank waits for each tick and
stamps its own clock the moment the store releases it. The stamps are taken here, next to the store
call they time: a stamp taken after a return to the caller would include the caller's delay. Every
call is bounded (:func:`~ncclguard.store.bounded.bounded_store_call`); the values are text floats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ncclguard.deadlines import Deadline
from ncclguard.store.bounded import bounded_store_call

__all__ = ["await_tick", "last_tick", "post_tick", "round_trip"]

WHAT = "the straggler clock"


def round_trip(client: Any, key: str, deadline: Deadline) -> float:
    """One round trip to the store (a ``check``, timed on the thread that makes it), in seconds.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
    """

    def timed() -> float:
        t0 = time.perf_counter()
        client.check([key])
        return time.perf_counter() - t0

    return float(bounded_store_call(client, timed, deadline, f"{WHAT}'s round trip"))


def post_tick(client: Any, prefix: str, tick: int, value: Callable[[], float], keep: int, deadline: Deadline) -> None:
    """Posts tick ``tick``: ``value()`` read just before the set, the newest tick, and drops the one
    ``keep`` ticks older.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
    """

    def post() -> None:
        client.set(f"{prefix}/{tick}", repr(value()))
        client.set(f"{prefix}/last", str(tick))
        if tick >= keep:
            client.delete_key(f"{prefix}/{tick - keep}")

    bounded_store_call(client, post, deadline, WHAT)


def last_tick(client: Any, prefix: str, deadline: Deadline) -> int:
    """The newest tick posted, -1 before the first.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
    """
    key = f"{prefix}/last"
    return int(bounded_store_call(client, lambda: client.get(key) if client.check([key]) else b"-1", deadline, WHAT))


def await_tick(
    client: Any, prefix: str, tick: int, wait_s: float, clock: Callable[[], float], deadline: Deadline
) -> tuple[float, float]:
    """Waits for tick ``tick`` (at most ``wait_s`` in the store); returns ``clock()`` as the store
    released this thread, and the tick's value.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the tick did not come within ``wait_s``.
    """
    key = f"{prefix}/{tick}"

    def released() -> tuple[float, float]:
        client.wait([key], timedelta(seconds=wait_s))
        at = clock()
        return at, float(client.get(key))

    at, value = bounded_store_call(client, released, deadline, WHAT)
    return float(at), float(value)
