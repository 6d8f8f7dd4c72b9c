"""The backend's sequence numbers as a rank's watchdog follows them: a desync or a stuck op suspected
from the numbers, and confirmed (with the op named) by one read of torch's flight recorder."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from ncclguard.incidents.model import BackendOp, IncidentKind, OpRecord
from ncclguard.watching.sensors import detect
from ncclguard.watching.sensors.liveness import Liveness, SeqClock
from ncclguard.watching.sensors.rank_state import RECENT, RankState, backend_ops

__all__ = ["BackendWatch"]


class BackendWatch:
    """The backend's numbers as this rank's watchdog follows them: its own (when each last moved),
    the suspects they raise, and torch's flight recorder read to confirm each suspect once.

    Args:
        rank: this rank.
        state: this rank's state.
        liveness: the watched peers (their numbers come with their heartbeats).
        hang_timeout_s: how long the numbers must stand still.
        heartbeat_s: how old a peer's number may be when read.
    """

    def __init__(
        self, rank: int, state: RankState, liveness: Liveness, hang_timeout_s: float, heartbeat_s: float
    ) -> None:
        self.rank, self.state, self.liveness = rank, state, liveness
        self.hang_timeout_s, self.heartbeat_s = hang_timeout_s, heartbeat_s
        self.own_seqs = SeqClock()
        self.reported: set[tuple[str, int]] = set()  # (group, seq) in the backend's numbering
        self.looked: set[tuple[str, int]] = set()  # read in torch's recorder and found closed

    def suspects(self, inflight: Sequence[OpRecord]) -> list[detect.Detection]:
        """Groups that the backend's numbers make suspect: a desync (this rank ahead of a still
        peer) or a stuck op (everyone still at one number)."""
        now = time.monotonic()
        self.own_seqs.update(self.state.backend_seq(), now)  # every tick: ~0.5 us a group
        own, peers = self.own_seqs.views(now), self.liveness.seq_views(now)
        self.looked = {(g, s) for g, s in self.looked if g in own and own[g].seq == s}  # moved: look again
        busy = {rec.group for rec in inflight if rec.peer is None}
        skip = self.reported | self.looked
        args = (self.rank, own, peers, busy, self.hang_timeout_s, skip, self.heartbeat_s)
        return detect.find_backend_desync(*args) + detect.find_backend_stuck(*args)

    def confirm(self, suspects: Sequence[detect.Detection]) -> list[detect.Detection]:
        """Reads torch's flight recorder once for the suspects (the only place it is read before an
        incident): those that are hangs, with their op named."""
        if not suspects:
            return []
        # The call that issued a newest entry, if Python did, is among this rank's newest records.
        seqs = {h.group: h.seq for h in suspects if h.group is not None and h.seq is not None}
        records = self.state.records(RECENT)
        ops = backend_ops(seqs, records)
        # A synchronous call of this rank that returned since the number moved closed the newest op,
        # whatever the recorder holds (gloo's may hold nothing): the peer's number behind is a beat old.
        wall, mono = time.time(), time.monotonic()
        ended = detect.ended_since(
            records, {g: wall - (mono - self.own_seqs.since[g]) for g in seqs if g in self.own_seqs.since}
        )
        out = []
        for hang in suspects:
            assert hang.group is not None and hang.seq is not None
            op = ops.get(hang.group)
            stuck = hang.kind is IncidentKind.BACKEND_STUCK
            state = (
                detect.OpState.CLOSED
                if hang.group in ended
                else detect.backend_op_state(op, wall, self.hang_timeout_s, unknown_is_open=not stuck)
            )
            if state is detect.OpState.CLOSED:
                self.looked.add((hang.group, hang.seq))  # completed here (the peers' numbers are a beat old)
            if state is not detect.OpState.OPEN or (hang.group, hang.seq) in self.reported:
                continue
            self.reported.add((hang.group, hang.seq))
            out.append(
                hang
                if op is None
                else replace(hang, op=op.name, reason=f"{hang.reason} (in {op.name}{_issued_text(op)})")
            )
        return out


def _issued_text(op: BackendOp) -> str:
    """``", issued at eval.py:88 as ncclguard's #12"`` where a Python call issued ``op``, else ``""``."""
    rec = op.record
    return f", issued at {rec.site} as ncclguard's #{rec.seq}" if rec is not None else ""
