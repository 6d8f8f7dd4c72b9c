"""Detectors: pure functions from snapshots of a rank's state to the incidents they call for.

A snapshot is plain data (:class:`~ncclguard.incidents.model.OpRecord`,
:class:`~ncclguard.incidents.model.Heartbeat`, stale ages) plus ``now``; nothing here reads a
clock, a thread or the store, so each detector is tested with synthetic snapshots. A detector
returns :class:`Detection` drafts; the watchdog numbers them into incidents (claiming each
``signature`` once across ranks).

Heartbeats carry ``backend_seq`` (the backend's sequence number per group, counting every
collective whoever issued it): :func:`find_backend_desync` and :func:`find_backend_stuck` compare
them across ranks, so a rank waiting in an op issued from C++ (DDP's reducer, functional
collectives) is seen too. Both only say when to look; torch's flight recorder, read then and only
then, says whether the op is open (:func:`backend_op_state`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from ncclguard.incidents.model import BackendOp, IncidentKind, NumericsReport, OpRecord, StragglerReport
from ncclguard.recording.flight import seq_key

__all__ = [
    "Detection",
    "SeqView",
    "OpState",
    "backend_op_state",
    "blocked_in",
    "completed",
    "find_backend_desync",
    "find_backend_stuck",
    "find_hangs",
    "find_lost",
    "op_key",
]


class _RecordLike(Protocol):
    """A flight record or its plain-data form: both number an op in its group."""

    seq: int
    group: str
    peer: int | None
    state: str


@dataclass(frozen=True)
class Detection:
    """An incident to raise, before it is numbered.

    Attributes:
        kind: why.
        reason: one line for the log and the report's title.
        signature: the same for every rank that detects the same thing (claimed once).
        group, seq, op: a hang's op (``group`` is its counter: ``"<group>:p2p"`` for send/recv).
        ranks: the peers that went stale.
        store_text: what happened to the store.
        straggler: a straggler's report (kind ``straggler``).
        numerics: the recovery engine's numerical finding (kind ``numerics``).
    """

    kind: IncidentKind
    reason: str
    signature: str
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    ranks: tuple[int, ...] | None = None
    store_text: str | None = None
    straggler: StragglerReport | None = None
    numerics: NumericsReport | None = None

    @property
    def op_key(self) -> tuple[str, int] | None:
        return (self.group, self.seq) if self.group is not None and self.seq is not None else None


def op_key(rec: _RecordLike) -> tuple[str, int]:
    """``(counter, seq)`` of a record: its group, or ``"<group>:p2p"`` for send/recv."""
    return seq_key(rec.group, rec.peer is not None), rec.seq


def find_hangs(
    rank: int, inflight: Sequence[OpRecord], now: float, hang_timeout_s: float, reported: AbstractSet[tuple[str, int]]
) -> list[Detection]:
    """This rank's ops in flight for ``hang_timeout_s`` or longer, not reported yet.

    Args:
        rank: this rank.
        inflight: its ops in flight (``start`` is ``time.time()``).
        now: ``time.time()``.
        hang_timeout_s: the age that makes an op a hang.
        reported: ``op_key`` of the ops already reported.
    """
    out = []
    for rec in inflight:
        key = op_key(rec)
        if key in reported or now - rec.start < hang_timeout_s:
            continue
        reason = (
            f"rank {rank} waited {now - rec.start:.1f} s in {rec.op} #{rec.seq} on group {rec.group} "
            f"({rec.numel} x {rec.dtype or 'no data'}, issued at {rec.site})"
        )
        p2p = f"/r{rank}" if rec.peer is not None else ""  # send/recv numbers differ per rank
        out.append(
            Detection(IncidentKind.HANG, reason, f"hang/{key[0]}/{rec.seq}{p2p}", group=key[0], seq=rec.seq, op=rec.op)
        )
    return out


def find_lost(newly_stale: Mapping[int, float], hosts: Mapping[int, str] | None = None) -> Detection | None:
    """One incident for the peers that just went stale (with seconds since their last beat), each
    named with its host where ``hosts`` (rank -> ``node7 (10.0.0.7)``, from its last beat) knows it."""
    if not newly_stale:
        return None
    where = hosts or {}
    ages = ", ".join(
        f"rank {r}{f' on {where[r]}' if r in where else ''} for {newly_stale[r]:.1f} s" for r in sorted(newly_stale)
    )
    return Detection(
        IncidentKind.PEERS_LOST,
        f"no heartbeat from {ages}",
        f"lost/{min(newly_stale)}",
        ranks=tuple(sorted(newly_stale)),
    )


@dataclass(frozen=True)
class SeqView:
    """One rank's backend sequence number in a group, and how long it has stood still there."""

    seq: int
    still_s: float


def find_backend_desync(
    rank: int,
    own: Mapping[str, SeqView],
    peers: Mapping[int, Mapping[str, SeqView]],
    busy_groups: AbstractSet[str],
    hang_timeout_s: float,
    reported: AbstractSet[tuple[str, int]],
    peer_lag_s: float = 0.0,
) -> list[Detection]:
    """Groups where this rank stands ahead of watched peers, all still for ``hang_timeout_s``.

    This rank issued backend op ``#n`` (from Python or from C++: DDP's reducer, a functional
    collective) that the peers behind have not issued, and nobody moved since: it waits for them.
    Ranks at the same number are not a desync (a rank computing while nobody waits is not a hang).

    Args:
        rank: this rank.
        own: this rank's backend sequence number per group.
        peers: the watched peers' (live ones only), by rank.
        busy_groups: groups where this rank has an op in flight that ncclguard recorded: the hang
            detector (:func:`find_hangs`) speaks for those, with the Python call site.
        hang_timeout_s: how long everyone must have stood still.
        reported: ``(group, seq)`` already reported.
        peer_lag_s: how old a peer's number may be when read (a heartbeat period): a peer's
            stillness is known as of its last heartbeat, so it is counted up to this much short.
    """
    out = []
    for group, mine in sorted(own.items()):
        if group in busy_groups or (group, mine.seq) in reported or mine.still_s < hang_timeout_s:
            continue
        behind = {
            p: views[group]
            for p, views in sorted(peers.items())
            if group in views and views[group].seq < mine.seq and views[group].still_s + peer_lag_s >= hang_timeout_s
        }
        if not behind:
            continue
        where = ", ".join(f"rank {p} at #{v.seq}" for p, v in behind.items())
        reason = (
            f"rank {rank} stood {mine.still_s:.1f} s at backend op #{mine.seq} on group {group}, "
            f"not issued yet by {where}"
        )
        out.append(
            Detection(IncidentKind.BACKEND_DESYNC, reason, f"desync/{group}/{mine.seq}", group=group, seq=mine.seq)
        )
    return out


def find_backend_stuck(
    rank: int,
    own: Mapping[str, SeqView],
    peers: Mapping[int, Mapping[str, SeqView]],
    busy_groups: AbstractSet[str],
    hang_timeout_s: float,
    skip: AbstractSet[tuple[str, int]],
    peer_lag_s: float = 0.0,
) -> list[Detection]:
    """Groups where this rank and every watched peer in it stand still at one backend number.

    A suspicion, not a finding: ranks that compute while nobody waits stand still too. The
    watchdog then reads torch's flight recorder once per ``(group, seq)``: an op open there past
    ``hang_timeout_s`` is a hang with nobody behind, a stuck transport (:func:`backend_op_state`).
    Peers at other numbers are :func:`find_backend_desync`'s; a group where no watched peer is
    known is a suspect too (this rank's open op is a hang whoever else is in it; the merge sorts
    out the members from every rank's statement).

    Args:
        rank: this rank.
        own: this rank's backend sequence number per group, with how long it stood still.
        peers: the live watched peers', by rank.
        busy_groups: groups with an op in flight that ncclguard recorded (:func:`find_hangs` names it).
        hang_timeout_s: how long everyone must have stood still.
        skip: ``(group, seq)`` reported already, or read already and found completed.
        peer_lag_s: see :func:`find_backend_desync`.
    """
    out = []
    for group, mine in sorted(own.items()):
        if group in busy_groups or (group, mine.seq) in skip or mine.still_s < hang_timeout_s:
            continue
        seen = {p: views[group] for p, views in sorted(peers.items()) if group in views}
        if any(v.seq != mine.seq or v.still_s + peer_lag_s < hang_timeout_s for v in seen.values()):
            continue
        also = f", as did {', '.join(f'rank {p}' for p in seen)}" if seen else ""
        reason = f"rank {rank} stood {mine.still_s:.1f} s at backend op #{mine.seq} on group {group}{also}"
        out.append(
            Detection(IncidentKind.BACKEND_STUCK, reason, f"stuck/{group}/{mine.seq}", group=group, seq=mine.seq)
        )
    return out


class OpState(str, Enum):
    """What torch's flight recorder says of a suspected backend op."""

    OPEN = "open"  # open past the timeout: raise the incident
    CLOSED = "closed"  # it completed on this rank (or nothing tells, for a stuck transport): do not look again
    YOUNG = "young"  # open, but younger than the timeout (the numbers were read a beat apart): look again


def backend_op_state(op: BackendOp | None, now: float, hang_timeout_s: float, *, unknown_is_open: bool) -> OpState:
    """Whether a suspected op (:func:`find_backend_desync`, :func:`find_backend_stuck`) is a hang.

    Args:
        op: the newest op torch's recorder holds for the group (None: it holds none).
        now: ``time.time()``.
        hang_timeout_s: the age that makes an open op a hang.
        unknown_is_open: what to conclude when the recorder cannot tell (no entry, no state): a
            desync's numbers are evidence enough (a peer behind, everyone still), a stuck
            transport's are not (every rank computing also stands still).
    """
    if op is not None and op.completed:
        return OpState.CLOSED
    if op is None or op.completed is None:
        return OpState.OPEN if unknown_is_open else OpState.CLOSED
    if op.created and now - op.created < hang_timeout_s:
        return OpState.YOUNG
    return OpState.OPEN


def completed(records: Iterable[_RecordLike], key: tuple[str, int]) -> bool:
    """True when this rank's record of op ``key`` completed; failed does not count (an op that
    errored because a peer closed its pairs leaves the job as stuck as before).

    Args:
        records: the rank's flight records, oldest first (the newest record of ``key`` decides).
        key: ``op_key`` of the op.
    """
    for rec in reversed(list(records)):
        if rec.seq == key[1] and op_key(rec) == key:
            return rec.state == "completed"
    return False


def ended_since(records: Iterable[OpRecord], moved_at: Mapping[str, float]) -> set[str]:
    """Groups of ``moved_at`` where one of this rank's recorded synchronous collectives ended
    (completed or failed) at or after the backend's number last moved there.

    The backend's newest op in such a group is that call, and it is no longer open on this rank: a
    peer's number read a beat before it came (still behind) says nothing of a hang. Without this, a
    backend whose recorder holds no entries (gloo without torch's recorder) makes the op look open
    in the beat between the call's return and the peer's next heartbeat.

    Args:
        records: this rank's flight records (``end`` is ``time.time()``).
        moved_at: per group, the ``time.time()`` at which its backend number last moved.
    """
    out = set()
    for rec in records:
        at = moved_at.get(rec.group)
        # A synchronous call only: an async one's end is when it was waited for, which may come after
        # an op issued later (from C++) moved the number.
        if at is not None and rec.peer is None and not rec.async_op and rec.end is not None and rec.end >= at:
            out.add(rec.group)
    return out


def blocked_in(inflight: Sequence[OpRecord], main_ident: int | None) -> OpRecord | None:
    """The newest synchronous op the main thread is inside: it is in C++, no exception reaches it."""
    for rec in reversed(inflight):
        if rec.thread == main_ident and not rec.async_op:
            return rec
    return None
