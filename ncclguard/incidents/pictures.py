"""Pictures of an incident: a Chrome/Perfetto trace and a timeline PNG that tell its story.

:func:`timeline` merges, per rank, what the incident's files hold: the rank dumps
(``rank<r>.json``: every flight record the rank kept, where its main thread was as spans of one
phase or function, and torch's own flight-recorder entries, which include the collectives issued
from C++ by DDP, FSDP or DeepSpeed's engine) and the merged incident's statements (the newest 20
records and the ops in flight of each rank that spoke). :func:`~ncclguard.incidents.trace.chrome_trace` and
:func:`plot_timeline` draw the same three rows per rank:

- **main thread**: its phases, or outside any phase its functions, as spans (``evaluate()`` on the
  rank that is late, ``main()`` blocked in ``backward()`` on the ranks that wait);
- **collectives**: ncclguard's records of the Python calls (completed, in flight up to the report,
  failed);
- **backend**: torch's flight-recorder entries (a tick each; one still open drawn as a bar from
  when the rank reached it to the report);

with the incident raised (a dashed line) and the culprits named (in red, with why and where); for the
recovery engine's numerical finding, each rank it names is marked where the commit named it, with
what it held (``NaN in bucket 1 (fc2.bias, ...)``, ``replica drifted (parameters)``).
:func:`draw_later` writes ``timeline.png`` into an incident directory from a thread of its own,
which the interpreter's exit waits for (:func:`finish_drawings`).
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
from ncclguard.exits import ExitWait
from ncclguard.incidents.model import (
    BackendEntry,
    HeartbeatView,
    Incident,
    OpRecord,
    StatementView,
    TrackSpan,
    upgrade_rank_dump,
)
from ncclguard.incidents.numerics_text import marks as numerics_marks

__all__ = [
    "DRAW_EXIT_WAIT_S",
    "PICTURE_FILE",
    "Timeline",
    "auto_window",
    "culprit_text",
    "draw_later",
    "finish_drawings",
    "plot_timeline",
    "timeline",
]

PICTURE_FILE = "timeline.png"
MIN_WINDOW_S = 10.0  # the least a picture shows before the report
MAX_WINDOW_S = 300.0  # the most it shows when the story started earlier
# Trace threads (tid) of each rank's process: one track each for its collectives, its main thread, its backend's ops.
TID_COLLECTIVES, TID_MAIN, TID_BACKEND = 0, 1, 2
# How long after its start a drawing under way is waited for at exit (one takes a few seconds on a
# loaded machine, matplotlib's import included).
DRAW_EXIT_WAIT_S = 30.0


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
        marks: the ranks a numerical finding names, and what each held (docs/numerics.md).
        marked_at: when the commit named it (``time.time()``).
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
    marks: dict[int, str] = field(default_factory=dict)
    marked_at: float = 0.0


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
    found = incident.incident.numerics
    if found is not None:
        tl.marks, tl.marked_at = numerics_marks(found), found.at or tl.raised
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
    if tl.marks:
        starts.append(tl.marked_at)
    starts = [t for t in starts if 0 < t <= tl.report]
    if not starts:
        return MIN_WINDOW_S
    span = tl.report - min(starts)
    return min(MAX_WINDOW_S, max(MIN_WINDOW_S, span * 1.25 + 1.0))


def culprit_text(tl: Timeline, r: int) -> str:
    """``culprit (why): where`` of culprit rank ``r``, the same on the trace and on the picture."""
    return f"culprit ({tl.culprits[r]})" + (f": {tl.culprit_where[r]}" if r in tl.culprit_where else "")


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
    except ImportError as exc:
        raise ImportError("the timeline needs matplotlib: pip install 'ncclguard[plot]'") from exc
    ranks = sorted(tl.records)
    rows = _rows(tl)
    fig = Figure(figsize=(12, min(14.0, 1.9 + (0.3 + 0.25 * len(rows)) * max(1, len(ranks)))), dpi=100)
    FigureCanvasAgg(fig)
    # Labels inside spans, and each row named, only when they fit.
    c = _Canvas(fig.add_subplot(), tl, rows, auto_window(tl) if seconds is None else seconds, few=len(ranks) <= 16)
    for lane, r in enumerate(ranks):
        if "main thread" in rows:
            _draw_spans(c, lane, r)
        if "collectives" in rows:
            _draw_records(c, lane, r)
        if "backend" in rows:
            _draw_backend(c, lane, r)
        if r in tl.culprits and c.few:
            _draw_culprit(c, lane, r)
        if r in tl.marks:
            _draw_mark(c, lane, r)
    c.ax.axvline(c.x(tl.raised), color="black", linestyle="--", linewidth=1)
    _draw_axes(c, ranks)
    _draw_legend(c)
    fig.tight_layout()
    _save_atomically(fig, path)


def _rows(tl: Timeline) -> list[str]:
    """The rows each rank gets, in this order: those some rank has something in (a DDP-only loop
    records no Python collective; a rank dump from an older ncclguard has no track)."""
    return [
        name
        for name, present in (
            ("main thread", any(tl.spans.values())),
            ("collectives", any(tl.records.values())),
            ("backend", any(tl.backend.values())),
        )
        if present
    ] or ["collectives"]


@dataclass
class _Canvas:
    """What each part of the picture draws with: the axes, the timeline, its rows and the window."""

    ax: Any  # matplotlib's Axes (matplotlib is optional: not imported at module level)
    tl: Timeline
    rows: list[str]
    window: float  # seconds shown, ending at the report
    few: bool  # ranks few enough for labels inside spans and every row named

    @property
    def lo(self) -> float:
        """The earliest time shown."""
        return self.tl.report - self.window

    def x(self, t: float) -> float:
        """``t`` on the x axis: seconds before the report."""
        return t - self.tl.report

    def row(self, lane: int, name: str) -> tuple[float, float]:
        """(bottom, height) of a row of a lane (the y axis points down)."""
        height = 0.84 / len(self.rows)
        return lane - 0.42 + self.rows.index(name) * height + height * 0.1, height * 0.8


def _draw_spans(c: _Canvas, lane: int, r: int) -> None:
    """Rank ``r``'s main thread: its spans, the culprit's last one edged in red."""
    y0, h = c.row(lane, "main thread")
    spans = c.tl.spans.get(r, [])
    for i, span in enumerate(spans):
        # Spans are sampled at the watchdog's ticks: the thread moved on somewhere between
        # a span's last tick and the next one's first; drawn up to the next span, no gap.
        end = spans[i + 1].start if i + 1 < len(spans) else span.end
        if end < c.lo:
            continue
        start = max(span.start, c.lo)
        width = max(end - start, c.window / 1500)
        last_of_culprit = r in c.tl.culprits and i == len(spans) - 1  # where the culprit is
        edge, lw = ("tab:red", 2.0) if last_of_culprit else ("0.6", 1.0)
        c.ax.broken_barh(
            [(c.x(start), width)], (y0, h), facecolors=_span_color(span.label), edgecolor=edge, linewidth=lw
        )
        if c.few and width > c.window * 0.06:
            c.ax.text(c.x(start) + width / 2, y0 + h / 2, span.label[:40], ha="center", va="center", fontsize=7)


def _draw_records(c: _Canvas, lane: int, r: int) -> None:
    """Rank ``r``'s collectives: ncclguard's records, coloured done, open (up to the report) or failed."""
    y0, h = c.row(lane, "collectives")
    bars: dict[str, list[tuple[float, float]]] = {"done": [], "open": [], "failed": []}
    for rec in c.tl.records[r]:
        end = rec.end if rec.end is not None else c.tl.report
        if end < c.lo:
            continue
        kind = "open" if rec.end is None else "failed" if rec.error else "done"
        start = max(rec.start, c.lo)
        bars[kind].append((c.x(start), max(end - start, c.window / 1500)))
    for kind, parts in bars.items():
        if parts:
            c.ax.broken_barh(parts, (y0, h), facecolors=_COLORS[kind])


def _draw_backend(c: _Canvas, lane: int, r: int) -> None:
    """Rank ``r``'s backend: a tick per completed entry, a bar up to the report per open one."""
    y0, h = c.row(lane, "backend")
    done = [c.x(e.created) for e in c.tl.backend.get(r, []) if not e.open and e.created >= c.lo]
    if done:
        c.ax.vlines(done, y0, y0 + h, colors=_COLORS["backend"], linewidth=0.8)
    for e in c.tl.backend.get(r, []):
        if not e.open:
            continue
        start = max(e.created, c.lo)
        c.ax.broken_barh([(c.x(start), c.tl.report - start)], (y0, h), facecolors=_COLORS["open"])
        if c.few and c.tl.report - start > c.window * 0.12:
            text = f"{e.name} #{e.seq} waiting"
            c.ax.text(c.x(start) + c.window * 0.01, y0 + h / 2, text, va="center", fontsize=7, color="white")


def _draw_culprit(c: _Canvas, lane: int, r: int) -> None:
    """Culprit rank ``r`` named, with why and where, in red above its lane."""
    y0, _ = c.row(lane, c.rows[0])
    c.ax.text(
        c.x(c.lo) + c.window * 0.005,
        y0 - 0.01,
        culprit_text(c.tl, r),
        color="tab:red",
        fontsize=8,
        va="bottom",
        fontweight="bold",
    )


def _draw_mark(c: _Canvas, lane: int, r: int) -> None:
    """Rank ``r`` named by a numerical finding: a purple line across its lane where the commit named
    it, and what it held (when the ranks are few)."""
    y0, _ = c.row(lane, c.rows[0])
    y1, h1 = c.row(lane, c.rows[-1])
    at = c.x(min(max(c.tl.marked_at, c.lo), c.tl.report))  # at the window's edge when outside it
    c.ax.vlines([at], y0, y1 + h1, colors="tab:purple", linewidth=2.0)
    if c.few:
        side = "right" if at > -c.window / 2 else "left"  # the text stays inside the axes
        c.ax.text(at, y0 - 0.01, c.tl.marks[r][:80], color="tab:purple", fontsize=8, va="bottom", ha=side)


def _row_labels(c: _Canvas, ranks: list[int]) -> tuple[list[float], list[str]]:
    """Each row's place on the y axis and its label (the rank on its first row; each row named when
    the ranks are few)."""
    ticks: list[float] = []
    labels: list[str] = []
    for lane, r in enumerate(ranks):
        mark = " *" if r in c.tl.culprits else ""
        for name in c.rows:
            y0, h = c.row(lane, name)
            ticks.append(y0 + h / 2)
            first = name == c.rows[0]
            labels.append(
                (f"rank {r}{mark}  " if first else "") + name if c.few else (f"rank {r}{mark}" if first else "")
            )
    return ticks, labels


def _draw_axes(c: _Canvas, ranks: list[int]) -> None:
    """The y axis (rows labelled, at most about 40 ranks of them; the culprits' in red), the limits,
    the x label and the title."""
    ticks, labels = _row_labels(c, ranks)
    step = max(1, len(ranks) // 40)
    keep = [i for i in range(len(ticks)) if (i // len(c.rows)) % step == 0]
    c.ax.set_yticks([ticks[i] for i in keep])
    c.ax.set_yticklabels([labels[i] for i in keep], fontsize=7 if c.few else 8)
    for label, i in zip(c.ax.get_yticklabels(), keep, strict=True):
        if ranks[i // len(c.rows)] in c.tl.culprits:
            label.set_color("tab:red")
    c.ax.set_ylim(len(ranks) - 0.5, -0.6)
    c.ax.set_xlim(-c.window, 0)
    c.ax.set_xlabel("seconds before the report (dashed: incident raised; red: culprit)")
    title = c.tl.title if len(c.tl.title) <= 260 else c.tl.title[:259] + "…"
    c.ax.set_title(title if len(title) <= 130 else title[:130] + "\n" + title[130:], fontsize=8)


def _draw_legend(c: _Canvas) -> None:
    """The legend, right of the axes: an entry for each row drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def has(name: str) -> int:
        return int(name in c.rows)

    c.ax.legend(
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
            *([Line2D([], [], color="tab:purple", linewidth=2, label="numerical finding")] * int(bool(c.tl.marks))),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )


def _save_atomically(fig: Any, path: Path) -> None:
    """Writes ``fig`` to ``path`` through a temporary file beside it, so that a reader never sees half
    a picture."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    fig.savefig(tmp)
    os.replace(tmp, path)


_drawings = ExitWait("timeline picture(s)", DRAW_EXIT_WAIT_S, "matplotlib may be stuck")


def finish_drawings(wait_s: float | None = None) -> int:
    """Waits for the drawings under way, each at most until ``wait_s`` after its start (default
    :data:`DRAW_EXIT_WAIT_S`): run at exit (registered with atexit at the first drawing; the
    watchdog's exit hook calls it again once the watchdog has stopped).

    A drawing thread still inside matplotlib when the interpreter finalizes dies through its C++
    frames, and with it the process (status 134; :mod:`ncclguard.exits`): seen as a reported
    incident's picture was drawn while the process ended.

    Args:
        wait_s: how long after its start a drawing is waited for.

    Returns:
        How many drawings are still under way (0: finalization is safe for them).
    """
    return _drawings.drain(wait_s)


def draw_later(incident: Incident, where: Path) -> threading.Thread | None:
    """Writes ``where/timeline.png`` from a thread of its own, when matplotlib is installed; a
    failure is logged, never raised (the report is on disk already). The interpreter's exit waits
    for it (:func:`finish_drawings`).

    Args:
        incident: the merged incident.
        where: its directory.

    Returns:
        The thread, or None without matplotlib.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return None

    done = threading.Event()

    def run() -> None:
        try:
            plot_timeline(timeline(incident, where), where / PICTURE_FILE)
        except Exception as exc:  # noqa: BLE001 - a picture must never break the report
            log.warning("incident %s: no timeline picture: %s", incident.incident.id, exc)
        finally:
            _drawings.leave(done)
            done.set()

    thread = threading.Thread(target=run, name="ncclguard-watchdog-plot", daemon=True)
    _drawings.enter(done)
    thread.start()
    return thread
