"""The one-line summary of an incident (``incident.json``'s ``summary``, the log line, the top of
``summary.txt``), and the phrases it shares with the full report (:mod:`ncclguard.incidents.render`).

Pure functions of the typed model (:mod:`ncclguard.incidents.model`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ncclguard._naming import rank_ranges
from ncclguard.incidents.model import (
    Culprit,
    DesyncFinding,
    Finding,
    LostRanksFinding,
    MismatchFinding,
    P2PFinding,
    StoreFinding,
    Straggler,
    StuckFinding,
    Whereabouts,
)

__all__ = [
    "NOTHING_FOUND",
    "OpLike",
    "func_text",
    "grouped",
    "last_text",
    "now_text",
    "op_text",
    "phase_text",
    "ranks_text",
    "short_site",
    "summary_line",
    "waiting_head",
]

NOTHING_FOUND = "no rank is stuck in a collective and every peer is alive"


class OpLike(Protocol):
    op: str
    seq: int
    group: str


def ranks_text(ranks: Iterable[int]) -> str:
    """``[2]`` -> ``"rank 2"``; ``[0, 1, 3]`` -> ``"ranks 0-1,3"``."""
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_ranges(ordered)}"


def short_site(site: str | None) -> str:
    """``/long/path/eval.py:88`` -> ``eval.py:88`` for the one-line summary."""
    return os.path.basename(site) if site else "?"


def phase_text(phase: str | None) -> str:
    return f"phase {phase}" if phase else "no phase set"


def op_text(rec: OpLike, with_group: bool = True) -> str:
    group = f" on group {rec.group}" if with_group and rec.group not in (None, "0") else ""
    number = "backend #" if getattr(rec, "backend", False) else "#"  # torch's numbering, not ncclguard's
    return f"{rec.op} {number}{rec.seq}{group}"


def func_text(func: str) -> str:
    """``"evaluate()"`` for a function, ``""`` for none or module-level code (``<module>``)."""
    return f"{func}()" if func and not func.startswith("<") else ""


def now_text(where: Whereabouts, lead: str = "now in") -> str:
    rec = where.inflight
    if rec is not None:
        return f"{lead} {op_text(rec)} ({phase_text(rec.phase)}) at {short_site(rec.site)}"
    func = func_text(where.func)
    if func and not where.phase:  # a script without phases: its function says where it is
        return f"{lead} {func} at {short_site(where.site)} (no phase set)"
    return f"{lead} {phase_text(where.phase)} at {short_site(where.site)}"


def last_text(entry: Straggler | Culprit) -> str:
    if not entry.last_seq:
        return "issued nothing on this group yet"
    if entry.last_completed == entry.last_seq:
        return f"last completed #{entry.last_completed}"
    return f"last completed #{entry.last_completed}, last issued #{entry.last_seq}"


def grouped(entries: Sequence[Straggler], describe: Callable[[Straggler], str]) -> list[str]:
    """One phrase per distinct description, naming all the ranks it fits ("ranks 1-2 ...")."""
    by_text: dict[str, list[int]] = {}
    for e in entries:
        by_text.setdefault(describe(e), []).append(e.rank)
    return [f"{ranks_text(ranks)} {text}" for text, ranks in by_text.items()]


def waiting_head(f: DesyncFinding | StuckFinding) -> str:
    return (
        f"{ranks_text(f.waiting)} waiting in {op_text(f)} ({f.numel} x {f.dtype or 'no data'}, "
        f"{phase_text(f.phase)}) for {f.waiting_s:.1f} s"
    )


def summary_line(findings: Sequence[Finding]) -> str:
    """The findings in one line (``incident.json``'s ``summary``, the log line, the report's top)."""
    parts = []
    for f in findings:
        if isinstance(f, StuckFinding):
            parts.append(waiting_head(f) + "; every member is there: a stuck transport, not a desync")
        elif isinstance(f, MismatchFinding):
            shapes = "; ".join(
                f"{ranks_text(v.ranks)} in {v.op} ({v.numel} x {v.dtype}) at {short_site(v.site)}" for v in f.variants
            )
            parts.append(f"ranks disagree at {f.op} #{f.seq}: {shapes}")
        elif isinstance(f, DesyncFinding):
            tails = grouped(f.behind, lambda b: f"{last_text(b)}, {now_text(b)}")
            tails += [
                f"rank {b.rank} lost (no heartbeat for {b.stale_s or 0.0:.1f} s), {last_text(b)}"
                for b in f.stale_members
            ]
            parts.append("; ".join([waiting_head(f), *tails]))
        elif isinstance(f, P2PFinding):
            head = (
                f"rank {f.rank} waiting in {f.op} {'to' if 'send' in f.op else 'from'} rank {f.peer} "
                f"({f.numel} x {f.dtype}, {phase_text(f.phase)}) for {f.waiting_s:.1f} s"
            )
            back = f.peer_waits_back
            if back is not None:
                parts.append(f"{head}; rank {f.peer} waits back in {back.op}: a point-to-point deadlock")
            elif f.peer_matched is not None:
                parts.append(
                    f"{head}; rank {f.peer} has its {f.peer_matched.op} posted: the transfer is under way "
                    "(a large message or a slow link), not a deadlock"
                )
            else:
                parts.append(f"{head}; rank {f.peer} {now_text(f.peer_where)}")
        elif isinstance(f, LostRanksFinding):
            for e in f.ranks:
                parts.append(f"rank {e.rank} lost: no heartbeat for {e.stale_s:.1f} s, {now_text(e, 'last seen in')}")
        elif isinstance(f, StoreFinding):
            parts.append(f.text)
    return "; ".join(parts) if parts else NOTHING_FOUND
