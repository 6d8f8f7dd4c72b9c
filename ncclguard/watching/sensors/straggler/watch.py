"""The watch: the straggler detection of one rank as the watchdog drives it (threads, clocks and /proc
at this edge; the rest of the package is pure)."""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Protocol, TypeVar

from ncclguard._log import log
from ncclguard.incidents.model import MAX_ARRIVALS, Heartbeat, StragglerWindow
from ncclguard.recording.flight import recorder
from ncclguard.recording.phase import main_thread_phase
from ncclguard.recording.steps import StepMarks, steps
from ncclguard.store.keys import Keys
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import store_addr
from ncclguard.watching.sensors.detect import Detection
from ncclguard.watching.sensors.straggler.clocks import ClockTicker
from ncclguard.watching.sensors.straggler.evidence import StragglerTracker
from ncclguard.watching.sensors.straggler.inputs import inputs, time_dataloaders
from ncclguard.watching.sensors.straggler.links import LinkMeter
from ncclguard.watching.sensors.straggler.window_figures import MIN_OPS, delay_at, fresh_windows, measure, run_delay

__all__ = ["DELAY_SAMPLES", "ArrivalSource", "StragglerWatch", "from_config"]

H = TypeVar("H", bound=Heartbeat)
DELAY_SAMPLES = 1024  # run delay samples kept, one a watchdog tick: 20 s of ticks at the least poll (0.02 s)


class ArrivalSource(Protocol):
    """The world group's backend as a straggler window reads it
    (:class:`~ncclguard.watching.sensors.rank_state.WorldArrivals` on a live rank)."""

    def seq(self) -> int | None:
        """The world group's backend sequence number, None where unknown."""
        ...

    def arrivals(self, start: float, end: float, last: int) -> tuple[str, list[tuple[int, float]]]:
        """torch's name of the op, and the newest ``last`` ``(collective_seq_id, arrival time)``
        of ``[start, end)``, oldest first."""
        ...


class StragglerWatch:
    """The watchdog's straggler detection on one rank: closes windows on the wall clock's multiples of
    ``window_s`` (every rank's window ``n`` covers the same span, so a burst of load on the host falls
    in the same window on every rank), puts the figures, the step and the score in the heartbeat, and
    assesses each window against the watched peers' window of the same number once they publish it.

    Args:
        rank: this rank.
        window_s: the window's length (closed at the first watchdog tick past its end).
        threshold, min_share, windows, link_threshold: see :class:`StragglerTracker`.
        enabled: False: the heartbeat carries the step only, nothing is measured.
        marks: the step marks to count (default: the process's).
        thread: the thread whose collectives count (default: the main thread).
        backend: the world group's backend, read when a window's records hold fewer than
            :data:`MIN_OPS` ops while the backend ran more (its arrivals, :func:`from_arrivals`);
            None: records only.
        links: read this process's TCP connections at each window (:class:`LinkMeter`).
    """

    name = "straggler"  # a sensor (watching/sensors/sensor.py); its figures have heartbeat fields of their own

    def __init__(
        self,
        rank: int,
        window_s: float,
        threshold: float,
        min_share: float,
        windows: int,
        link_threshold: float = 2.0,
        enabled: bool = True,
        marks: StepMarks = steps,
        thread: int | None = None,
        backend: ArrivalSource | None = None,
        links: bool = False,
    ) -> None:
        self.window_s, self.enabled, self.marks, self.backend = window_s, enabled, marks, backend
        self.inputs_timed = enabled and time_dataloaders()
        self.inputs_at = inputs.seconds
        self.links = LinkMeter() if enabled and links else None
        if self.links is not None:
            self.links.read()  # the counters the first window counts from
        self.clock: ClockTicker | None = None  # this rank's clock offset (from_config starts it)
        self.seq = backend.seq() if backend is not None and enabled else None
        self.thread = thread if thread is not None else threading.main_thread().ident
        self.native = next((t.native_id for t in threading.enumerate() if t.ident == self.thread), None)
        self.delay = run_delay(self.native)
        self.delays: deque[tuple[float, float]] = deque(maxlen=DELAY_SAMPLES)  # (time.time(), run delay)
        self.tracker = StragglerTracker(rank, threshold, min_share, windows, link_threshold)
        self.start = time.time()
        self.count = marks.count
        self.window: StragglerWindow | None = None
        self.assessed = -1  # the number of the last window assessed

    def tick(self, now: float | None = None) -> None:
        """Closes the window when the clock has passed its end (the watchdog calls it every tick)."""
        now = time.time() if now is None else now
        if self.enabled and self.backend is not None and self.native is not None:
            # The main thread's run delay at each tick (one /proc read), so that the arrivals' span,
            # a part of the window, is judged less the run delay it had, not the window's average.
            sample = run_delay(self.native)
            if sample is not None:
                self.delays.append((now, sample))
        if not self.enabled or now < (math.floor(self.start / self.window_s) + 1) * self.window_s:
            return
        end = math.floor(now / self.window_s) * self.window_s  # the last boundary passed
        # The steps and the run delay are read now, up to a tick after the boundary.
        marks, self.count = self.marks.count - self.count, self.marks.count
        delay = run_delay(self.native)
        win = measure(
            recorder.records(),
            self.start,
            end,
            thread=self.thread,
            n=max(0, round(end / self.window_s) - 1),
            phase_now=main_thread_phase(),
            steps=marks if self.marks.step is not None else None,
            capacity=recorder.size,
            run_delay_s=None if delay is None or self.delay is None else delay - self.delay,
        )
        seq, before = (self.backend.seq(), self.seq) if self.backend is not None else (None, None)
        ran = None if seq is None or before is None else seq - before  # collectives the backend ran
        if win is not None and win.ops < MIN_OPS and ran is not None and ran >= MIN_OPS + 1:
            win = self._with_arrivals(win, self.start, end)
        spent, self.inputs_at = inputs.seconds - self.inputs_at, inputs.seconds
        if win is not None:
            update: dict[str, object] = {"input_s": min(spent, win.length_s) if self.inputs_timed else None}
            update["clock_offset_s"] = None if self.clock is None else self.clock.estimate
            update["links"] = self.links.read() if self.links is not None else []
            win = win.model_copy(update=update)
        self.delay, self.start, self.seq = delay, end, seq
        self.window = win if win is not None else self.window

    def _with_arrivals(self, win: StragglerWindow, start: float, end: float) -> StragglerWindow:
        """``win`` with the backend's arrivals (read only when the records hold too few ops and the
        world group's backend ran enough for a finding: torch's recorder costs milliseconds to read)."""
        if self.backend is None:
            return win
        try:
            op, arrivals = self.backend.arrivals(start, end, MAX_ARRIVALS)
        except Exception as exc:  # noqa: BLE001 - a torch that dumps otherwise costs the window its arrivals, not the watchdog
            log.debug("watchdog: straggler: torch's flight recorder not read (%s)", exc)
            return win
        if not arrivals:
            return win
        arrivals = arrivals[-MAX_ARRIVALS:]
        first, last = min(t for _, t in arrivals), max(t for _, t in arrivals)
        lo, hi = delay_at(self.delays, first), delay_at(self.delays, last)
        span_delay = None if lo is None or hi is None else max(0.0, hi - lo)
        update = {"arrivals": arrivals, "backend_op": op[:80], "arrivals_run_delay_s": span_delay}
        return win.model_copy(update=update)

    def on_beat(self, hb: Heartbeat, now: float | None = None) -> Heartbeat:
        """``hb`` with the step, the score and the last window (closing one when due)."""
        self.tick(now)
        return self.stamp(hb)

    def stamp(self, hb: H) -> H:
        """``hb`` (a heartbeat or a statement) with the step, the score and the last window."""
        return hb.model_copy(
            update={"step": self.marks.step, "straggler_score": self.tracker.score, "window": self.window}
        )

    def check(self, beats: Mapping[int, Heartbeat], now: float | None = None) -> Detection | None:
        """Assesses this rank's newest window, once, against the watched peers' windows of its number
        in ``beats``; while a peer has not published it yet, for up to a window's length, it waits."""
        win = self.window
        if win is None or win.n == self.assessed:
            return None
        now = time.time() if now is None else now
        behind = any(hb.window is not None and hb.window.n < win.n for hb in beats.values())
        if behind and now - win.end < win.length_s:
            return None  # a peer has not closed or published this window yet: the next beat
        self.assessed = win.n
        found = self.tracker.feed(win, fresh_windows(beats, win))
        if found is not None:
            log.warning("watchdog: straggler: %s", found.reason)
        return found


def from_config(rank: int, cfg: WatchdogConfig, backend: ArrivalSource | None = None) -> StragglerWatch:
    """A :class:`StragglerWatch` with the ``straggler_*`` settings of ``cfg`` (``backend``: see it).

    On a live world of two ranks or more (``backend`` given), it also reads this process's TCP
    connections at each window and measures this rank's clock offset from rank 0's through the store
    (:class:`ClockTicker`, a thread of its own that ends with the thread calling this, or with the watch).
    """
    watch = StragglerWatch(
        rank,
        cfg.straggler_window,
        cfg.straggler_threshold,
        cfg.straggler_min_share,
        cfg.straggler_windows,
        cfg.straggler_link_threshold,
        cfg.straggler,
        backend=backend,
        links=backend is not None,
    )
    if cfg.straggler and backend is not None:
        _start_clock(watch, rank, cfg)
    return watch


def _start_clock(watch: StragglerWatch, rank: int, cfg: WatchdogConfig) -> None:
    import torch.distributed as dist

    from ncclguard.world import current_world

    addr = store_addr(cfg.store_addr)
    if addr is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    prefix = f"{Keys.from_env(cfg.session, current_world().generation).ns}/straggler-clock"
    owner, ref = threading.current_thread(), weakref.ref(watch)

    def alive() -> bool:
        # The ticker ends with the watchdog's thread, or once its watch is replaced (a new world).
        current = ref()
        return owner.is_alive() and current is not None and current.clock is ticker

    ticker = ClockTicker(addr, prefix, rank == 0, max(1.0, cfg.straggler_window / 2), alive)
    watch.clock = ticker
    ticker.start()
