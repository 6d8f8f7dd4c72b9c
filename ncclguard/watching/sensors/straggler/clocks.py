"""Clocks: each rank's wall clock against the reference rank's (rank 0 of the world), from the store.

torch stamps a rank's arrival at a collective with its host's wall clock (``time_created_ns``), so ranks
on two hosts compare their arrivals only once the offset between the clocks is out: on 50 ms steps a
10 ms offset reads as a 1.22x straggler (docs/stragglers.md). The offsets are measured from what the
ranks already share, the job's store, by the principle of a collective: one event releases every
waiting rank at nearly the same instant. The reference rank's thread sets a key every ``period``, its
value the reference's clock just before the set (plus half its round trip to the store); every other
rank's thread waits for that key on its own connection, and the store's server releases every waiter
as it stores the key. A rank's reading as it is released, less half its own round trip, less the
reference's value, is its offset plus what the trips' asymmetry and its wake-up add: a delay only ever
adds, so the least of the last :data:`SAMPLES` samples is the estimate (NTP's shortest-round-trip
filter). Measured on this machine: two waiters were released 0.15 ms and 0.23 ms after a set began,
the round trip of a ``check`` 0.02-0.15 ms.

:class:`OffsetFilter` is pure; :class:`ClockTicker` is the thread (one store client of its own, so the
watchdog's calls never queue behind a wait; every call through the store layer's bounded calls, each
reading of the clock taken on the thread that made the call, as it returned). A tick that does not
come within its bound (the reference gone) is not waited for again: the ticker polls the reference's
counter, without waiting, until it moves.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ncclguard._log import log
from ncclguard.deadlines import Deadline
from ncclguard.store.clients import connect
from ncclguard.store.clock_samples import await_tick, last_tick, post_tick, round_trip

__all__ = ["SAMPLES", "ClockTicker", "OffsetFilter", "join_tickers"]

SAMPLES = 8  # the samples the estimate is the least of
_FAST_TICKS = 4  # the first ticks come every half second, so that the first windows are corrected
_CALL_S = 10.0  # the bound of one store call of the ticker (a wait: its own bound and this)
# A wait for a tick, and a rest between ticks, is cut in slices this long: the thread sees its end
# (alive() False) within one, so that the interpreter's exit can wait for it (join_tickers).
_SLICE_S = 1.0
# A waiting rank rests until this long before the next tick is due, then waits for it: a wait that
# times out logs two warning lines in torch 2.13's TCPStore client ("waitForInput: poll for socket ...
# timed out after 1000ms"), and waiting a whole period in slices logged them 4 times per tick per rank.
_EARLY_S = 0.5
_tickers: weakref.WeakSet[ClockTicker] = weakref.WeakSet()


def join_tickers(wait_s: float = _CALL_S + 2 * _SLICE_S) -> int:
    """Waits, at most ``wait_s`` in all, for the clock threads whose watch is over to end.

    The interpreter's exit calls it once the watchdog has stopped, before it waits for the store
    calls under way (:func:`~ncclguard.store.bounded.drain_at_exit`): a ticker that started a new
    call after that wait would be ended inside it at finalization, and the process would abort
    (``terminate called without an active exception``; seen on a rank that ended while its peers
    still worked, 4 launches in 10).

    Args:
        wait_s: how long to wait in all.

    Returns:
        How many of them still run.
    """
    deadline = time.monotonic() + wait_s
    over = [t for t in list(_tickers) if t.is_alive() and not t.alive()]
    for ticker in over:
        ticker.join(max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t in over)


class OffsetFilter:
    """The offset of this rank's clock from the reference's: the least of the newest samples.

    Args:
        size: the samples kept (clocks drift: old samples go).
    """

    def __init__(self, size: int = SAMPLES) -> None:
        self.samples: deque[float] = deque(maxlen=size)

    def add(self, released_at: float, own_half_rtt: float, reference_at: float) -> None:
        """One tick: this rank's clock when the store released it, half its round trip to the store,
        and the reference's value (its clock before the set plus half its round trip)."""
        self.samples.append(released_at - own_half_rtt - reference_at)

    @property
    def estimate(self) -> float | None:
        """This rank's clock less the reference's, in seconds; None before the first sample."""
        return min(self.samples) if self.samples else None


def _round_trip(client: Any, key: str) -> float:
    """The least of 3 round trips to the store, in seconds."""
    return min(round_trip(client, key, Deadline.within(_CALL_S)) for _ in range(3))


class ClockTicker(threading.Thread):
    """The thread that measures this rank's clock offset (or, on the reference, gives the ticks).

    Args:
        addr: the store's ``host:port``.
        prefix: the keys' prefix (the job's, session's and generation's namespace).
        reference: True on the rank whose clock the others are measured against.
        period: seconds between ticks (the first :data:`_FAST_TICKS` come faster).
        alive: the thread ends once this says False (the watch that started it is gone).
        clock: the wall clock (default ``time.time()``, looked up at each reading).
    """

    def __init__(
        self,
        addr: str,
        prefix: str,
        reference: bool,
        period: float,
        alive: Callable[[], bool],
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(name="ncclguard-clock", daemon=True)
        self.addr, self.prefix, self.reference, self.period = addr, prefix, reference, period
        self.alive = alive
        self.clock = clock if clock is not None else lambda: time.time()
        self.offsets = OffsetFilter()
        self.ticks = 0  # ticks given (reference) or received
        _tickers.add(self)

    @property
    def estimate(self) -> float | None:
        """This rank's clock less the reference's (0.0 on the reference), None while unmeasured."""
        return 0.0 if self.reference else self.offsets.estimate

    def run(self) -> None:
        try:
            host, _, port = self.addr.rpartition(":")
            client = connect(host, int(port), 30.0)
            half = _round_trip(client, f"{self.prefix}/rtt") / 2
            if self.reference:
                self._give(client, half)
            else:
                self._take(client, half)
        except Exception as exc:  # noqa: BLE001 - no offsets (arrivals are then compared as read), never a crash
            if self.alive():
                log.info("watchdog: straggler: the clock offset is not measured (%s)", exc)

    def _pause(self) -> float:
        return 0.5 if self.ticks < _FAST_TICKS else self.period

    def _give(self, client: Any, half: float) -> None:
        while self.alive():
            post_tick(client, self.prefix, self.ticks, lambda: self.clock() + half, SAMPLES, Deadline.within(_CALL_S))
            self.ticks += 1
            self._rest(self._pause())

    def _rest(self, seconds: float) -> None:
        """Sleeps ``seconds``, or less once the thread's watch is over."""
        end = time.monotonic() + seconds
        while self.alive() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, _SLICE_S / 4))

    def _last(self, client: Any) -> int:
        return last_tick(client, self.prefix, Deadline.within(_CALL_S))

    def _take(self, client: Any, half: float) -> None:
        following = self._last(client) + 1  # the next tick to wait for
        bound = max(30.0, 3 * self.period)
        since = time.monotonic()  # when the wait for ``following`` began
        while self.alive():
            called = time.monotonic()
            try:
                at, reference = await_tick(
                    client, self.prefix, following, _SLICE_S, self.clock, Deadline.within(_SLICE_S + _CALL_S)
                )
            except Exception:  # noqa: BLE001 - not in this slice: the tick is late, or the store failed
                self._rest(_SLICE_S - (time.monotonic() - called))  # a failure at once waits its slice
                # Poll for it rather than wait again (each wait that times out logs): a tick seen by a
                # poll is stamped late, so the sample is skipped and the next tick, when due, waited for.
                last = self._last(client)
                while self.alive() and last < following:
                    self._rest(_SLICE_S / 4 if time.monotonic() - since < bound else self.period)
                    last = self._last(client)
                following, since = last + 1, time.monotonic()
                self._rest((0.5 if following < _FAST_TICKS else self.period) - _EARLY_S)
                continue
            since = time.monotonic()
            self.offsets.add(at, half, reference)
            self.ticks += 1
            following += 1
            # The reference rests its pause after each tick: wait for the next one only when it is due.
            self._rest((0.5 if following < _FAST_TICKS else self.period) - _EARLY_S)
            last = self._last(client)
            if last >= following + SAMPLES // 2:  # fell behind (descheduled): catch up with the newest
                following = last + 1
