"""An incident's timeline as a Chrome/Perfetto trace (``trace.json``; open it in ui.perfetto.dev or
chrome://tracing): one process per rank with its collectives, its main thread's spans and the
backend's ops, the incident and each culprit marked, and each rank a numerical finding names (:func:`chrome_trace`, over
:func:`ncclguard.incidents.pictures.timeline`).
"""

from __future__ import annotations

from typing import Any

from ncclguard.incidents.model import BackendEntry, OpRecord, TrackSpan
from ncclguard.incidents.pictures import TID_BACKEND, TID_COLLECTIVES, TID_MAIN, Timeline, culprit_text

__all__ = ["chrome_trace"]


def chrome_trace(tl: Timeline) -> dict[str, Any]:
    """The timeline as Chrome trace event format (open it in ui.perfetto.dev or chrome://tracing).

    One process per rank (``pid`` = rank, named ``rank <r> (host:pid)``, sorted by rank) with three
    threads: ``collectives`` (``tid`` 0: each of ncclguard's records a complete event, ``ph: "X"``,
    in start order; one still open at the report drawn up to it with ``args.open = true``),
    ``main thread`` (``tid`` 1: its spans, named by phase or function) and ``backend`` (``tid`` 2:
    torch's flight-recorder entries, an instant event each, a complete one up to the report for an
    op still open). The incident is a global instant event, each culprit an instant event on its
    main thread, and so is each rank a numerical finding names (at the commit that named it). Times
    are microseconds from the earliest record (``otherData.t0``: that time, ``time.time()`` seconds).

    Args:
        tl: the timeline.

    Returns:
        The trace as JSON data (``{"traceEvents": [...], ...}``).
    """
    t0 = _trace_t0(tl)
    events: list[dict[str, Any]] = []
    for r, recs in tl.records.items():
        spans, entries = tl.spans.get(r, []), tl.backend.get(r, [])
        events += _rank_metadata(tl, r, empty=not (recs or spans or entries))
        events += [_record_event(rec, r, tl.report, t0) for rec in recs]
        events += [_span_event(span, r, t0) for span in spans]
        events += [_backend_event(e, r, tl.report, t0) for e in entries]
        if r in tl.culprits:
            name = culprit_text(tl, r)
            events.append({"ph": "i", "s": "p", "name": name, "pid": r, "tid": TID_MAIN, "ts": _us(tl.raised, t0)})
        if r in tl.marks:  # a numerical finding names it, where the commit named it
            name = f"numerical finding: {tl.marks[r]}"
            events.append({"ph": "i", "s": "p", "name": name, "pid": r, "tid": TID_MAIN, "ts": _us(tl.marked_at, t0)})
    events.append({"ph": "i", "s": "g", "name": f"incident {tl.title}", "pid": 0, "tid": 0, "ts": _us(tl.raised, t0)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0": t0, "incident": tl.title}}


def _trace_t0(tl: Timeline) -> float:
    """The trace's zero: the earliest record, span, backend entry or the incident itself."""
    starts = [rec.start for recs in tl.records.values() for rec in recs]
    starts += [s.start for spans in tl.spans.values() for s in spans]
    starts += [e.created for entries in tl.backend.values() for e in entries]
    marked = [tl.marked_at] if tl.marks else []
    return min([*starts, *marked, tl.raised]) if starts or tl.raised else 0.0


def _us(t: float, t0: float) -> float:
    """``t`` as the trace's microseconds from ``t0``."""
    return round((t - t0) * 1e6, 3)


def _dur_us(start: float, end: float) -> float:
    """The microseconds from ``start`` to ``end``, never negative."""
    return round(max(0.0, end - start) * 1e6, 3)


def _rank_metadata(tl: Timeline, r: int, empty: bool) -> list[dict[str, Any]]:
    """The metadata events of rank ``r``'s process: its name, its place (by rank) and its three threads."""
    name = f"rank {r}" + (f" ({tl.hosts[r]})" if r in tl.hosts else "") + (" (no records)" if empty else "")
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}},
    ]
    for tid, what in ((TID_COLLECTIVES, "collectives"), (TID_MAIN, "main thread"), (TID_BACKEND, "backend")):
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": what}})
    return events


def _record_event(rec: OpRecord, r: int, report: float, t0: float) -> dict[str, Any]:
    """A complete event of one of ncclguard's records; one still open is drawn up to the report."""
    end = rec.end if rec.end is not None else max(report, rec.start)
    return {
        "ph": "X",
        "name": rec.op,
        "cat": "p2p" if rec.peer is not None else "collective",
        "pid": r,
        "tid": TID_COLLECTIVES,
        "ts": _us(rec.start, t0),
        "dur": _dur_us(rec.start, end),
        "args": {
            "seq": rec.seq,
            "group": rec.group,
            "numel": rec.numel,
            "dtype": rec.dtype,
            "phase": rec.phase,
            "site": rec.site,
            "state": rec.state,
            "open": rec.end is None,
        },
    }


def _span_event(span: TrackSpan, r: int, t0: float) -> dict[str, Any]:
    """A complete event on the main thread: where it was, named by phase or function."""
    return {
        "ph": "X",
        "name": span.label,
        "cat": "phase" if span.phase else "function",
        "pid": r,
        "tid": TID_MAIN,
        "ts": _us(span.start, t0),
        "dur": _dur_us(span.start, span.end),
        "args": {"phase": span.phase, "func": span.func, "site": span.site},
    }


def _backend_event(e: BackendEntry, r: int, report: float, t0: float) -> dict[str, Any]:
    """An instant event of torch's flight recorder; one still open a complete event up to the report."""
    args = {"group": e.group, "seq": e.seq, "numel": e.numel, "p2p": e.p2p, "open": e.open}
    event = {"name": e.name, "cat": "backend", "pid": r, "tid": TID_BACKEND, "ts": _us(e.created, t0), "args": args}
    if e.open:
        event.update(ph="X", dur=_dur_us(e.created, report))
    else:
        event.update(ph="i", s="t")
    return event


# Span colours: pale, one per label, the same on every rank (a stable hash of the label).
