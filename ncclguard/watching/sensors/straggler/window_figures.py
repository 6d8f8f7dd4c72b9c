"""The measurement: one rank's figures over a straggler window, from its flight records or from the
backend's arrival times, and its main thread's run delay. Pure but for :func:`run_delay` (one /proc read)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ncclguard.incidents.model import Heartbeat, StragglerWindow

__all__ = [
    "LINK_MIN_NUMEL",
    "MIN_OPS",
    "delay_at",
    "fresh_windows",
    "from_arrivals",
    "measure",
    "phase_name",
    "run_delay",
]

LINK_MIN_NUMEL = 16384  # elements (64 KiB of float32): smaller ops time the host's scheduling, not the link
MIN_OPS = 3  # collectives completed in a window, on the rank and on each peer compared: below, no finding


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
    mine, covered = _in_window(records, start, end, thread, capacity)
    length = end - covered
    if length <= 0:
        return None
    split = _split_time(mine, covered, end, phase_now)
    waits, compute, durations, transfers = split.waits, split.compute, split.durations, split.transfers
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


def _in_window(
    records: Sequence[_RecordLike], start: float, end: float, thread: int | None, capacity: int | None
) -> tuple[list[_RecordLike], float]:
    """The thread's synchronous records that overlap the window, oldest first, and where the window's
    figures begin: ``start``, or the oldest record kept when the recorder dropped older ones."""
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
    return mine, covered


@dataclass
class _Split:
    """A window's time, split: waits per op, compute per phase, completed ops' durations."""

    waits: dict[str, float] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)
    transfers: list[float] = field(default_factory=list)  # the durations of the ops large enough to time the link


def _split_time(mine: Sequence[_RecordLike], covered: float, end: float, phase_now: str) -> _Split:
    """The time before each op is compute in that op's phase, the op's own time a wait, and the time
    after the last one compute in ``phase_now``."""
    split = _Split()
    waits, compute = split.waits, split.compute
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
                split.durations.append(rec_end - begin)
                if rec.numel >= LINK_MIN_NUMEL:
                    split.transfers.append(rec_end - begin)
        cursor = max(cursor, rec_end)
    if end > cursor:
        name = phase_name(phase_now)
        compute[name] = compute.get(name, 0.0) + end - cursor
    return split


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


def _arrival_map(w: StragglerWindow) -> dict[int, float]:
    """A window's arrivals by backend number (the first of a number repeated: garbage is not trusted),
    on the reference rank's clock: less the rank's clock offset where it tells one (see ``clocks``)."""
    shift = w.clock_offset_s or 0.0
    out: dict[int, float] = {}
    for seq, at in w.arrivals:
        out.setdefault(seq, at - shift)
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
    these windows give no link finding.

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
        if w.input_s is not None:  # the input pipeline's time at its window's rate over the span
            update["input_s"] = min(span, w.input_s * span / w.length_s)
        return w.model_copy(update={**update, "op": w.backend_op or w.op})

    return derived(own, mine), {r: derived(peers[r], m) for r, m in maps.items()}
