"""How often a snapshot is taken: every ``K`` steps, from what a take costs, the step time and the
failures the job has seen.

Without a failure, ``K`` is the smallest that keeps snapshots under a budget of the step time (2%):
:func:`budget_k`. Once the job has lost a rank, the time between failures is known too, and a
shorter ``K`` pays for itself when failures are frequent: a kill redoes the steps since the last
snapshot, half ``K`` on average. Young's rule (J. W. Young, "A first order approximation to the
optimum checkpoint interval", CACM 17(9), 1974) puts the interval that minimises the sum at
``sqrt(2 x take x MTBF)``: :func:`young_k`. The keeper asks for the smaller of the two
(:func:`wanted_k`); the ranks agree on the largest asked.

The failures are the job's death notices (:mod:`ncclguard.store.deaths`: a rank killed, or ended as
stuck), which every rank reads from the job's store (:class:`FailureRate`).
"""

from __future__ import annotations

import math
import time

import torch.distributed as dist

from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store.bounded import bounded_store_call
from ncclguard.store.clients import unprefixed
from ncclguard.store.deaths import read_deaths

__all__ = ["MAX_EVERY", "FailureRate", "budget_k", "wanted_k", "young_k"]

MAX_EVERY = 1000  # a snapshot at least every 1000 steps, whatever it costs
READ_BOUND_S = 1.0  # one read of the death notices waits at most this long (a slow store: no update)


def budget_k(take_s: float, step_s: float, budget: float) -> int:
    """The smallest ``K`` that keeps a take of ``take_s`` under ``budget`` of the step time.

    Args:
        take_s: what one take costs the loop, seconds.
        step_s: the step time without takes, seconds.
        budget: the share of the step time snapshots may cost (0.02).

    Returns:
        ``K``, between 1 and :data:`MAX_EVERY`.
    """
    return max(1, min(MAX_EVERY, math.ceil(take_s / (budget * step_s))))


def young_k(take_s: float, step_s: float, mtbf_s: float) -> int:
    """Young's interval ``sqrt(2 x take x MTBF)``, in steps (at least 1).

    Args:
        take_s: what one take costs the loop, seconds.
        step_s: the step time without takes, seconds.
        mtbf_s: the mean time between failures, seconds.

    Returns:
        ``K``, between 1 and :data:`MAX_EVERY`.
    """
    return max(1, min(MAX_EVERY, round(math.sqrt(2 * take_s * mtbf_s) / step_s)))


def wanted_k(take_s: float, step_s: float, budget: float, mtbf_s: float | None) -> int:
    """The ``K`` this rank asks for: the budget's, or Young's where failures make it shorter.

    Args:
        take_s: what one take costs the loop, seconds.
        step_s: the step time without takes, seconds.
        budget: the share of the step time snapshots may cost without failures.
        mtbf_s: the mean time between failures seen so far; None before the first.

    Returns:
        ``K``, between 1 and :data:`MAX_EVERY`.
    """
    k = budget_k(take_s, step_s, budget)
    return k if mtbf_s is None else min(k, young_k(take_s, step_s, mtbf_s))


class FailureRate:
    """The job's mean time between failures, from its death notices (the same on every rank, but
    for when each began to count).

    Args:
        started: when this rank's count begins (``time.time()``; a restarted process counts from
            the job's first failure, which is older).
    """

    def __init__(self, started: float | None = None) -> None:
        self.started = time.time() if started is None else started
        self.seen = 0  # notices read so far
        self.times: list[float] = []  # when each failure was posted (``DeathNotice.at``)

    def note(self, times: list[float]) -> None:
        """Counts failures posted at ``times`` (what a read of the notices found)."""
        self.times.extend(times)

    def mtbf_s(self, now: float | None = None) -> float | None:
        """The time since the count began (or the first failure, if older) over the failures; None
        before the first.

        Args:
            now: ``time.time()`` (default: now).
        """
        if not self.times:
            return None
        now = time.time() if now is None else now
        return max(now - min(self.started, *self.times), 1e-3) / len(self.times)

    def read(self, store: dist.Store) -> float | None:
        """Reads the notices posted since the last read (bounded; a slow store leaves the count as it
        was) and returns :meth:`mtbf_s`.

        Args:
            store: the job's store (prefixes are taken off).
        """
        job = unprefixed(store)
        try:
            seen, notices = bounded_store_call(
                job, lambda: read_deaths(job, self.seen), Deadline.within(READ_BOUND_S), "the death notices"
            )
        except (StoreUnreachable, RuntimeError, dist.DistStoreError):
            return self.mtbf_s()
        self.seen = seen
        self.note([n.at for n in notices])
        return self.mtbf_s()
