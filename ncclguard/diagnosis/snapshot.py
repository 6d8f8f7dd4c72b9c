"""This rank's state, read for the watchdog: heartbeats, statements, thread stacks, records.

The one place where the watchdog reads the live process (the flight recorder, the main
thread's frame and phase, the process groups); everything downstream works on the snapshots
it returns (:mod:`ncclguard.diagnosis.model`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._naming import HOSTNAME
from ncclguard.diagnosis import detect
from ncclguard.diagnosis.flight import FlightRecord, format_stack, frame_site, recorder
from ncclguard.diagnosis.model import BackendOp, Heartbeat, OpRecord, PeerView, Statement
from ncclguard.diagnosis.phase import main_thread_phase
from ncclguard.errors import TorchCompatError

__all__ = ["RECENT", "RankState", "backend_ops", "op_record"]

RECENT = 20  # flight records carried in a statement (the rank dump has them all)


def op_record(rec: FlightRecord) -> OpRecord:
    """A flight record as plain data."""
    return OpRecord.model_validate(rec.to_dict())


def _recorder_dumps(groups: Mapping[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """torch's flight-recorder entries and per-group status: the backend-neutral dump (gloo), and
    NCCL's own where groups are missing from it (on NCCL the neutral dump is empty: torch 2.11)."""
    entries: list[dict[str, Any]] = []
    status: dict[str, Any] = {}
    for nccl in (False, True):
        found = {(e.get("process_group") or [None])[0] for e in entries}
        if nccl and (not dist.is_nccl_available() or groups.keys() <= found):
            break
        try:
            raw = json.loads(compat.dump_flight_recorder(nccl=nccl))
        except (TorchCompatError, RuntimeError, ValueError):
            continue
        entries += raw.get("entries") or []
        status.update(raw.get("pg_status") or {})
    return entries, status


def backend_ops(seqs: Mapping[str, int]) -> dict[str, BackendOp]:
    """Per group of ``seqs``: the newest op torch's flight recorder holds for it, and whether it
    completed on this rank: by the entry's state where the backend tracks it (NCCL), else by the
    recorder's per-group status (gloo, whose entries all read "scheduled"). Groups it has no
    entry for are left out.

    The recorder numbers collectives apart from send/recv (``collective_seq_id``, ``p2p_seq_id``),
    while the backend's sequence number counts both: the newest entry is matched, not a number.
    """
    if not seqs:
        return {}
    entries, status = _recorder_dumps(seqs)
    newest: dict[str, dict[str, Any]] = {}
    for e in entries:
        name = (e.get("process_group") or [None])[0]
        if name in seqs and e.get("record_id", -1) >= newest.get(name, {}).get("record_id", -1):
            newest[name] = e
    out = {}
    for name, e in newest.items():
        completed = True if e.get("state") == "completed" else None
        st = status.get(name)
        if completed is None and not e.get("is_p2p") and isinstance(st, dict):
            try:
                completed = int(st["last_completed_collective"]) >= int(e["collective_seq_id"])
            except (KeyError, TypeError, ValueError):
                completed = None
        out[name] = BackendOp(
            seq=seqs[name],
            name=str(e.get("profiling_name", "")),
            sizes=e.get("input_sizes") or [],
            dtypes=[str(d) for d in e.get("input_dtypes") or []],
            created=float(e.get("time_created_ns") or 0) / 1e9,
            state=str(e.get("state", "")),
            completed=completed,
        )
    return out


class RankState:
    """Reads this process's state for its watchdog.

    Args:
        rank: this rank.
        world_size: ranks in the job.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.main_ident = threading.main_thread().ident
        self.pid = os.getpid()

    def _main_frame(self) -> FrameType | None:
        return sys._current_frames().get(self.main_ident or -1)

    def inflight(self) -> list[OpRecord]:
        """This rank's ops in flight, oldest first."""
        return [op_record(r) for r in recorder.inflight()]

    def records(self) -> list[OpRecord]:
        """Every flight record kept, oldest first."""
        return [op_record(r) for r in recorder.records()]

    def blocked_in(self) -> OpRecord | None:
        """The synchronous op the main thread is inside, if any."""
        return detect.blocked_in(self.inflight(), self.main_ident)

    def completed(self, key: tuple[str, int]) -> bool:
        """True when this rank's part of op ``key`` completed (see :func:`detect.completed`)."""
        return detect.completed(recorder.records(), key)

    def heartbeat(self, beat: int) -> Heartbeat:
        """What this rank publishes now (its ``beat``-th heartbeat)."""
        inflight = self.inflight()
        return Heartbeat(
            rank=self.rank,
            host=HOSTNAME,
            pid=self.pid,
            beat=beat,
            time=time.time(),
            phase=main_thread_phase(),
            site=frame_site(self._main_frame()),
            last_seq=recorder.last_seq(),
            last_completed=recorder.last_completed(),
            inflight=inflight,
            blocked_in=detect.blocked_in(inflight, self.main_ident),
            backend_seq=self.backend_seq(),
        )

    def statement(self, beat: int, peers: Mapping[str, PeerView]) -> Statement:
        """What this rank says about itself on an incident: a heartbeat, its main-thread stack,
        its recent records, its groups, how it sees its watched peers, and the backend's ops at
        its sequence numbers (torch's flight recorder, read here and never on a collective's path)."""
        hb = self.heartbeat(beat)
        return Statement(
            **dict(hb),
            world_size=self.world_size,
            stack=format_stack(self._main_frame()),
            recent=[op_record(r) for r in recorder.records(RECENT)],
            groups=self.groups(),
            peers=dict(peers),
            backend_ops=backend_ops(hb.backend_seq or {}),
        )

    @staticmethod
    def backend_seq() -> dict[str, int] | None:
        """The backend's sequence number of each group this rank is in: every collective the
        backend ran, whoever issued it (Python, DDP's reducer, functional collectives). None
        without a process group or where this torch cannot tell."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        out = {}
        try:
            groups = compat.group_names()
        except (TorchCompatError, RuntimeError):
            return None
        for pg, name in groups.items():
            try:
                if not compat.rank_not_in_group(pg):
                    out[name] = compat.sequence_number(pg)
            except (TorchCompatError, RuntimeError):
                continue  # a group being destroyed, or a backend without the counter
        return out

    @staticmethod
    def threads() -> dict[str, list[str]]:
        """The stack of every Python thread, by ``"name (ident)"``."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        return {
            f"{names.get(ident, 'thread')} ({ident})": format_stack(frame, limit=60) for ident, frame in frames.items()
        }

    @staticmethod
    def groups() -> dict[str, list[int]]:
        """Every process group's name and global ranks; empty without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        for _ in range(3):  # the main thread may add a group while we read
            try:
                names = compat.group_names()
                ranks = compat.group_ranks()
                return {names[pg]: sorted(ranks[pg]) for pg in names if pg in ranks}
            except RuntimeError:
                continue
        return {}
