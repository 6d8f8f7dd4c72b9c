"""Pictures of an incident: a Chrome/Perfetto trace and a timeline PNG of its records.

:func:`timeline` merges the flight records of every rank found for an incident: the rank dumps
(``rank<r>.json``, every record the rank kept) and the merged incident's statements (the newest
20 records and the ops in flight of each rank that spoke). :func:`chrome_trace` turns them into
trace events (one track per rank, a complete ``X`` span per collective, ops still open drawn to
the report's time, the incident marked); :func:`plot_timeline` draws the last seconds, one lane per
rank (matplotlib, the ``plot`` extra); :func:`draw_later` writes ``timeline.png`` into an
incident directory from a thread of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclguard._log import log
from ncclguard.incidents.model import HeartbeatView, Incident, OpRecord, StatementView, upgrade_rank_dump

__all__ = ["PICTURE_FILE", "Timeline", "chrome_trace", "draw_later", "plot_timeline", "timeline"]

PICTURE_FILE = "timeline.png"
_WINDOW_S = 10.0


@dataclass
class Timeline:
    """The records of an incident, merged per rank.

    Attributes:
        records: per rank, its records ordered by start time.
        hosts: per rank, ``host:pid`` where known.
        raised: when the incident was raised (``time.time()``).
        report: when the report was written (open ops are drawn up to it).
        title: the incident's id, kind and summary.
        culprits: the culprit ranks and why.
    """

    records: dict[int, list[OpRecord]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    raised: float = 0.0
    report: float = 0.0
    title: str = ""
    culprits: dict[int, str] = field(default_factory=dict)


def _add(into: dict[tuple[str, int, str], OpRecord], recs: list[OpRecord]) -> None:
    for rec in recs:
        key = (rec.group, rec.seq, rec.op)
        old = into.get(key)
        if old is None or (old.end is None and rec.end is not None):
            into[key] = rec


def timeline(incident: Incident, where: Path | None = None) -> Timeline:
    """The merged records of ``incident`` and of the rank dumps in ``where`` (when given).

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
    for r, view in incident.ranks.items():
        if isinstance(view, StatementView | HeartbeatView):
            recs = [*view.recent, *view.inflight] if isinstance(view, StatementView) else list(view.inflight)
            _add(merged.setdefault(int(r), {}), recs)
            tl.hosts.setdefault(int(r), f"{view.host}:{view.pid}")
    for rank in range(incident.world_size):
        merged.setdefault(rank, {})
    tl.records = {r: sorted(recs.values(), key=lambda x: (x.start, x.seq)) for r, recs in sorted(merged.items())}
    starts = [rec.start for recs in tl.records.values() for rec in recs]
    if tl.report <= 0:
        ends = [rec.end for recs in tl.records.values() for rec in recs if rec.end is not None]
        tl.report = max([tl.raised, *starts, *ends])
    return tl


def chrome_trace(tl: Timeline) -> dict[str, Any]:
    """The timeline as Chrome trace event format (open it in ui.perfetto.dev or chrome://tracing).

    One process per rank (``pid`` = rank, named ``rank <r> (host:pid)``, sorted by rank), one
    track in it (``tid`` 0); each collective a complete event (``ph: "X"``) in start order, an op
    still open at the report drawn up to the report's time with ``args.open = true``; the incident
    a global instant event, and each culprit an instant event on its track. Times are microseconds
    from the earliest record (``otherData.t0``: that time, ``time.time()`` seconds).

    Args:
        tl: the timeline.

    Returns:
        The trace as JSON data (``{"traceEvents": [...], ...}``).
    """
    starts = [rec.start for recs in tl.records.values() for rec in recs]
    t0 = min([*starts, tl.raised]) if starts or tl.raised else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for r, recs in tl.records.items():
        name = f"rank {r}" + (f" ({tl.hosts[r]})" if r in tl.hosts else "") + ("" if recs else " (no records)")
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "collectives"}})
        for rec in recs:
            end = rec.end if rec.end is not None else max(tl.report, rec.start)
            events.append(
                {
                    "ph": "X",
                    "name": rec.op,
                    "cat": "p2p" if rec.peer is not None else "collective",
                    "pid": r,
                    "tid": 0,
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
        if r in tl.culprits:
            events.append(
                {"ph": "i", "s": "p", "name": f"culprit ({tl.culprits[r]})", "pid": r, "tid": 0, "ts": us(tl.raised)}
            )
    events.append({"ph": "i", "s": "g", "name": f"incident {tl.title}", "pid": 0, "tid": 0, "ts": us(tl.raised)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0": t0, "incident": tl.title}}


def plot_timeline(tl: Timeline, path: Path, seconds: float = _WINDOW_S) -> None:
    """Draws the last ``seconds`` before the report, one lane per rank, into ``path`` (PNG, or any
    format matplotlib infers from the name), written atomically.

    Args:
        tl: the timeline.
        path: where to write.
        seconds: the window, ending at the report's time.

    Raises:
        ImportError: matplotlib is not installed; install ``ncclguard[plot]``.
        OSError: the file cannot be written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("the timeline needs matplotlib: pip install 'ncclguard[plot]'") from exc
    ranks = sorted(tl.records)
    lo = tl.report - seconds
    fig = Figure(figsize=(10, min(12.0, 1.6 + 0.3 * max(1, len(ranks)))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = {"done": "tab:blue", "open": "tab:red", "failed": "tab:orange"}
    for lane, r in enumerate(ranks):
        bars: dict[str, list[tuple[float, float]]] = {k: [] for k in colors}
        for rec in tl.records[r]:
            end = rec.end if rec.end is not None else tl.report
            if end < lo:
                continue
            kind = "open" if rec.end is None else "failed" if rec.error else "done"
            start = max(rec.start, lo)
            bars[kind].append((start - tl.report, max(end - start, seconds / 2000)))
        for kind, spans in bars.items():
            if spans:
                ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=colors[kind])
    ax.axvline(tl.raised - tl.report, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(ranks)))
    step = max(1, len(ranks) // 40)
    ax.set_yticklabels(
        [f"rank {r}" + (" *" if r in tl.culprits else "") if i % step == 0 else "" for i, r in enumerate(ranks)]
    )
    for label, r in zip(ax.get_yticklabels(), ranks, strict=True):
        if r in tl.culprits:
            label.set_color("tab:red")
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(-seconds, 0)
    ax.set_xlabel("seconds before the report (dashed: incident raised; * culprit)")
    ax.set_title(tl.title if len(tl.title) <= 140 else tl.title[:139] + "…", fontsize=8)
    ax.legend(
        handles=[
            Patch(color=c, label={"done": "completed", "open": "in flight", "failed": "failed"}[k])
            for k, c in colors.items()
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
