"""The meeting of a rebuild, in the job's store: who is still there, settled once for everyone.

Protocol for one attempt (keys from :class:`~ncclguard.recovery.protocol.MeetingKeys`):

1. each rank writes its :class:`Arrival` under ``a<rank>`` and increments ``n``;
2. the rank that makes ``n`` equal the world size settles the verdict ``v`` (everyone arrived)
   with compare-and-set; the others wait for ``v`` until their deadline, then settle it
   themselves from the arrivals present then. compare-and-set makes the first settlement final:
   every rank, late ones included, reads the same verdict, so all agree on the new world;
3. each rank named in the verdict increments ``gone`` when it leaves; the last one deletes the
   attempt's keys but the verdict, which stays (a few bytes) so that a rank arriving late learns
   at once that it was left out.

The communicator is never touched: the meeting works however broken the old group is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError

from ncclguard._log import log
from ncclguard.collectives.rendezvous import read_present
from ncclguard.errors import StoreUnreachable
from ncclguard.recovery.protocol import (
    MAX_ARRIVAL_BYTES,
    MAX_VERDICT_BYTES,
    Arrival,
    MeetingKeys,
    Verdict,
    check_arrivals,
    decide,
    parse,
)

__all__ = ["Meeting", "meet"]


@dataclass
class Meeting:
    """What one attempt told this rank.

    Attributes:
        verdict: the settled verdict, the same on every rank.
        late: this rank's arrival was not in the store when the verdict was settled.
        arrivals: the members' arrivals (empty when ``late``).
        problem: why the members refuse a settled ``ok`` verdict (they disagree), or None.
        elapsed_s: seconds spent meeting.
    """

    verdict: Verdict
    late: bool
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    problem: str | None = None
    elapsed_s: float = 0.0

    @property
    def goes_on(self) -> bool:
        """This rank is in the new world."""
        return self.verdict.ok and not self.late and self.problem is None


def _wait(store: Any, key: str, seconds: float) -> bool:
    try:
        # A zero timedelta would mean "the store's default"; a millisecond is "now".
        store.wait([key], timedelta(seconds=max(seconds, 0.001)))
        return True
    except DistStoreError:
        return False


def meet(store: Any, me: Arrival, attempt: int, deadline: float) -> Meeting:
    """Runs one attempt of the meeting toward generation ``me.generation + 1``.

    Args:
        store: the job's store (the same server on every rank).
        me: this rank's arrival.
        attempt: this rank's count of earlier attempts toward that generation.
        deadline: ``time.monotonic()`` value after which the ranks not there are given up.

    Returns:
        The meeting as this rank saw it.

    Raises:
        StoreUnreachable: the store did not answer, or wrote a verdict that cannot be read.
    """
    start = time.monotonic()
    keys = MeetingKeys(me.generation + 1, attempt)
    size = me.world_size
    try:
        store.set(keys.arrival(me.rank), me.model_dump_json())
        if store.add(keys.count, 1) >= size:
            raw = store.compare_set(keys.verdict, "", decide(list(range(size)), size, False).model_dump_json())
        elif _wait(store, keys.verdict, deadline - time.monotonic()):
            raw = store.get(keys.verdict)
        else:
            present = read_present(store, [keys.arrival(r) for r in range(size)])
            arrived = [int(k.rsplit("/a", 1)[1]) for k in present]
            raw = store.compare_set(keys.verdict, "", decide(arrived, size, me.allow_shrink).model_dump_json())
        try:
            verdict = parse(Verdict, raw, MAX_VERDICT_BYTES)
        except ValueError as exc:
            raise StoreUnreachable(f"the rebuild's verdict under {keys.verdict!r} cannot be read: {exc}") from exc
        late = me.rank not in verdict.arrived
        if late:
            return Meeting(verdict, True, elapsed_s=time.monotonic() - start)
        # Every rank in the verdict wrote its arrival before it was settled, and nobody deletes
        # before all of them have left: the reads below always find the keys.
        raw_arrivals = store.multi_get([keys.arrival(r) for r in verdict.arrived])
        if store.add(keys.gone, 1) >= len(verdict.arrived):
            for key in keys.transient(size):
                store.delete_key(key)
    except (DistStoreError, RuntimeError) as exc:  # connection refused / reset surface as RuntimeError
        if isinstance(exc, StoreUnreachable):
            raise
        raise StoreUnreachable(f"the job's store did not answer during the rebuild meeting: {exc}") from exc

    arrivals: dict[int, Arrival] = {}
    for rank, blob in zip(verdict.arrived, raw_arrivals, strict=True):
        try:
            arrivals[rank] = parse(Arrival, blob, MAX_ARRIVAL_BYTES)
        except ValueError as exc:
            log.error("rebuild: rank %d's arrival is unreadable (%s)", rank, exc)
    problem = check_arrivals(verdict, arrivals, size) if verdict.ok else None
    return Meeting(verdict, False, arrivals, problem, time.monotonic() - start)
