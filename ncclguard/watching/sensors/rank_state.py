"""This rank's state, read for the watchdog: heartbeats, statements, thread stacks, records.

The one place where the watchdog reads the live process (the flight recorder, the main
thread's frame and phase, the process groups); everything downstream works on the snapshots
it returns (:mod:`ncclguard.incidents.model`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import FrameType

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard._naming import HOSTNAME, node_address
from ncclguard.errors import TorchCompatError
from ncclguard.incidents.model import BackendOp, Heartbeat, OpRecord, PeerView, Statement
from ncclguard.recording.flight import FlightRecord, recorder
from ncclguard.recording.phase import main_thread_phase
from ncclguard.recording.sites import format_stack, frame_site
from ncclguard.watching.sensors import detect, torchfr
from ncclguard.watching.sensors.progress import JUDGED, JUDGED_ABOUT, SNAPSHOTS_SAY, beat_evidence, own_sample
from ncclguard.world import current_world

__all__ = ["RECENT", "RankState", "WorldArrivals", "backend_ops", "op_record"]

RECENT = 20  # flight records carried in a statement (the rank dump has them all)


def op_record(rec: FlightRecord) -> OpRecord:
    """A flight record as plain data."""
    return OpRecord.model_validate(rec.to_dict())


def _recorder_dump(groups: Collection[str], parse: Callable[[str], torchfr.Dump] | None = None) -> torchfr.Dump:
    """torch's flight-recorder entries and per-group status: the backend-neutral dump (gloo), and
    NCCL's own where groups are missing from it (on NCCL the neutral dump is empty: torch 2.11).
    ``parse``: how a dump's text is read (default: the newest entry of each of ``groups``)."""
    dump = torchfr.Dump()
    for nccl in (False, True):
        if nccl and (not dist.is_nccl_available() or set(groups) <= {e.group for e in dump.entries}):
            break
        try:
            text = compat.dump_flight_recorder(nccl=nccl)
            part = parse(text) if parse is not None else torchfr.parse_newest(text, groups)
        except (TorchCompatError, RuntimeError, ValueError):
            continue
        dump.entries += part.entries
        dump.status.update(part.status)
    return dump


def backend_ops(seqs: Mapping[str, int], records: Sequence[OpRecord] = ()) -> dict[str, BackendOp]:
    """Per group of ``seqs``: the newest op torch's flight recorder holds for it, whether it
    completed on this rank (:func:`~ncclguard.watching.sensors.torchfr.entry_open`), and the record of
    the Python call that issued it where ``records`` has one (:func:`~ncclguard.watching.sensors.torchfr.join`).
    Groups it has no entry for are left out.

    The recorder numbers collectives apart from send/recv (``collective_seq_id``, ``p2p_seq_id``),
    while the backend's sequence number counts both: the newest entry is matched, not a number.

    Args:
        seqs: this rank's backend sequence number per group.
        records: ncclguard's flight records to join (none: no join).
    """
    if not seqs:
        return {}
    dump = _recorder_dump(seqs)
    found = torchfr.newest(dump.entries, seqs)
    issued = torchfr.join(records, list(found.values())) if records else {}
    out = {}
    for name, e in found.items():
        is_open = torchfr.entry_open(e, dump.status)
        out[name] = BackendOp(
            seq=seqs[name],
            name=e.name,
            sizes=e.sizes,
            dtypes=e.dtypes,
            created=e.created,
            state=e.state,
            completed=None if is_open is None else not is_open,
            record=issued.get(e.record_id),
        )
    return out


class WorldArrivals:
    """The world group's backend, read for straggler windows (:class:`~ncclguard.watching.sensors.straggler.StragglerWatch`):
    its sequence number, and when this rank reached its recent collectives by torch's flight recorder
    (``time_created_ns``: ``c10::getTime()``, CLOCK_REALTIME on Linux, the clock of ``time.time()``)."""

    def __init__(self) -> None:
        self.read_s = 0.0  # how long the last read of the recorder took (benchmarks/straggler_overhead.py)

    @staticmethod
    def _world() -> tuple[dist.ProcessGroup, str] | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            pg = compat.default_group()
            return pg, compat.group_names()[pg]
        except (TorchCompatError, RuntimeError, KeyError):
            return None

    def seq(self) -> int | None:
        """The world group's backend sequence number (every collective it ran, whoever issued it);
        None without a group or where this torch cannot tell."""
        world = self._world()
        if world is None:
            return None
        try:
            return compat.sequence_number(world[0])
        except (TorchCompatError, RuntimeError):
            return None

    def arrivals(self, start: float, end: float, last: int) -> tuple[str, list[tuple[int, float]]]:
        """The newest ``last`` collectives of the world group this rank reached in ``[start, end)``:
        torch's name of the most frequent op, and ``(collective_seq_id, time.time() of arrival)``,
        oldest first; ``("", [])`` where the recorder holds none or cannot be read.

        Args:
            start, end: the window, in ``time.time()`` seconds.
            last: how many at most.
        """
        world = self._world()
        if world is None:
            return "", []
        name = world[1]
        t0 = time.perf_counter()
        dump = _recorder_dump(
            [name], lambda text: torchfr.Dump(entries=torchfr.parse_window(text, name, start, end, last))
        )
        self.read_s = time.perf_counter() - t0
        entries = [e for e in dump.entries if e.group == name][-last:]
        if not entries:
            return "", []
        names = [e.name for e in entries]
        return max(set(names), key=names.count)[:80], [(e.collective_seq, e.created) for e in entries]


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

    def records(self, last: int | None = None) -> list[OpRecord]:
        """The flight records kept (the ``last`` newest ones; default all), oldest first."""
        return [op_record(r) for r in recorder.records(last)]

    def blocked_in(self) -> OpRecord | None:
        """The synchronous op the main thread is inside, if any."""
        return detect.blocked_in(self.inflight(), self.main_ident)

    def completed(self, key: tuple[str, int]) -> bool:
        """True when this rank's part of op ``key`` completed (see :func:`detect.completed`)."""
        return detect.completed(recorder.records(), key)

    def heartbeat(self, beat: int) -> Heartbeat:
        """What this rank publishes now (its ``beat``-th heartbeat)."""
        inflight = self.inflight()
        cpu, io = own_sample()
        said = current_world().get(JUDGED)
        about = current_world().get(JUDGED_ABOUT).key  # read first: a vote is never newer than its step
        judged = {str(k): str(v) for k, v in list(said.items())}  # a copy: the verdict's thread writes it
        return Heartbeat(
            rank=self.rank,
            host=HOSTNAME,
            address=node_address(),
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
            main_cpu_s=cpu,
            io_bytes=io,
            **beat_evidence(),
            judged=judged or None,
            judged_about=about if judged else None,
            snapshots=current_world().get(SNAPSHOTS_SAY).text,
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
            backend_ops=backend_ops(hb.backend_seq or {}, self.records()),
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
