"""Culprits versus victims, from what the ranks said: pure functions of the typed model.

Per process group with an op in flight for longer than ``waiting_after_s``: the ranks waiting at
the group's highest sequence number are the victims; a member whose last sequence number is lower
is elsewhere (a culprit: its phase, main-thread call site and any op it is in are reported); a
member whose heartbeat went stale is lost; waiting ranks that disagree on the op, size or dtype at
the same number are a mismatch; everyone waiting at the same number with the same op is a stuck
transport, not a desync. Send/recv waits are matched by peer.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from ncclguard.incidents.model import (
    Analysis,
    Culprit,
    CulpritReason,
    DesyncFinding,
    Finding,
    Heartbeat,
    LostRank,
    LostRanksFinding,
    MismatchFinding,
    OpRecord,
    P2PFinding,
    SilentFinding,
    Statement,
    Straggler,
    StuckFinding,
    Variant,
    Whereabouts,
)
from ncclguard.incidents.summary import summary_line

__all__ = ["analyse", "whereabouts"]

SILENT_NOTE = "no statement came from these ranks (watchdog thread starved, e.g. the GIL held by C code)"


def _view(rank: int, statements: Mapping[int, Statement], heartbeats: Mapping[int, Heartbeat]) -> Heartbeat | None:
    """What is known of ``rank``: its statement, else its last heartbeat, else None."""
    if rank in statements:
        return statements[rank]
    return heartbeats.get(rank)


def _members(group: str, views: Mapping[int, Heartbeat], world_size: int) -> list[int]:
    for view in views.values():
        ranks = view.members(group) if isinstance(view, Statement) else None
        if ranks:
            return sorted(ranks)
    if group == "0":
        return list(range(world_size))
    return sorted(r for r, v in views.items() if group in v.last_seq)


def whereabouts(rank: int, view: Heartbeat | None, exclude: tuple[str, int] | None = None) -> Whereabouts:
    """A rank's whereabouts: phase, main-thread site, and the op it is in (other than ``exclude``)."""
    if view is None:
        return Whereabouts(rank=rank, phase="", site="?")
    inflight = None
    candidates = ([view.blocked_in] if view.blocked_in is not None else []) + list(view.inflight)
    for rec in candidates:
        if exclude is None or (rec.group, rec.seq) != exclude:
            inflight = rec
            break
    func = site_function(view.stack, view.site) if isinstance(view, Statement) else ""
    return Whereabouts(
        rank=rank, phase=view.phase, site=view.site, func=func, inflight=inflight, host=view.host, pid=view.pid
    )


def site_function(stack: Sequence[str], site: str) -> str:
    """The function at ``site`` (``file:line``) in ``stack`` (``"file:line in func: code"`` lines,
    innermost last); ``""`` when no frame of the stack is there."""
    head = f"{site} in "
    for line in reversed(stack):
        if line.startswith(head):
            return line[len(head) :].split(":", 1)[0].strip()
    # The stack is read a moment after the site: the frame may have moved to another line since.
    path = site.rpartition(":")[0]
    for line in reversed(stack):
        where, sep, rest = line.partition(" in ")
        if sep and where.rpartition(":")[0] == path:
            return rest.split(":", 1)[0].strip()
    return ""


class _Findings:
    """The analysis as it accumulates: findings, culprits by rank, victims."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.culprits: dict[int, Culprit] = {}
        self.victims: set[int] = set()

    def culprit(self, where: Whereabouts, why: CulpritReason, **fields: object) -> None:
        if where.rank not in self.culprits:
            self.culprits[where.rank] = Culprit.model_validate({**dict(where), **fields, "why": why})


def _group_finding(
    acc: _Findings,
    group: str,
    recs: dict[int, tuple[OpRecord, float]],
    views: Mapping[int, Heartbeat],
    stale: Mapping[int, float],
    world_size: int,
    now: float,
) -> None:
    """Analyses one group with an op stuck somewhere (``recs``: each rank's oldest op in flight)."""
    top = max(rec.seq for rec, _ in recs.values())
    at_top = {r: rec for r, (rec, _) in recs.items() if rec.seq == top}
    shapes = Counter((rec.op, rec.numel, rec.dtype) for rec in at_top.values())
    first = at_top[min(at_top)]
    base = {
        "group": group,
        "seq": top,
        "op": first.op,
        "numel": first.numel,
        "dtype": first.dtype,
        "phase": first.phase,
        "site": first.site,
        "waiting_s": round(max(now - rec.start for rec in at_top.values()), 1),
        **_backend_side(group, top, at_top, views),
    }
    if len(shapes) > 1:
        variants = []
        for shape, _count in shapes.most_common():
            ranks = sorted(r for r, rec in at_top.items() if (rec.op, rec.numel, rec.dtype) == shape)
            lead = at_top[ranks[0]]
            variants.append(
                Variant(ranks=ranks, op=shape[0], numel=shape[1], dtype=shape[2], site=lead.site, phase=lead.phase)
            )
        majority = len(variants[0].ranks) > len(variants[1].ranks)
        odd = sorted(r for v in variants[1 if majority else 0 :] for r in v.ranks)
        acc.findings.append(MismatchFinding.model_validate({**base, "variants": variants, "suspects": odd}))
        for r in odd:
            acc.culprit(whereabouts(r, views.get(r)), CulpritReason.MISMATCH, group=group, seq=top)
        acc.victims.update(r for r in at_top if r not in odd)
        return
    behind: list[Straggler] = []
    gone: list[Straggler] = []
    for r in _members(group, views, world_size):
        if r in at_top:
            continue
        view = views.get(r)
        last = view.last_seq.get(group, 0) if view is not None else 0
        done = view.last_completed.get(group, 0) if view is not None else 0
        where = dict(whereabouts(r, view, exclude=(group, top)))
        if r in stale:
            gone.append(
                Straggler.model_validate(
                    {**where, "last_seq": last, "last_completed": done, "stale_s": round(stale[r], 1)}
                )
            )
        elif view is None or last < top:
            behind.append(Straggler.model_validate({**where, "last_seq": last, "last_completed": done}))
        # else: it issued #top already and is not waiting in it: not the one holding the others up
    acc.victims.update(at_top)
    if not behind and not gone:
        acc.findings.append(StuckFinding.model_validate({**base, "waiting": sorted(at_top)}))
        return
    acc.findings.append(
        DesyncFinding.model_validate({**base, "waiting": sorted(at_top), "behind": behind, "lost": gone})
    )
    _name_behind(acc, group, top, behind, gone)


def _backend_side(
    group: str, seq: int, ranks: Mapping[int, OpRecord], views: Mapping[int, Heartbeat]
) -> dict[str, object]:
    """The backend's number and name of ncclguard's op ``#seq`` on ``group``, where a waiting
    rank's statement joined its record to torch's flight-recorder entry; empty otherwise."""
    for r in sorted(ranks):
        view = views.get(r)
        op = view.backend_ops.get(group) if isinstance(view, Statement) else None
        if op is not None and op.record is not None and op.record.seq == seq and op.record.peer is None:
            return {"backend_seq": op.seq, "backend_op": op.name}
    return {}


# torch's scalar type names (its flight recorder's input_dtypes) as ncclguard writes dtypes.
_SCALAR_TYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}
FROM_CPP = "C++ (not a torch.distributed Python call: DDP's reducer, a functional collective, ...)"


def _backend_finding(
    acc: _Findings,
    group: str,
    statements: Mapping[int, Statement],
    views: Mapping[int, Heartbeat],
    stale: Mapping[int, float],
    world_size: int,
    now: float,
    stuck: bool = False,
) -> None:
    """Analyses ``group`` by the backend's sequence numbers: the ranks at the highest number wait
    in an op the others have not issued (found by :func:`~ncclguard.watching.sensors.detect.find_backend_desync`),
    or, for a ``stuck`` incident (``stuck``), every member there with the op open: an op that does
    not move (a stuck transport, :func:`~ncclguard.watching.sensors.detect.find_backend_stuck`). The site is the Python call's where
    a statement joined the op to ncclguard's record of it, else "issued from C++"."""
    seqs = {r: v.backend_seq[group] for r, v in views.items() if v.backend_seq and group in v.backend_seq}
    if not seqs:
        return
    top = max(seqs.values())
    at_top = sorted(r for r, seq in seqs.items() if seq == top and r not in stale)
    if not at_top:
        return
    lead = views[at_top[0]]
    op = next((st.backend_ops[group] for r in at_top if (st := statements.get(r)) and group in st.backend_ops), None)
    dtype = _SCALAR_TYPES.get(op.dtypes[0], op.dtypes[0].lower()) if op and op.dtypes else ""
    numel = sum(math.prod(size) for size in op.sizes) if op else 0
    rec = op.record if op is not None else None
    base = {
        "group": group,
        "seq": top,
        "op": op.name if op else "an op",
        "numel": numel,
        "dtype": dtype,
        "phase": rec.phase if rec is not None else lead.phase,
        "site": rec.site if rec is not None else f"{FROM_CPP}; main thread at {lead.site}",
        "waiting_s": round(now - op.created, 1) if op and op.created else 0.0,
        "backend": True,
        "record_seq": rec.seq if rec is not None else None,
    }
    behind: list[Straggler] = []
    gone: list[Straggler] = []
    for r in _members(group, views, world_size):
        seq = seqs.get(r, 0)
        if seq >= top:
            continue
        # The others passed #seq: it completed there. Its whereabouts are Python's.
        entry = Straggler.model_validate({**dict(whereabouts(r, views.get(r))), "last_seq": seq, "last_completed": seq})
        if r in stale:
            gone.append(entry.model_copy(update={"stale_s": round(stale[r], 1)}))
        else:
            behind.append(entry)
    if not behind and not gone:
        # Every member at #top: the desync closed, or (raised as such) a stuck transport if the op is open.
        said = {
            r: st.backend_ops[group].completed for r in at_top if (st := statements.get(r)) and group in st.backend_ops
        }
        waiting = [r for r in at_top if not said.get(r)]  # open, or not known to have completed
        if stuck and False in said.values():
            acc.victims.update(waiting)
            acc.findings.append(StuckFinding.model_validate({**base, "waiting": waiting}))
        return
    acc.victims.update(at_top)
    acc.findings.append(DesyncFinding.model_validate({**base, "waiting": at_top, "behind": behind, "lost": gone}))
    _name_behind(acc, group, top, behind, gone)


def _name_behind(acc: _Findings, group: str, top: int, behind: list[Straggler], gone: list[Straggler]) -> None:
    """Names the culprits of a desync in ``group`` at ``top``: the ranks that stopped beating, and the
    ranks behind at the lowest count. A rank behind the top but ahead of another issued an op that one
    never reached, which cannot complete: it waits for it, a victim (4 ranks, one SIGSTOPped: a
    broadcast relayed through it holds one receiver below the ranks that went on into the backward)."""
    lowest = min((e.last_seq for e in [*behind, *gone]), default=0)
    acc.victims.update(e.rank for e in behind if e.last_seq > lowest)
    named = [(e, CulpritReason.BEHIND) for e in behind if e.last_seq == lowest]
    for entry, why in named + [(e, CulpritReason.STOPPED_BEATING) for e in gone]:
        fields = {"group": group, "seq": top, "last_seq": entry.last_seq, "last_completed": entry.last_completed}
        if entry.stale_s is not None:
            fields["stale_s"] = entry.stale_s
        acc.culprit(Whereabouts.model_validate(dict(entry)), why, **fields)


def _opposite(op: str, other: str) -> bool:
    """Whether two point-to-point ops go opposite ways (a send and a receive)."""
    return ("send" in op and "recv" in other) or ("recv" in op and "send" in other)


def _p2p_finding(
    acc: _Findings, rank: int, rec: OpRecord, views: Mapping[int, Heartbeat], stale: Mapping[int, float], now: float
) -> None:
    peer = rec.peer if rec.peer is not None else -1
    peer_view = views.get(peer) if peer not in stale else None
    toward = [p for p in (peer_view.inflight if peer_view is not None else []) if p.peer == rank]
    # A send met by the peer's receive (or the reverse) is a transfer under way, slow or large: a
    # snapshot swap of 800 MB over gloo takes seconds. Only ops the same way round are a deadlock.
    matched = [p for p in toward if _opposite(rec.op, p.op)]
    back = [] if matched else toward
    where = whereabouts(peer, peer_view)
    acc.findings.append(
        P2PFinding(
            rank=rank,
            op=rec.op,
            group=rec.group,
            seq=rec.seq,
            peer=peer,
            numel=rec.numel,
            dtype=rec.dtype,
            phase=rec.phase,
            site=rec.site,
            waiting_s=round(now - rec.start, 1),
            peer_waits_back=back[0] if back else None,
            peer_matched=matched[0] if matched else None,
            peer_where=where,
        )
    )
    acc.victims.add(rank)
    if peer >= 0 and peer not in stale and not toward:
        acc.culprit(where, CulpritReason.P2P, group=rec.group, seq=rec.seq, waiter=rank, waiter_op=rec.op)


def analyse(
    statements: Mapping[int, Statement],
    heartbeats: Mapping[int, Heartbeat],
    stale: Mapping[int, float],
    world_size: int,
    *,
    now: float | None = None,
    waiting_after_s: float = 0.0,
    focus: tuple[str, int] | None = None,
    backend_group: str | None = None,
    stuck_group: str | None = None,
) -> Analysis:
    """Names culprits and victims from what the ranks said.

    Args:
        statements: each answering rank's statement, by rank.
        heartbeats: the last heartbeat seen of each rank, by rank (used where no statement came).
        stale: ranks whose heartbeat stopped, with seconds since it last changed.
        world_size: ranks in the job.
        now: the time of the analysis (``time.time()``); default now.
        waiting_after_s: an op counts as stuck once in flight this long.
        focus: ``(group, seq)`` of the op that raised the incident: its group is always analysed.
        backend_group: a group whose ranks stood at different backend sequence numbers (a
            ``desync`` incident): analysed by those numbers when no recorded op explains it.
        stuck_group: a group whose ranks stood at one backend sequence number with the op open (a
            ``stuck`` incident): analysed the same way.

    Returns:
        The findings, culprits, victims, stale and silent ranks, and the one-line summary.
    """
    now = time.time() if now is None else now
    views = _views(statements, heartbeats, world_size)
    lost = sorted(r for r in stale if r < world_size)
    silent = sorted(r for r in range(world_size) if r not in statements and r not in stale)
    acc = _Findings()
    oldest, p2p_waits = _waiting_ops(views, stale, waiting_after_s)
    # Analysed: the groups where an op waited long enough somewhere, and always the incident's own.
    problem = [
        g
        for g, recs in oldest.items()
        if any(age >= waiting_after_s for _, age in recs.values()) or (focus is not None and focus[0] == g)
    ]
    for group in sorted(problem):
        _group_finding(acc, group, oldest[group], views, stale, world_size, now)
    for seen_group, stuck in ((backend_group, False), (stuck_group, True)):
        if seen_group is not None and seen_group not in problem:
            _backend_finding(acc, seen_group, statements, views, stale, world_size, now, stuck)
    for r, rec in sorted(p2p_waits, key=lambda w: (w[0], w[1].seq)):
        _p2p_finding(acc, r, rec, views, stale, now)
    _lost_finding(acc, [r for r in lost if r not in acc.culprits], views, stale, world_size)
    if silent:
        acc.findings.append(SilentFinding(ranks=silent, note=SILENT_NOTE))
    acc.victims.difference_update(acc.culprits)
    return Analysis(
        findings=acc.findings,
        culprits=[acc.culprits[r] for r in sorted(acc.culprits)],
        victims=sorted(acc.victims),
        lost=lost,
        silent=silent,
        summary=summary_line(acc.findings),
    )


def _views(
    statements: Mapping[int, Statement], heartbeats: Mapping[int, Heartbeat], world_size: int
) -> dict[int, Heartbeat]:
    """What is known of each rank of the world (its statement, else its last heartbeat), by rank."""
    views: dict[int, Heartbeat] = {}
    for r in range(world_size):
        known = _view(r, statements, heartbeats)
        if known is not None:
            views[r] = known
    return views


def _waiting_ops(
    views: Mapping[int, Heartbeat], stale: Mapping[int, float], waiting_after_s: float
) -> tuple[dict[str, dict[int, tuple[OpRecord, float]]], list[tuple[int, OpRecord]]]:
    """The groups with an op stuck somewhere: per group, the oldest op in flight of each rank with
    its age; and the send/recv that waited ``waiting_after_s`` or more, with their ranks."""
    oldest: dict[str, dict[int, tuple[OpRecord, float]]] = {}
    p2p_waits: list[tuple[int, OpRecord]] = []
    for r, view in views.items():
        if r in stale:
            continue  # a lost rank's last heartbeat is old news: it is a culprit, not a witness
        for rec in view.inflight:
            if rec.peer is not None:  # send/recv: counts differ between ranks, matched by peer later
                if view.time - rec.start >= waiting_after_s:
                    p2p_waits.append((r, rec))
                continue
            mine = oldest.setdefault(rec.group, {})
            if r not in mine or rec.seq < mine[r][0].seq:
                mine[r] = (rec, round(view.time - rec.start, 3))
    return oldest, p2p_waits


def _lost_finding(
    acc: _Findings,
    missing_lost: list[int],
    views: Mapping[int, Heartbeat],
    stale: Mapping[int, float],
    world_size: int,
) -> None:
    """Names the lost ranks no other finding named culprits (they stopped beating), the rest of the
    world their victims when no finding named any."""
    if not missing_lost:
        return
    entries = []
    for r in missing_lost:
        seen = views.get(r)
        where = dict(whereabouts(r, seen))
        by_group = dict(seen.last_completed) if seen is not None else {}
        entries.append(
            LostRank.model_validate({**where, "stale_s": round(stale[r], 1), "last_completed_by_group": by_group})
        )
        acc.culprit(
            Whereabouts.model_validate(where),
            CulpritReason.STOPPED_BEATING,
            stale_s=round(stale[r], 1),
            last_completed_by_group=by_group,
        )
    acc.findings.append(LostRanksFinding(ranks=entries))
    if not acc.victims:
        acc.victims.update(r for r in range(world_size) if r not in acc.culprits)
