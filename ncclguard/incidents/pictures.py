"""Pictures of an incident: a Chrome/Perfetto trace and a timeline PNG that tell its story.

:func:`timeline` merges, per rank, what the incident's files hold: the rank dumps
(``rank<r>.json``: every flight record the rank kept, where its main thread was as spans of one
phase or function, and torch's own flight-recorder entries, which include the collectives issued
from C++ by DDP, FSDP or DeepSpeed's engine) and the merged incident's statements (the newest 20
records and the ops in flight of each rank that spoke). :func:`chrome_trace` and
:func:`plot_timeline` draw the same three rows per rank:

- **main thread**: its phases, or outside any phase its functions, as spans (``evaluate()`` on the
  rank that is late, ``main()`` blocked in ``backward()`` on the ranks that wait);
- **collectives**: ncclguard's records of the Python calls (completed, in flight up to the report,
  failed);
- **backend**: torch's flight-recorder entries (a tick each; one still open drawn as a bar from
  when the rank reached it to the report);

with the incident raised (a dashed line) and the culprits named (in red, with why and where).
:func:`draw_later` writes ``timeline.png`` into an incident directory from a thread of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclguard._log import log
from ncclguard.incidents.model import (
    BackendEntry,
    HeartbeatView,
    Incident,
    OpRecord,
    StatementView,
    TrackSpan,
    upgrade_rank_dump,
)

__all__ = ["PICTURE_FILE", "Timeline", "auto_window", "chrome_trace", "draw_later", "plot_timeline", "timeline"]

PICTURE_FILE = "timeline.png"
MIN_WINDOW_S = 10.0  # the least a picture shows before the report
MAX_WINDOW_S = 300.0  # the most it shows when the story started earlier
# Trace threads (tid) of each rank's process: the collectives keep 0 (the track of earlier versions).
TID_COLLECTIVES, TID_MAIN, TID_BACKEND = 0, 1, 2


@dataclass
class Timeline:
    """What an incident's files say each rank did, merged per rank.

    Attributes:
        records: per rank, its flight records ordered by start time.
        spans: per rank, where its main thread was, oldest first.
        backend: per rank, torch's flight-recorder entries, oldest first.
        hosts: per rank, ``host:pid`` where known.
        raised: when the incident was raised (``time.time()``).
        report: when the report was written (open ops are drawn up to it).
        title: the incident's id, kind and summary.
        culprits: the culprit ranks and why (``behind``, ``lost``, ...).
        culprit_where: the culprits' place, as the report names it (``evaluate() at eval.py:88``).
    """

    records: dict[int, list[OpRecord]] = field(default_factory=dict)
    spans: dict[int, list[TrackSpan]] = field(default_factory=dict)
    backend: dict[int, list[BackendEntry]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    raised: float = 0.0
    report: float = 0.0
    title: str = ""
    culprits: dict[int, str] = field(default_factory=dict)
    culprit_where: dict[int, str] = field(default_factory=dict)


def _add(into: dict[tuple[str, int, str], OpRecord], recs: list[OpRecord]) -> None:
    for rec in recs:
        key = (rec.group, rec.seq, rec.op)
        old = into.get(key)
        if old is None or (old.end is None and rec.end is not None):
            into[key] = rec


def _place(phase: str, func: str, site: str) -> str:
    where = f"{func}() at {os.path.basename(site)}" if func and not func.startswith("<") else os.path.basename(site)
    return f"{where} (phase {phase})" if phase else where


def timeline(incident: Incident, where: Path | None = None) -> Timeline:
    """The merged records, spans and backend entries of ``incident`` and of the rank dumps in
    ``where`` (when given).

    Args:
        incident: the merged incident.
        where: its directory (rank dumps that do not parse are skipped with a log line).

    Returns:
        The timeline.
    """
    merged: dict[int, dict[tuple[str, int, str], OpRecord]] = {}
    tl = Timeline(
        raised=incident.incident.created or incident.written_at,
        report=incident.written_at,
        title=f"{incident.incident.id} ({incident.incident.kind.value}): {incident.summary}",
        culprits={c.rank: c.why.value for c in incident.culprits},
        culprit_where={c.rank: _place(c.phase, c.func, c.site) for c in incident.culprits if c.site != "?"},
    )
    for f in sorted(where.glob("rank*.json")) if where is not None else []:
        try:
            dump = upgrade_rank_dump(json.loads(f.read_text()), str(f))
        except (OSError, ValueError) as exc:
            log.warning("pictures: skipped %s: %s", f, str(exc).splitlines()[0] if str(exc) else exc)
            continue
        st = dump.statement
        _add(merged.setdefault(st.rank, {}), [*dump.records, *st.inflight])
        tl.hosts[st.rank] = f"{st.host}:{st.pid}"
        tl.spans[st.rank] = sorted(dump.track, key=lambda s: s.start)
        tl.backend[st.rank] = sorted(dump.backend, key=lambda e: e.created)
    for r, view in incident.ranks.items():
        if isinstance(view, StatementView | HeartbeatView):
            recs = [*view.recent, *view.inflight] if isinstance(view, StatementView) else list(view.inflight)
            _add(merged.setdefault(int(r), {}), recs)
            tl.hosts.setdefault(int(r), f"{view.host}:{view.pid}")
    for rank in range(incident.world_size):
        merged.setdefault(rank, {})
    tl.records = {r: sorted(recs.values(), key=lambda x: (x.start, x.seq)) for r, recs in sorted(merged.items())}
    if tl.report <= 0:
        times = [rec.end or rec.start for recs in tl.records.values() for rec in recs]
        times += [s.end for spans in tl.spans.values() for s in spans]
        tl.report = max([tl.raised, *times])
    return tl


def auto_window(tl: Timeline) -> float:
    """Seconds before the report that show the story: from when the first rank reached an op that is
    still open, or the culprits entered the place they are in, with a margin; at least
    :data:`MIN_WINDOW_S`, at most :data:`MAX_WINDOW_S`."""
    starts = [rec.start for recs in tl.records.values() for rec in recs if rec.end is None]
    starts += [e.created for entries in tl.backend.values() for e in entries if e.open]
    for r in tl.culprits:
        if tl.spans.get(r):
            starts.append(tl.spans[r][-1].start)
    starts = [t for t in starts if 0 < t <= tl.report]
    if not starts:
        return MIN_WINDOW_S
    span = tl.report - min(starts)
    return min(MAX_WINDOW_S, max(MIN_WINDOW_S, span * 1.25 + 1.0))


def chrome_trace(tl: Timeline) -> dict[str, Any]:
    """The timeline as Chrome trace event format (open it in ui.perfetto.dev or chrome://tracing).

    One process per rank (``pid`` = rank, named ``rank <r> (host:pid)``, sorted by rank) with three
    threads: ``collectives`` (``tid`` 0: each of ncclguard's records a complete event, ``ph: "X"``,
    in start order; one still open at the report drawn up to it with ``args.open = true``),
    ``main thread`` (``tid`` 1: its spans, named by phase or function) and ``backend`` (``tid`` 2:
    torch's flight-recorder entries, an instant event each, a complete one up to the report for an
    op still open). The incident is a global instant event, each culprit an instant event on its
    main thread. Times are microseconds from the earliest record (``otherData.t0``: that time,
    ``time.time()`` seconds).

    Args:
        tl: the timeline.

    Returns:
        The trace as JSON data (``{"traceEvents": [...], ...}``).
    """
    starts = [rec.start for recs in tl.records.values() for rec in recs]
    starts += [s.start for spans in tl.spans.values() for s in spans]
    starts += [e.created for entries in tl.backend.values() for e in entries]
    t0 = min([*starts, tl.raised]) if starts or tl.raised else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for r, recs in tl.records.items():
        spans, entries = tl.spans.get(r, []), tl.backend.get(r, [])
        empty = "" if recs or spans or entries else " (no records)"
        name = f"rank {r}" + (f" ({tl.hosts[r]})" if r in tl.hosts else "") + empty
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for tid, what in ((TID_COLLECTIVES, "collectives"), (TID_MAIN, "main thread"), (TID_BACKEND, "backend")):
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": what}})
        for rec in recs:
            end = rec.end if rec.end is not None else max(tl.report, rec.start)
            events.append(
                {
                    "ph": "X",
                    "name": rec.op,
                    "cat": "p2p" if rec.peer is not None else "collective",
                    "pid": r,
                    "tid": TID_COLLECTIVES,
                    "ts": us(rec.start),
                    "dur": round(max(0.0, end - rec.start) * 1e6, 3),
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
            )
        for span in spans:
            events.append(
                {
                    "ph": "X",
                    "name": span.label,
                    "cat": "phase" if span.phase else "function",
                    "pid": r,
                    "tid": TID_MAIN,
                    "ts": us(span.start),
                    "dur": round(max(0.0, span.end - span.start) * 1e6, 3),
                    "args": {"phase": span.phase, "func": span.func, "site": span.site},
                }
            )
        for e in entries:
            args = {"group": e.group, "seq": e.seq, "numel": e.numel, "p2p": e.p2p, "open": e.open}
            event = {"name": e.name, "cat": "backend", "pid": r, "tid": TID_BACKEND, "ts": us(e.created), "args": args}
            if e.open:
                event.update(ph="X", dur=round(max(0.0, tl.report - e.created) * 1e6, 3))
            else:
                event.update(ph="i", s="t")
            events.append(event)
        if r in tl.culprits:
            text = f"culprit ({tl.culprits[r]})" + (f": {tl.culprit_where[r]}" if r in tl.culprit_where else "")
            events.append({"ph": "i", "s": "p", "name": text, "pid": r, "tid": TID_MAIN, "ts": us(tl.raised)})
    events.append({"ph": "i", "s": "g", "name": f"incident {tl.title}", "pid": 0, "tid": 0, "ts": us(tl.raised)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0": t0, "incident": tl.title}}


# Span colours: pale, one per label, the same on every rank (a stable hash of the label).
_PALETTE = ("#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#d9d9d9", "#f2e394", "#bfe6e1")
_COLORS = {"done": "tab:blue", "open": "tab:red", "failed": "tab:orange", "backend": "0.35"}


def _span_color(label: str) -> str:
    return _PALETTE[zlib.crc32(label.encode()) % len(_PALETTE)]


def plot_timeline(tl: Timeline, path: Path, seconds: float | None = None) -> None:
    """Draws the last ``seconds`` before the report, three rows per rank (see the module doc), into
    ``path`` (PNG, or any format matplotlib infers from the name), written atomically.

    Args:
        tl: the timeline.
        path: where to write.
        seconds: the window, ending at the report's time (default: :func:`auto_window`).

    Raises:
        ImportError: matplotlib is not installed; install ``ncclguard[plot]``.
        OSError: the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("the timeline needs matplotlib: pip install 'ncclguard[plot]'") from exc
    window = auto_window(tl) if seconds is None else seconds
    ranks = sorted(tl.records)
    lo = tl.report - window
    # The rows each rank gets: those some rank has something in (a DDP-only loop records no Python
    # collective; a rank dump from an older ncclguard has no track), in this order.
    rows = [
        name
        for name, present in (
            ("main thread", any(tl.spans.values())),
            ("collectives", any(tl.records.values())),
            ("backend", any(tl.backend.values())),
        )
        if present
    ] or ["collectives"]
    height = 0.84 / len(rows)
    few = len(ranks) <= 16  # labels inside spans, and each row named, only when they fit
    fig = Figure(figsize=(12, min(14.0, 1.9 + (0.3 + 0.25 * len(rows)) * max(1, len(ranks)))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    def x(t: float) -> float:
        return t - tl.report

    def row(lane: int, name: str) -> tuple[float, float]:
        """(bottom, height) of a row of a lane (the y axis points down)."""
        return lane - 0.42 + rows.index(name) * height + height * 0.1, height * 0.8

    ticks: list[float] = []
    labels: list[str] = []
    for lane, r in enumerate(ranks):
        for name in rows:
            y0, h = row(lane, name)
            ticks.append(y0 + h / 2)
            first = name == rows[0]
            mark = " *" if r in tl.culprits else ""
            labels.append(
                (f"rank {r}{mark}  " if first else "") + name if few else (f"rank {r}{mark}" if first else "")
            )
        if "main thread" in rows:
            y0, h = row(lane, "main thread")
            spans = tl.spans.get(r, [])
            for i, span in enumerate(spans):
                # Spans are sampled at the watchdog's ticks: the thread moved on somewhere between
                # a span's last tick and the next one's first; drawn up to the next span, no gap.
                end = spans[i + 1].start if i + 1 < len(spans) else span.end
                if end < lo:
                    continue
                start = max(span.start, lo)
                width = max(end - start, window / 1500)
                last_of_culprit = r in tl.culprits and i == len(spans) - 1  # where the culprit is
                edge, lw = ("tab:red", 2.0) if last_of_culprit else ("0.6", 1.0)
                ax.broken_barh(
                    [(x(start), width)], (y0, h), facecolors=_span_color(span.label), edgecolor=edge, linewidth=lw
                )
                if few and width > window * 0.06:
                    ax.text(x(start) + width / 2, y0 + h / 2, span.label[:40], ha="center", va="center", fontsize=7)
        if "collectives" in rows:
            y0, h = row(lane, "collectives")
            bars: dict[str, list[tuple[float, float]]] = {"done": [], "open": [], "failed": []}
            for rec in tl.records[r]:
                end = rec.end if rec.end is not None else tl.report
                if end < lo:
                    continue
                kind = "open" if rec.end is None else "failed" if rec.error else "done"
                start = max(rec.start, lo)
                bars[kind].append((x(start), max(end - start, window / 1500)))
            for kind, parts in bars.items():
                if parts:
                    ax.broken_barh(parts, (y0, h), facecolors=_COLORS[kind])
        if "backend" in rows:
            y0, h = row(lane, "backend")
            done = [x(e.created) for e in tl.backend.get(r, []) if not e.open and e.created >= lo]
            if done:
                ax.vlines(done, y0, y0 + h, colors=_COLORS["backend"], linewidth=0.8)
            for e in tl.backend.get(r, []):
                if not e.open:
                    continue
                start = max(e.created, lo)
                ax.broken_barh([(x(start), tl.report - start)], (y0, h), facecolors=_COLORS["open"])
                if few and tl.report - start > window * 0.12:
                    text = f"{e.name} #{e.seq} waiting"
                    ax.text(x(start) + window * 0.01, y0 + h / 2, text, va="center", fontsize=7, color="white")
        if r in tl.culprits and few:
            text = f"culprit ({tl.culprits[r]})" + (f": {tl.culprit_where[r]}" if r in tl.culprit_where else "")
            y0, _ = row(lane, rows[0])
            ax.text(
                x(lo) + window * 0.005, y0 - 0.01, text, color="tab:red", fontsize=8, va="bottom", fontweight="bold"
            )
    ax.axvline(x(tl.raised), color="black", linestyle="--", linewidth=1)

    def has(name: str) -> int:
        return int(name in rows)

    step = max(1, len(ranks) // 40)
    keep = [i for i in range(len(ticks)) if (i // len(rows)) % step == 0]
    ax.set_yticks([ticks[i] for i in keep])
    ax.set_yticklabels([labels[i] for i in keep], fontsize=7 if few else 8)
    for label, i in zip(ax.get_yticklabels(), keep, strict=True):
        if ranks[i // len(rows)] in tl.culprits:
            label.set_color("tab:red")
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_xlim(-window, 0)
    ax.set_xlabel("seconds before the report (dashed: incident raised; red: culprit)")
    title = tl.title if len(tl.title) <= 260 else tl.title[:259] + "…"
    ax.set_title(title if len(title) <= 130 else title[:130] + "\n" + title[130:], fontsize=8)
    ax.legend(
        handles=[
            *(
                [Patch(facecolor=_PALETTE[0], edgecolor="0.6", label="main thread: phase or function")]
                * has("main thread")
            ),
            *(
                [Patch(facecolor="white", edgecolor="tab:red", linewidth=2, label="where the culprit is")]
                * has("main thread")
            ),
            *([Patch(color=_COLORS["done"], label="collective (ncclguard)")] * has("collectives")),
            Patch(color=_COLORS["open"], label="in flight at the report"),
            *([Patch(color=_COLORS["failed"], label="failed")] * has("collectives")),
            *(
                [Line2D([], [], color=_COLORS["backend"], label="backend op (torch's flight recorder)")]
                * has("backend")
            ),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    fig.savefig(tmp)
    os.replace(tmp, path)


def draw_later(incident: Incident, where: Path) -> threading.Thread | None:
    """Writes ``where/timeline.png`` from a thread of its own, when matplotlib is installed; a
    failure is logged, never raised (the report is on disk already).

    Args:
        incident: the merged incident.
        where: its directory.

    Returns:
        The thread, or None without matplotlib.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return None

    def run() -> None:
        try:
            plot_timeline(timeline(incident, where), where / PICTURE_FILE)
        except Exception as exc:  # noqa: BLE001 - a picture must never break the report
            log.warning("incident %s: no timeline picture: %s", incident.incident.id, exc)

    thread = threading.Thread(target=run, name="ncclguard-watchdog-plot", daemon=True)
    thread.start()
    return thread
