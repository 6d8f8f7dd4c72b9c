"""Incidents as text for a tired human: the one-line summary and ``summary.txt``.

Pure functions of the typed model (:mod:`ncclguard.incidents.model`); the analysis that fills it is
:mod:`ncclguard.incidents.analysis`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ncclguard._naming import node_name
from ncclguard.incidents.model import (
    Culprit,
    CulpritReason,
    DesyncFinding,
    FindingKind,
    Incident,
    IncidentDoc,
    IncidentKind,
    MismatchFinding,
    OpRecord,
    P2PFinding,
    SilentFinding,
    StatementView,
    StuckFinding,
)
from ncclguard.incidents.numerics_text import advice, done_lines, seen_lines
from ncclguard.incidents.summary import (
    func_text,
    last_text,
    op_text,
    phase_text,
    ranks_text,
    summary_line,
)

__all__ = ["progress_text", "render", "summary_line", "ranks_text"]


def _when(ts: float | None) -> str:
    if not ts:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


def _culprit_key(c: Culprit) -> tuple[object, ...]:
    rec = c.inflight
    return (
        c.why,
        c.group,
        c.seq,
        c.last_seq,
        c.last_completed if c.why is not CulpritReason.STOPPED_BEATING else None,
        c.phase,
        c.site,
        rec.op if rec else None,
        rec.seq if rec else None,
        rec.group if rec else None,
    )


def _culprit_blocks(culprits: Sequence[Culprit]) -> list[list[Culprit]]:
    """Culprits that are in the same place, together (64 ranks in one eval loop read as one block)."""
    blocks: dict[tuple[object, ...], list[Culprit]] = {}
    for c in culprits:
        blocks.setdefault(_culprit_key(c), []).append(c)
    return list(blocks.values())


def _source(incident: Incident) -> str:
    merged_by = incident.merged_by
    if incident.incident.kind is IncidentKind.STORE_GONE:
        return f"written by rank {merged_by} alone (without the store the ranks cannot meet)"
    who = f"rank {merged_by}" if merged_by >= 0 else "`ncclguard report`"
    missing = incident.missing_statements
    return f"merged by {who} from the statements of {len(incident.statements_from)}/{incident.world_size} ranks" + (
        f" (no statement from {ranks_text(missing)})" if missing else ""
    )


def _culprit_lines(incident: Incident, block: list[Culprit], stack_lines: int) -> list[str]:
    c = block[0]
    hosts = sorted({f"{b.host}:{b.pid}" for b in block if b.host})
    who = f"  {ranks_text(b.rank for b in block)}" + (
        f" (host:pid {', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''})" if hosts else ""
    )
    out = []
    if c.why is CulpritReason.STOPPED_BEATING:
        stale = max(b.stale_s or 0.0 for b in block)
        out.append(f"{who}: LOST, no heartbeat for {stale:.1f} s (the process died, or froze holding the GIL)")
        out.append("      last seen:")
    elif c.why is CulpritReason.MISMATCH:
        out.append(f"{who}: called a different collective at #{c.seq} on group {c.group} than the others")
    elif c.why is CulpritReason.P2P:
        out.append(f"{who}: not in the matching send/recv; rank {c.waiter} waits for it in {c.waiter_op}")
    else:
        out.append(f"{who}: not in the collective the others wait in (#{c.seq} on group {c.group}); {last_text(c)}")
    rec = c.inflight
    if rec:
        progress = progress_text(rec)
        out.append(
            f"      in {op_text(rec)}: {rec.numel} x {rec.dtype or 'no data'}, {phase_text(rec.phase)}, "
            f"issued at {rec.site}" + (f"; {progress}" if progress else "")
        )
    func = func_text(c.func)
    out.append(f"      {phase_text(c.phase)}, main thread " + (f"in {func} at {c.site}" if func else f"at {c.site}"))
    view = incident.ranks.get(str(c.rank))
    stack = view.stack if isinstance(view, StatementView) else []
    if stack and stack_lines > 0:
        out.append(f"      main-thread stack of rank {c.rank} (innermost last):")
        out.extend(f"        {line}" for line in stack[-stack_lines:])
    return out


def _outside_lines(incident: Incident, stack_lines: int) -> list[str]:
    """The stacks of ranks that could not speak for themselves, from py-spy (the main thread's
    part), or how to get them."""
    if not incident.outside_stacks:
        return []
    out = ["", "STACKS FROM OUTSIDE (ranks that could not speak for themselves)"]
    for key in sorted(incident.outside_stacks, key=int):
        st = incident.outside_stacks[key]
        if st.text is None:
            out.append(f"  rank {st.rank} (pid {st.pid}): none ({st.error}); {st.how}")
            continue
        lines = st.text.splitlines()
        main = next((i for i, line in enumerate(lines) if line.startswith("Thread ") and "MainThread" in line), None)
        if main is None:
            shown = lines[: 2 * stack_lines]
        else:  # the main thread's block: up to the next thread, 2 * stack_lines frames at most
            end = next((i for i in range(main + 1, len(lines)) if lines[i].startswith("Thread ")), len(lines))
            shown = lines[main : min(end, main + 1 + 2 * max(stack_lines, 1))]
        out.append(f"  rank {st.rank} (pid {st.pid}, {st.tool}, innermost first):")
        out.extend(f"    {line.strip()}" for line in shown)
    return out


def _bytes_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def progress_text(rec: OpRecord) -> str | None:
    """``"chunk 5 of 12 done, 10.0 MiB reduced"`` for a chunked call that spoke of its progress
    (:meth:`ncclguard.recording.flight.FlightRecorder.progress`); None for any other op."""
    if rec.chunks <= 0:
        return None
    return f"chunk {rec.chunks_done} of {rec.chunks} done, {_bytes_text(rec.bytes_done)} reduced"


def _progress_lines(incident: Incident, f: DesyncFinding | StuckFinding) -> list[str]:
    """Where each waiting rank stood in a chunked op, from its statement (or heartbeat): ranks at
    the same chunk read as one line."""
    if f.backend:
        return []
    by_text: dict[str, list[int]] = {}
    for r in f.waiting:
        view = incident.ranks.get(str(r))
        for rec in getattr(view, "inflight", None) or []:
            text = progress_text(rec) if (rec.group, rec.seq, rec.peer) == (f.group, f.seq, None) else None
            if text is not None:
                by_text.setdefault(text, []).append(r)
    return [f"      {ranks_text(ranks)}: {text}" for text, ranks in by_text.items()]


def _other_numbering(f: DesyncFinding | StuckFinding) -> str:
    """The op in the other numbering, where torch's recorder and ncclguard's records were joined."""
    if f.backend_seq is not None:
        return f" (the backend's {f.backend_op} #{f.backend_seq})"
    return f" (ncclguard's #{f.record_seq})" if f.record_seq is not None else ""


def _victim_lines(incident: Incident) -> list[str]:
    out = []
    for f in incident.findings:
        if isinstance(f, (DesyncFinding, StuckFinding)):
            out.append(
                f"  {ranks_text(f.waiting)} in {op_text(f)}: {f.numel} x {f.dtype or 'no data'}, "
                f"{phase_text(f.phase)}, for {f.waiting_s:.1f} s, issued {'from' if f.backend and f.record_seq is None else 'at'} {f.site}"
                + _other_numbering(f)
            )
            out.extend(_progress_lines(incident, f))
        elif isinstance(f, MismatchFinding):
            for v in f.variants:
                out.append(
                    f"  {ranks_text(v.ranks)} in {v.op} #{f.seq}: {v.numel} x {v.dtype or 'no data'}, "
                    f"{phase_text(v.phase)}, issued at {v.site}"
                )
        elif isinstance(f, SilentFinding):
            out.append(f"  no statement from {ranks_text(f.ranks)}: {f.note}")
        elif isinstance(f, P2PFinding):
            out.append(
                f"  rank {f.rank} in {f.op} #{f.seq} with rank {f.peer}: {f.numel} x {f.dtype}, "
                f"{phase_text(f.phase)}, for {f.waiting_s:.1f} s, issued at {f.site}"
            )
    return out


def render(incident: Incident, *, stack_lines: int = 8) -> str:
    """The merged incident as plain text (also saved as ``summary.txt``).

    Args:
        incident: the merged incident.
        stack_lines: frames of each culprit's main-thread stack to show.

    Returns:
        The report, ending in a newline.
    """
    doc = incident.incident
    out = [
        f"ncclguard incident {doc.id}: {doc.reason}",
        f"raised by rank {doc.by} at {_when(doc.created)}; {_source(incident)}, at {_when(incident.written_at)}",
        *_generation_lines(doc),
        "",
        "IN ONE LINE",
        f"  {incident.summary}",
        "",
    ]
    if doc.numerics is not None:  # the recovery engine's numerical finding: no culprit, no victim
        out.extend([*seen_lines(doc.numerics), "", *done_lines(doc.numerics), "", "WHAT TO DO"])
        out.extend([*(f"  - {line}" for line in advice(doc.numerics)), "", *_dump_lines(incident)])
        return "\n".join(out) + "\n"
    culprits = incident.culprits
    out.append("CULPRITS (not where the others are)" if culprits else "CULPRITS: none found")
    for block in _culprit_blocks(culprits):
        out.extend(_culprit_lines(incident, block, stack_lines))
    out.extend(_outside_lines(incident, stack_lines))
    out.append("")
    victims = incident.victims
    out.append(f"VICTIMS (waiting for the culprits): {ranks_text(victims) if victims else 'none'}")
    out.extend(_victim_lines(incident))
    out.append("")
    out.append("WHAT TO DO")
    out.extend(f"  - {line}" for line in _advice(incident))
    out.append("")
    out.extend(_dump_lines(incident))
    return "\n".join(out) + "\n"


def _dump_lines(incident: Incident) -> list[str]:
    """Where each rank's dump is: next to this file, in the incident directory of the rank's host."""
    head = "Per-rank dumps (all threads' stacks, flight records, heartbeats): rank<r>.json"
    hosts: dict[str, list[int]] = {}
    for r, view in incident.ranks.items():
        host = getattr(view, "host", None)
        if host and view.source in ("statement", "head"):  # a rank that spoke wrote its dump on its own host
            hosts.setdefault(node_name(host, getattr(view, "address", None)), []).append(int(r))
    if len(hosts) < 2:
        return [f"{head} next to this file."]
    where = "; ".join(f"{ranks_text(rs)} on {h}" for h, rs in sorted(hosts.items(), key=lambda kv: min(kv[1])))
    return [f"{head} in this incident's directory on each rank's host (unless the directory is shared): {where}."]


def generation_text(doc: IncidentDoc) -> str | None:
    """``"world generation 1 (rebuilt: old rank 2 is rank 1 now, ...; left out: rank 1)"``; None
    in generation 0, whose numbers are the job's own."""
    if doc.generation == 0:
        return None
    moves = sorted((int(old), new) for old, new in (doc.rank_map or {}).items())
    renamed = ", ".join(f"old rank {old} is rank {new} now" for old, new in moves if old != new)
    parts = [renamed or "every rank kept its number"]
    if doc.left_out:
        parts.append(f"left out: {ranks_text(doc.left_out)}")
    return f"world generation {doc.generation}, ranks in its numbering (rebuilt: {'; '.join(parts)})"


def _generation_lines(doc: IncidentDoc) -> list[str]:
    text = generation_text(doc)
    return [text] if text is not None else []


def _advice(incident: Incident) -> list[str]:
    tips = []
    kinds = {f.kind for f in incident.findings}
    for block in _culprit_blocks(incident.culprits):
        c, who = block[0], ranks_text(b.rank for b in block)
        if c.why is CulpritReason.BEHIND:
            tips.append(
                f"{who}: elsewhere while the others wait; read what the code does at {c.site}"
                + (f" in {func_text(c.func)}" if func_text(c.func) else "")
                + " "
                f"({phase_text(c.phase)}). Usual causes: uneven evaluation shards, rank-0-only work "
                "(checkpoints, logging), a data stall, generate() without synced ranks, a collective inside an "
                "`if rank == ...`."
            )
        elif c.why is CulpritReason.STOPPED_BEATING:
            tips.append(
                f"{who}: stopped beating; check how that process ended (the launcher's log, `dmesg` for the OOM "
                "killer) on its host. The others cannot finish a collective without it."
            )
        elif c.why is CulpritReason.MISMATCH:
            tips.append(f"{who}: called a different op/size at the same point; the code paths diverged before it.")
        elif c.why is CulpritReason.P2P:
            tips.append(
                f"{who}: has not posted the send/recv its peer waits for; read what it does at {c.site} "
                "(pipeline stages out of step, or a condition that skips the transfer)."
            )
    moved = [
        f for f in incident.findings if isinstance(f, (DesyncFinding, StuckFinding)) and _progress_lines(incident, f)
    ]
    if moved:
        tips.append(
            "the waiting ranks had completed chunks of the op when they spoke (see VICTIMS): data was moving, so "
            "compare the bytes reduced with the time waited before suspecting a hang; a link slower than expected "
            "shows as a steady rate, a stopped one as chunks that no longer advance between reports."
        )
    if FindingKind.STUCK in kinds:
        tips.append(
            "every member is in the same collective: not a desync. Suspect the network/transport "
            "(NCCL_DEBUG=INFO, `python -m ncclguard doctor`) or a GPU that stopped."
        )
    if FindingKind.STORE in kinds:
        tips.append(
            "the rendezvous store is gone: its host (rank 0 under a plain launcher, the agent under torchrun) "
            "died; look for that process's end first, the other ranks only followed it."
        )
    if not tips:
        tips.append("no culprit found: compare the ranks' stacks in the rank<r>.json files.")
    if kinds & {FindingKind.DESYNC, FindingKind.STUCK, FindingKind.MISMATCH, FindingKind.P2P}:
        tips.append(
            "a backend timeout's NumelIn is what the waiting ranks queued, not proof that the transfer was slow."
        )
    return tips
