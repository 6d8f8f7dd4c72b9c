"""Straggler detection: which rank is slower than its peers, window after window, and where its time goes.

In a synchronous collective every rank leaves when the last one arrives, so the slow rank waits the
least and its peers wait for it. Each rank measures, per window of ``straggler_window_s``, its time
outside collectives (*compute*) and inside them (*wait*, from ncclguard's records of the main thread's
synchronous collectives), and publishes the figures in its heartbeat (:class:`StragglerWindow`). At each
window it compares its figures with its watched peers' (the heartbeats it reads anyway, so the store
traffic does not grow with the world):

- **compute**: its compute share is ``straggler_threshold`` times its peers' median or more, by at least
  ``straggler_min_share`` of the window, while it waits less than they do: it is the one they wait for.
  Where every rank compared tells its run delay (the time its main thread was runnable but got no CPU,
  :func:`run_delay`), compute is counted less that delay and the delay with the waits: on a loaded
  host the scheduler starves one rank, then another, which is the host's doing, not the rank's work;
- **link**: nobody computes more, but the transfer itself (the least median time of an op of at least
  :data:`LINK_MIN_NUMEL` elements among the rank and its peers: what even the last to arrive pays) is ``straggler_link_threshold`` times what it was in
  the earlier windows, costing ``straggler_min_share`` of the window or more, while the rank's compute
  between two ops holds within ``straggler_threshold`` of what it was (a loaded machine slows both).

Where a window's records hold too few ops but the world group's backend ran more (a loop that only
calls DDP: its bucket all_reduce is issued from C++), the window carries the backend's arrival times
instead, read once from torch's flight recorder, and the compute rule judges figures derived from them
(:func:`from_arrivals`; no link verdict).

``straggler_windows`` such windows in a row raise one ``straggler`` incident (once per rank and cause in a
world). Everything here but :class:`StragglerWatch` is pure: it takes records and figures, no clock.
See ``docs/stragglers.md``.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from ncclguard._log import log
from ncclguard._naming import rank_ranges
from ncclguard.incidents.model import (
    MAX_ARRIVALS,
    Heartbeat,
    IncidentKind,
    StragglerReport,
    StragglerWindow,
    WindowEvidence,
)
from ncclguard.recording.flight import recorder
from ncclguard.recording.phase import main_thread_phase
from ncclguard.recording.steps import StepMarks, steps
from ncclguard.watching.detect import Detection
from ncclguard.watching.settings import WatchdogConfig

__all__ = [
    "ArrivalSource",
    "Assessment",
    "StragglerTracker",
    "StragglerWatch",
    "assess",
    "delay_at",
    "from_arrivals",
    "fresh_windows",
    "from_config",
    "measure",
    "phase_name",
    "run_delay",
]

H = TypeVar("H", bound=Heartbeat)
MAX_SLOWDOWN = 1000.0  # a finite stand-in for "its peers computed nothing" (the store refuses inf)
BASELINE_WINDOWS = 8  # earlier windows whose median transfer is the link's baseline
LINK_MIN_NUMEL = 16384  # elements (64 KiB of float32): smaller ops time the host's scheduling, not the link
DELAY_SAMPLES = 1024  # run delay samples kept, one a watchdog tick: 20 s of ticks at the least poll (0.02 s)
MIN_OPS = 3  # collectives completed in a window, on the rank and on each peer compared: below, no verdict


class ArrivalSource(Protocol):
    """The world group's backend as a straggler window reads it
    (:class:`~ncclguard.watching.snapshot.WorldArrivals` on a live rank)."""

    def seq(self) -> int | None:
        """The world group's backend sequence number, None where unknown."""
        ...

    def arrivals(self, start: float, end: float, last: int) -> tuple[str, list[tuple[int, float]]]:
        """torch's name of the op, and the newest ``last`` ``(collective_seq_id, arrival time)``
        of ``[start, end)``, oldest first."""
        ...


class _RecordLike(Protocol):
    """A flight record or its plain-data form."""

    op: str
    numel: int
    start: float
    end: float | None
    phase: str
    async_op: bool
    thread: int


def run_delay(native_id: int | None) -> float | None:
    """The seconds thread ``native_id`` of this process has spent runnable but not running, so far.

    Linux's ``/proc/self/task/<tid>/schedstat`` (its second field: the time on a run queue, in ns).

    Args:
        native_id: the thread's OS id (``threading.Thread.native_id``).

    Returns:
        The run delay, or None where the OS does not tell (not Linux, no schedstat, no such thread).
    """
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def delay_at(samples: Sequence[tuple[float, float]], at: float) -> float | None:
    """The run delay at time ``at``, interpolated between the samples ``(time, run delay)`` around it
    (oldest first); None when ``at`` is outside them."""
    before = None
    for t, d in samples:
        if t >= at:
            if before is None:
                return d if t == at else None
            t0, d0 = before
            return d0 + (d - d0) * (at - t0) / (t - t0) if t > t0 else d
        before = (t, d)
    return None


def phase_name(path: str) -> str:
    """A phase path without its labels: ``"train step=3 > fwd"`` -> ``"train > fwd"``."""
    return " > ".join(part.split(" ", 1)[0] for part in path.split(" > ")) if path else ""


def measure(
    records: Sequence[_RecordLike],
    start: float,
    end: float,
    *,
    thread: int | None,
    n: int,
    phase_now: str = "",
    steps: int | None = None,
    capacity: int | None = None,
    run_delay_s: float | None = None,
) -> StragglerWindow | None:
    """One rank's figures over the window ``[start, end]`` from its flight records.

    Only the synchronous records of ``thread`` count as waits (an async op's wait happens elsewhere).
    The time before each op is compute in that op's phase; the time after the last one, in ``phase_now``
    (phases by name, without their labels: :func:`phase_name`).

    Args:
        records: the flight records, oldest first.
        start, end: the window, in ``time.time()`` seconds.
        thread: the ident of the thread that issues the collectives (the main thread).
        n: the window's number.
        phase_now: the thread's phase at ``end``.
        steps: step marks in the window, if the loop marks steps.
        capacity: the recorder's size: when ``records`` is that long and none ends before ``start``,
            the oldest were dropped and the window is measured from the oldest record kept.
        run_delay_s: the thread's run delay over the window (:func:`run_delay`), None if unknown.

    Returns:
        The figures, or None when the window covers no time.
    """
    mine: list[_RecordLike] = []
    reached = False
    for rec in reversed(records):
        if rec.thread != thread or rec.async_op or rec.start >= end:
            continue  # another thread's, async, or begun after the window (it closes a tick late)
        if (rec.end if rec.end is not None else end) <= start:
            reached = True
            break
        mine.append(rec)
    mine.reverse()
    covered = start
    if not reached and capacity is not None and len(records) >= capacity and records:
        covered = max(start, records[0].start)
    length = end - covered
    if length <= 0:
        return None
    waits: dict[str, float] = {}
    compute: dict[str, float] = {}
    durations: list[float] = []
    transfers: list[float] = []  # the durations of the ops large enough to time the link
    cursor = covered
    for rec in mine:
        rec_end = min(rec.end if rec.end is not None else end, end)
        begin = max(rec.start, covered)
        if begin > cursor:
            name = phase_name(rec.phase)
            compute[name] = compute.get(name, 0.0) + begin - cursor
        if rec_end > begin:
            waits[rec.op] = waits.get(rec.op, 0.0) + max(0.0, rec_end - max(begin, cursor))
            if rec.end is not None:  # completed: an op still in flight is a wait, not yet an op
                durations.append(rec_end - begin)
                if rec.numel >= LINK_MIN_NUMEL:
                    transfers.append(rec_end - begin)
        cursor = max(cursor, rec_end)
    if end > cursor:
        name = phase_name(phase_now)
        compute[name] = compute.get(name, 0.0) + end - cursor
    wait = min(sum(waits.values()), length)
    return StragglerWindow(
        n=n,
        end=end,
        length_s=length,
        compute_s=max(0.0, length - wait),
        wait_s=wait,
        ops=len(durations),
        op_wait_s=statistics.median(transfers) if transfers else 0.0,
        transfer_ops=len(transfers),
        steps=steps,
        run_delay_s=None if run_delay_s is None else min(max(0.0, run_delay_s), length),
        phase=max(compute, key=lambda k: compute[k])[:200] if compute else "",
        op=max(waits, key=lambda k: waits[k])[:80] if waits else "",
    )


def fresh_windows(beats: Mapping[int, Heartbeat], own: StragglerWindow) -> dict[int, StragglerWindow]:
    """The peers' windows of the same number as ``own`` (the same span of the wall clock), closed
    within two window lengths of it (an old one says nothing about now: a peer that stopped beating is
    the ``lost`` detector's)."""
    oldest = own.end - 2 * own.length_s
    return {
        r: hb.window
        for r, hb in beats.items()
        if hb.window is not None and hb.window.n == own.n and hb.window.end >= oldest
    }


@dataclass(frozen=True)
class Assessment:
    """One window of one rank against its peers."""

    evidence: WindowEvidence
    score: float  # the fastest compute share among it and its peers over its own: 1.0 is the fastest
    compute_slow: bool
    link_slow: bool


def _arrival_map(w: StragglerWindow) -> dict[int, float]:
    """A window's arrivals by backend number (the first of a number repeated: garbage is not trusted)."""
    out: dict[int, float] = {}
    for seq, at in w.arrivals:
        out.setdefault(seq, at)
    return out


def from_arrivals(
    own: StragglerWindow, peers: Mapping[int, StragglerWindow]
) -> tuple[StragglerWindow, dict[int, StragglerWindow]] | None:
    """Windows whose compute and wait come from the backend's arrival times instead of ncclguard's
    records: for a loop whose collectives are issued from C++ (DDP's bucket all_reduce).

    Over the ops numbered alike in ``own``'s arrivals and each kept peer's (at least
    :data:`MIN_OPS` + 1; a peer sharing fewer is left out), op ``k`` is released when the last rank
    reaches it, ``R(k) = max_s a_s(k)``. Rank ``r`` waits ``R(k) - a_r(k)`` at op ``k`` and computes
    the rest of the span from ``R(first)`` to ``R(last)``, the same span for every rank. The transfer
    after ``R(k)`` counts as every rank's compute alike, which pulls the ratio toward 1 (a rank with
    ``s`` more compute ``C`` and transfer ``T`` reads ``(C(1+s) + T) / (C + T)``: conservative).
    An op that some rank passed without waiting (it reached the next op before ``R(k)``: an async
    op, as DDP issues several buckets in one backward) is no wait for anyone. Each run delay is
    taken over the span: as measured between the rank's first and last arrival
    (``arrivals_run_delay_s``, scaled to the span), else at its window's rate. No transfer is timed:
    these windows give no link verdict.

    Args:
        own: this rank's window, with arrivals.
        peers: its peers' windows of the same number.

    Returns:
        ``own`` and the kept peers with ``compute_s``, ``wait_s``, ``length_s`` (the span), ``ops``
        (the ops compared less one) and the run delay over the span; None without enough common ops.
    """
    mine = _arrival_map(own)
    need = MIN_OPS + 1
    maps = {r: m for r, m in ((r, _arrival_map(w)) for r, w in peers.items()) if len(m.keys() & mine.keys()) >= need}
    if not maps:
        return None
    common = sorted(set(mine).intersection(*maps.values()))
    if len(common) < need:
        return None
    ranks = [mine, *maps.values()]
    release = [max(m[k] for m in ranks) for k in common]
    span = release[-1] - release[0]
    if not span > 0:
        return None
    # Op i holds every rank until R(i) unless some rank reached op i + 1 before R(i).
    held = [
        i + 1 == len(common) or common[i + 1] != common[i] + 1 or min(m[common[i + 1]] for m in ranks) >= release[i]
        for i in range(len(common))
    ]

    def derived(w: StragglerWindow, m: Mapping[int, float]) -> StragglerWindow:
        wait = min(span, sum(release[i] - m[k] for i, k in enumerate(common) if i > 0 and held[i]))
        delay = None if w.run_delay_s is None else min(span, w.run_delay_s * span / w.length_s)
        own_span = max(m.values()) - min(m.values())
        if delay is not None and w.arrivals_run_delay_s is not None and own_span > 0:
            delay = min(span, w.arrivals_run_delay_s * span / own_span)  # measured over its own arrivals' span
        update: dict[str, object] = {"length_s": span, "compute_s": span - wait, "wait_s": wait}
        update |= {"ops": len(common) - 1, "transfer_ops": 0, "op_wait_s": 0.0, "run_delay_s": delay}
        return w.model_copy(update={**update, "op": w.backend_op or w.op})

    return derived(own, mine), {r: derived(peers[r], m) for r, m in maps.items()}


def _share(w: StragglerWindow, what: str) -> float:
    return (w.compute_s if what == "compute" else w.wait_s) / w.length_s


def _work(w: StragglerWindow, runnable: bool) -> float:
    """The share of the window the rank computed with a CPU (``runnable``: less its run delay)."""
    delay = (w.run_delay_s or 0.0) if runnable else 0.0
    return max(0.0, w.compute_s - delay) / w.length_s


def assess(
    own: StragglerWindow,
    peers: Mapping[int, StragglerWindow],
    threshold: float,
    min_share: float,
    baseline_op_wait: float | None = None,
    *,
    link_threshold: float = 2.0,
    baseline_compute_per_op: float | None = None,
) -> Assessment | None:
    """Compares ``own`` with its peers' windows (see the module's docstring for the rules).

    Args:
        own: this rank's window.
        peers: its watched peers' fresh windows.
        threshold: the compute slowdown factor that counts (> 1).
        min_share: the least share of the window the slowdown must cost.
        baseline_op_wait: the transfer of the earlier windows (None: no link verdict yet).
        link_threshold: the transfer's slowdown factor that counts (> 1).
        baseline_compute_per_op: this rank's compute between two ops in the earlier windows: a link
            is slow only while that holds within ``threshold`` (a loaded machine slows both).

    Returns:
        The assessment, or None without peers to compare with (a window with fewer than
        :data:`MIN_OPS` completed collectives, its own or a peer's, is not compared). When ``own``
        has fewer but carries the backend's arrivals, it is compared with the peers that carry
        them too, on figures from :func:`from_arrivals` (evidence ``source="backend"``).
    """
    source = "records"
    if own.ops < MIN_OPS and own.arrivals:
        backend = from_arrivals(own, {r: w for r, w in peers.items() if w.ops < MIN_OPS and w.arrivals})
        if backend is not None:
            (own, peers), source = backend, "backend"
    peers = {r: w for r, w in peers.items() if w.ops >= MIN_OPS}
    if not peers or own.ops < MIN_OPS:
        return None  # no steps to compare: a hang or a pause (the hang detectors' business), or no collectives
    cf, wf = _share(own, "compute"), _share(own, "wait")
    ref_c, ref_w = (
        statistics.median(_share(w, "compute") for w in peers.values()),
        statistics.median(_share(w, "wait") for w in peers.values()),
    )
    # Compute is judged less the time the rank was runnable but got no CPU (its run delay): on a
    # loaded host the scheduler starves one rank, then another, by 20% of a window and more, which
    # is the host's doing, not more work (docs/stragglers.md). Only when every rank compared tells
    # its run delay; otherwise wall-clock compute for all.
    runnable = own.run_delay_s is not None and all(w.run_delay_s is not None for w in peers.values())
    mine, pw = _work(own, runnable), [_work(w, runnable) for w in peers.values()]
    ref = statistics.median(pw)
    slowdown = min(mine / ref, MAX_SLOWDOWN) if ref > 0 else (MAX_SLOWDOWN if mine > 0 else 1.0)
    score = min(1.0, min([*pw, mine]) / mine) if mine > 0 else 1.0
    # The physics check: its peers wait for it. Told run delays, a rank that waited for a CPU did not
    # work meanwhile either, so that time counts with its waits (1 - its work share).
    idle, ref_idle = (1.0 - mine, 1.0 - ref) if runnable else (wf, ref_w)
    compute_slow = slowdown >= threshold and mine - ref >= min_share and idle < ref_idle
    timed = [w.op_wait_s for w in (own, *peers.values()) if w.transfer_ops >= MIN_OPS]
    transfer = min(timed) if timed else 0.0
    per_op = own.compute_s / own.ops
    link_slow = (
        not compute_slow
        and own.transfer_ops >= MIN_OPS
        and baseline_op_wait is not None
        and baseline_op_wait > 0
        and transfer >= link_threshold * baseline_op_wait
        and baseline_compute_per_op is not None
        and per_op < threshold * baseline_compute_per_op
        and (transfer - baseline_op_wait) * own.transfer_ops / own.length_s >= min_share
    )
    evidence = WindowEvidence(
        n=own.n,
        end=own.end,
        compute_frac=round(cf, 4),
        wait_frac=round(wf, 4),
        peers_compute_frac=round(ref_c, 4),
        peers_wait_frac=round(ref_w, 4),
        slowdown=round(slowdown, 4),
        run_delay_frac=round((own.run_delay_s or 0.0) / own.length_s, 4) if runnable else None,
        work_frac=round(mine, 4) if runnable else None,
        peers_work_frac=round(ref, 4) if runnable else None,
        op_wait_s=round(transfer, 6),
        baseline_op_wait_s=None if baseline_op_wait is None else round(baseline_op_wait, 6),
        phase=own.phase,
        op=own.op,
        source=source,
        common_ops=own.ops + 1 if source == "backend" else None,
    )
    return Assessment(evidence, round(max(0.0, score), 4), compute_slow, link_slow)


@dataclass
class StragglerTracker:
    """One rank's assessments window after window, and the incidents they make.

    Args:
        rank: this rank.
        threshold, min_share, link_threshold: see :func:`assess`.
        windows: slow windows in a row that make an incident.
    """

    rank: int
    threshold: float
    min_share: float
    windows: int
    link_threshold: float = 2.0
    score: float | None = None
    assessed: int = 0  # windows assessed against peers
    compute_run: list[WindowEvidence] = field(default_factory=list)
    link_run: list[WindowEvidence] = field(default_factory=list)
    transfers: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    per_op: deque[float] = field(default_factory=lambda: deque(maxlen=BASELINE_WINDOWS))
    fired: set[str] = field(default_factory=set)

    @property
    def baseline(self) -> float | None:
        """The median transfer of the earlier windows that were not slow; None before the first."""
        return statistics.median(self.transfers) if self.transfers else None

    def feed(self, own: StragglerWindow, peers: Mapping[int, StragglerWindow]) -> Detection | None:
        """Takes in this rank's new window and its peers' fresh ones.

        Returns:
            The straggler incident to raise, the first time a cause holds ``windows`` windows in a row.
        """
        per_op = statistics.median(self.per_op) if self.per_op else None
        found = assess(
            own,
            peers,
            self.threshold,
            self.min_share,
            self.baseline,
            link_threshold=self.link_threshold,
            baseline_compute_per_op=per_op,
        )
        if found is None:
            return None
        self.assessed += 1
        self.score = found.score
        ev = found.evidence
        self.compute_run = [*self.compute_run, ev][-self.windows :] if found.compute_slow else []
        self.link_run = [*self.link_run, ev][-self.windows :] if found.link_slow else []
        base = self.baseline
        healthy = base is None or ev.op_wait_s < self.link_threshold * base
        if not found.link_slow and ev.op_wait_s > 0 and healthy:
            # A window whose transfer is already past the threshold stays out of the baseline even
            # when another rule kept it from counting (its compute moved under load): taken in, a
            # few such windows raised the baseline to the slow link's level and the link was never
            # reported (a fresh-clone run with the suite's other tests beside it).
            self.transfers.append(ev.op_wait_s)
            self.per_op.append(own.compute_s / own.ops)
        if len(self.compute_run) >= self.windows and "compute" not in self.fired:
            self.fired.add("compute")
            return self._compute(self.compute_run)
        if len(self.link_run) >= self.windows and "link" not in self.fired:
            self.fired.add("link")
            return self._link(self.link_run, sorted({self.rank, *peers}))
        return None

    def _compute(self, run: list[WindowEvidence]) -> Detection:
        slowdown = round(statistics.median(e.slowdown for e in run), 3)
        phase = run[-1].phase or "no phase"
        waits = f"; its peers wait for it in {run[-1].op}" if run[-1].op else ""
        if run[-1].source == "backend":  # the figures are torch's arrival times, not ncclguard's records
            waits += ", timed by torch's flight recorder, which sees the collectives issued from C++"
        where = f"compute in phase {phase!r}{waits}"
        report = StragglerReport(rank=self.rank, cause="compute", slowdown=slowdown, where=where, windows=run)
        cpu = " (less the time each waited for a CPU)" if run[-1].work_frac is not None else ""
        reason = (
            f"rank {self.rank} is a compute straggler: {slowdown:.2f}x its peers' compute time{cpu} over "
            f"{len(run)} windows ({where})"
        )
        return Detection(
            IncidentKind.STRAGGLER, reason, f"straggler/compute/{self.rank}", ranks=(self.rank,), straggler=report
        )

    def _link(self, run: list[WindowEvidence], ranks: list[int]) -> Detection:
        base = run[0].baseline_op_wait_s or 0.0
        slowdown = round(statistics.median(e.op_wait_s / base for e in run), 3) if base > 0 else MAX_SLOWDOWN
        op = run[-1].op or "its collectives"
        where = f"the transfer itself in {op}: {run[-1].op_wait_s * 1e3:.1f} ms an op, {base * 1e3:.1f} ms before"
        report = StragglerReport(
            rank=self.rank, cause="link", slowdown=slowdown, where=where, ranks=ranks[:1024], windows=run
        )
        reason = (
            f"a slow link: the transfers of ranks {rank_ranges(ranks)} are {slowdown:.2f}x slower than before over "
            f"{len(run)} windows, with no rank computing more ({where})"
        )
        return Detection(IncidentKind.STRAGGLER, reason, "straggler/link", ranks=tuple(ranks), straggler=report)


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
    """

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
    ) -> None:
        self.window_s, self.enabled, self.marks, self.backend = window_s, enabled, marks, backend
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
        self.delay, self.start, self.seq = delay, end, seq
        self.window = win if win is not None else self.window

    def _with_arrivals(self, win: StragglerWindow, start: float, end: float) -> StragglerWindow:
        """``win`` with the backend's arrivals (read only when the records hold too few ops and the
        world group's backend ran enough for a verdict: torch's recorder costs milliseconds to read)."""
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
    """A :class:`StragglerWatch` with the ``straggler_*`` settings of ``cfg`` (``backend``: see it)."""
    return StragglerWatch(
        rank,
        cfg.straggler_window,
        cfg.straggler_threshold,
        cfg.straggler_min_share,
        cfg.straggler_windows,
        cfg.straggler_link_threshold,
        cfg.straggler,
        backend=backend,
    )
