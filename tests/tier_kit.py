"""Two-tier rounds with threads as ranks (ncclguard/store/tier_round.py): a job's ``TCPStore`` and one
``TCPStore`` a node on 127.0.0.1, each rank with clients of its own, and a client that counts its
requests. Used by tests/base/test_tier_round.py and tests/recovery/test_meeting_tier.py;
:func:`run_threads` by every round's test with threads as ranks (tests/base/test_store_layer.py too)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from ncclguard.store import node_store
from ncclguard.store.clients import connect

# Hang guards: a round's deadline far above what threads on a loaded 2-core machine need to meet
# (they meet in milliseconds), and the join above that deadline plus its grace.
ROUND_GUARD_S, JOIN_GUARD_S = 30.0, 60.0


class Counting:
    """A store client that counts the requests made through it, by method."""

    def __init__(self, store: Any) -> None:
        self._store, self.calls = store, collections.Counter()

    def __getattr__(self, name: str) -> Any:
        if name == "clone":  # used as it is on its thread: a clone (store_for_this_thread) would count nothing
            raise AttributeError(name)
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call


class Job:
    """A job's store, ``nodes`` node stores, and a placement of ``size`` ranks on them (node by node)."""

    def __init__(self, size: int, per_node: int) -> None:
        self.server = node_store.serve(ROUND_GUARD_S, fresh=True)  # plays the job's store
        self.node_of = tuple(r // per_node for r in range(size))
        self.nodes = [node_store.serve(ROUND_GUARD_S, fresh=True) for _ in range(max(self.node_of) + 1)]
        self.size = size

    def clients(self, rank: int, linked: bool = True) -> tuple[Counting, Any]:
        job = Counting(connect("127.0.0.1", self.server.port, ROUND_GUARD_S))
        near = connect("127.0.0.1", self.nodes[self.node_of[rank]].port, ROUND_GUARD_S) if linked else None
        return job, near


def run_threads(fn: Any, delays: dict[int, float]) -> dict[int, Any]:
    """``fn(rank)`` on one thread per rank, each after its delay; results (or errors) by rank."""
    out: dict[int, Any] = {}

    def one(rank: int, delay: float) -> None:
        time.sleep(delay)
        try:
            out[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc

    # Daemons: a thread that never returns fails the test at the join's guard, it does not hang the run.
    threads = [threading.Thread(target=one, args=(r, d), daemon=True) for r, d in delays.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_GUARD_S)
    assert not any(t.is_alive() for t in threads)
    return out
