"""The learned timeouts in the job's store: carried across a rebuild and a supervised restart.

``ncclguard/learned`` holds the JSON of :class:`ncclguard.watching.base.learner.LearnedState` of the engine's
judge bound (rank 0 of the current world writes it when a bound changes; every rank reads it once,
when its recovery engine starts its first step). ``ncclguard/learned/hang/<launch rank>`` holds each
rank's watchdog's hang bounds (:mod:`ncclguard.watching.base.hang_bound`: written by that rank when one
changes, read by a restarted process of the same launch rank). The value is bytes here; the reader
parses it with its own size bound (:func:`ncclguard.watching.base.learner.parse_state`), never unpickles it.
"""

from __future__ import annotations

import torch.distributed as dist

from ncclguard.deadlines import Deadline
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.clients import unprefixed

__all__ = ["LEARNED_KEY", "hang_key", "read_learned", "write_learned"]

LEARNED_KEY = "ncclguard/learned"


def hang_key(origin: int) -> str:
    """The key of launch rank ``origin``'s learned hang bounds."""
    return f"{LEARNED_KEY}/hang/{origin}"


def _job(store: dist.Store) -> dist.Store:
    return unprefixed(store)  # the job's store: every world reads one key


def write_learned(store: dist.Store, blob: str, deadline: Deadline) -> None:
    """Writes the learned state's JSON under :data:`LEARNED_KEY`, bounded by ``deadline``.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    job = _job(store)
    bounded_store_call(job, lambda: job.set(LEARNED_KEY, blob), deadline, "the learned timeouts")


def read_learned(store: dist.Store, deadline: Deadline) -> bytes | None:
    """The learned state's JSON, or None when none was written; bounded by ``deadline``.

    Raises:
        StoreUnreachable: no answer by ``deadline``.
        RuntimeError, DistStoreError: the store failed.
    """
    job = _job(store)

    def get() -> bytes | None:
        return bytes(job.get(LEARNED_KEY)) if job.check([LEARNED_KEY]) else None

    return bounded_store_call(job, get, deadline, "the learned timeouts")
