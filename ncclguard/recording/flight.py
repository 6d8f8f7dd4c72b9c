"""The flight recorder: a per-process ring buffer of the collectives this rank issued.

Each record holds a sequence number per group, the op, size, dtype, group, times, state, the
phase and the user's call site. ``safe_*`` calls are always recorded; ``ncclguard.instrument()``
records the plain ``torch.distributed`` calls too. Recording is a few attribute writes and a
short frame walk; the call site is kept as a code object and an offset and becomes ``file:line``
only when read (benchmarks/recording_cost.py measures the cost).

Sequence numbers count per group and per process, so the n-th collective of one rank meets the
n-th of the others: a rank whose number is lower than its peers' is somewhere else. Point-to-point
ops (send/recv) count separately (``"<group>:p2p"``), because their counts differ between ranks
by design. The numbering is per world: the recorder forgets its records and counters when a new
world is announced (:func:`ncclguard.world.announce`, after ``rebuild_world``), because the new
world's ranks all count from 1 again.

Two doors in: :meth:`FlightRecorder.start` / :meth:`~FlightRecorder.finish` for any caller, and
the hot path's :meth:`~FlightRecorder.open_fast` / :meth:`~FlightRecorder.close_ok`, which
``instrument()``'s generated wrappers and ``safe_all_reduce`` call on every collective: the same
record in fewer steps, so nothing outside this module touches the recorder's fields.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from types import CodeType
from typing import Any

from ncclguard import _torch_compat as compat
from ncclguard.config import get_config
from ncclguard.recording.phase import MAIN as _MAIN_PHASES
from ncclguard.recording.phase import current_phase
from ncclguard.recording.sites import code_site, user_frame
from ncclguard.world import WorldChange, subscribe

__all__ = [
    "FlightRecord",
    "FlightRecorder",
    "recorder",
    "seq_key",
]

_get_ident = threading.get_ident
_time = time.time
_user_frame = user_frame
_getframe = sys._getframe
_new_record = object.__new__


class FlightRecord:
    """One collective as this rank saw it.

    Attributes:
        seq: its number in ``group`` (point-to-point ops: in ``"<group>:p2p"``), from 1.
        op: the operation, e.g. ``"all_reduce(SUM)"`` or ``"broadcast"``.
        group: the process group's name (``"0"`` is the world group).
        numel: elements of the input tensor(s); 0 for a barrier.
        dtype: e.g. ``"float32"``; ``""`` without a tensor.
        start: ``time.time()`` when it was issued.
        state: ``started``, ``completed`` or ``failed``.
        end: ``time.time()`` when it finished (async ops: when the completion was noticed).
        phase: the issuing thread's phase path.
        site: the user's ``file:line`` that issued it (resolved on first read, see below).
        error: the failure, as text.
        async_op: issued with ``async_op=True`` (or isend/irecv): the caller did not block in it.
        peer: the other rank of a send/recv.
        thread: ``threading.get_ident()`` of the issuing thread.
        chunks_done: chunks of a chunked call completed so far (0: not chunked, or none yet).
        chunks: chunks of the call (0 until the first chunk completes; see :meth:`FlightRecorder.progress`).
        bytes_done: bytes of the call reduced so far.

    The recorder keeps the call site as the user frame's code object and instruction offset and
    turns them into ``file:line`` only when :attr:`site` is read (a report, a heartbeat): a
    frame's ``f_lineno`` and the formatting cost more than the rest of the record together.
    """

    __slots__ = (
        "seq",
        "op",
        "group",
        "numel",
        "dtype",
        "start",
        "state",
        "end",
        "phase",
        "_site",
        "_code",
        "_lasti",
        "error",
        "async_op",
        "peer",
        "thread",
        "work",
        "chunks_done",
        "chunks",
        "bytes_done",
    )

    def __init__(
        self,
        seq: int,
        op: str,
        group: str,
        numel: int,
        dtype: str,
        start: float,
        state: str = "started",
        end: float | None = None,
        phase: str = "",
        site: str | None = "",
        error: str | None = None,
        async_op: bool = False,
        peer: int | None = None,
        thread: int = 0,
        code: CodeType | None = None,
        lasti: int = -1,
    ) -> None:
        self.seq = seq
        self.op = op
        self.group = group
        self.numel = numel
        self.dtype = dtype
        self.start = start
        self.state = state
        self.end = end
        self.phase = phase
        self._site = site  # None: not resolved yet (see _code)
        self._code = code  # the user frame's code and offset, for the site; None: no user frame
        self._lasti = lasti
        self.error = error
        self.async_op = async_op
        self.peer = peer
        self.thread = thread
        self.work: Any = None  # the async op's Work; never serialised
        self.chunks_done = 0
        self.chunks = 0
        self.bytes_done = 0

    @property
    def site(self) -> str:
        """The user's ``file:line`` that issued the op, ``"?"`` without one."""
        site = self._site
        if site is None:
            code = self._code
            site = self._site = "?" if code is None else code_site(code, self._lasti)
        return site

    @site.setter
    def site(self, value: str) -> None:
        self._site = value

    def __repr__(self) -> str:
        return f"FlightRecord({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlightRecord) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as the dataclass was)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON data (without the Work handle)."""
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group,
            "numel": self.numel,
            "dtype": self.dtype,
            "start": self.start,
            "state": self.state,
            "end": self.end,
            "phase": self.phase,
            "site": self.site,
            "error": self.error,
            "async_op": self.async_op,
            "peer": self.peer,
            "thread": self.thread,
            # Read bytes before chunks: the main thread writes chunks first, so a reader racing it
            # sees chunks_done at most one chunk ahead of bytes_done, never behind.
            "bytes_done": self.bytes_done,
            "chunks_done": self.chunks_done,
            "chunks": self.chunks,
        }


def seq_key(group: str, p2p: bool) -> str:
    """The counter a record is numbered in: the group, or ``"<group>:p2p"`` for send/recv."""
    return f"{group}:p2p" if p2p else group


class FlightRecorder:
    """A bounded ring of :class:`FlightRecord` with a sequence counter per group.

    The hot path (:meth:`start`, :meth:`finish`) takes no lock: each of its steps is a single
    operation on a dict, a deque or a list, atomic under the GIL, and the numbering of a group
    is owned by the one thread that issues its collectives (torch requires that order anyway).

    Args:
        size: records kept (the oldest are dropped); default ``Config.flight_records`` (2000).
    """

    def __init__(self, size: int | None = None) -> None:
        self._records: deque[FlightRecord] = deque(
            maxlen=self._check_size(size if size is not None else get_config().flight_records)
        )
        self._seq: dict[str, int] = {}
        self._done: dict[str, int] = {}
        # Async records waiting for their Work to complete (sync ones are in _open): id -> record.
        self._async: dict[int, FlightRecord] = {}
        # Per thread ident: records opened by start() and not yet finished or handed to attach().
        # They are this thread's ops in flight; while one is open, instrument()'s wrappers do not
        # record again (safe_all_reduce's chunks). A dict keyed by ident: cheaper than threading.local.
        self._open: dict[int, list[FlightRecord]] = {}

    @staticmethod
    def _check_size(size: Any) -> int:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"the flight recorder's size must be a positive int (records kept), got {size!r}")
        return size

    @property
    def size(self) -> int:
        """Records kept."""
        return self._records.maxlen or 0

    def resize(self, size: int) -> None:
        """Keeps the newest ``size`` records from now on.

        Raises:
            ValueError: ``size`` is not a positive int.
        """
        self._records = deque(self._records, maxlen=self._check_size(size))

    def busy(self) -> bool:
        """True while the calling thread is inside a recorded collective (nested calls are not recorded)."""
        return bool(self._open.get(_get_ident()))

    def start(
        self,
        op: str,
        group: str,
        numel: int,
        dtype: str,
        site: str | None = None,
        async_op: bool = False,
        peer: int | None = None,
    ) -> FlightRecord:
        """Opens a record for a collective that is about to be issued.

        Args:
            op: the operation's name.
            group: the process group's name.
            numel: elements moved (input side).
            dtype: the tensor's dtype without ``torch.``.
            site: the call site; default: the first frame outside the frameworks.
            async_op: the caller does not block in the op.
            peer: the other rank of a point-to-point op (numbers it in ``"<group>:p2p"``).

        Returns:
            The record; pass it to :meth:`finish` (or :meth:`attach` for an async op).
        """
        tid = _get_ident()
        key = group if peer is None else group + ":p2p"
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        phase = _MAIN_PHASES.path if tid == _MAIN_PHASES.ident else current_phase()
        code, lasti = None, -1
        if site is None:
            # The user's frame, found now (the stack is gone later); its line is looked up when
            # the site is read (FlightRecord.site): f_lineno costs more than the whole walk.
            frame = _user_frame(_getframe(2))
            if frame is None:
                site = "?"
            else:
                code, lasti = frame.f_code, frame.f_lasti
        rec = FlightRecord(
            seq, op, group, numel, dtype, _time(), "started", None, phase, site, None, async_op, peer, tid, code, lasti
        )
        self._records.append(rec)
        opened = self._open.get(tid)
        if opened is None:
            opened = self._open[tid] = []
        opened.append(rec)
        return rec

    def open_fast(
        self,
        op: str,
        group: str,
        numel: int,
        dtype: str,
        async_op: bool = False,
        peer: int | None = None,
    ) -> FlightRecord | None:
        """Opens a record for a collective the calling thread is about to issue (the hot path).

        :meth:`start` for the code that runs on every collective (``instrument()``'s wrappers,
        ``safe_all_reduce``): positional arguments, the call site always looked for (from the
        caller's caller up), and no record for a nested op.

        Args:
            op: the operation's name.
            group: the process group's name.
            numel: elements moved (input side).
            dtype: the tensor's dtype without ``torch.``.
            async_op: the caller does not block in the op.
            peer: the other rank of a point-to-point op (numbers it in ``"<group>:p2p"``).

        Returns:
            The record, to close with :meth:`close_ok`, :meth:`finish` or :meth:`attach`; None
            while the calling thread is inside a recorded call already: the op is part of that
            call (safe_all_reduce's chunks) and is not counted again.
        """
        tid = _get_ident()
        opened = self._open.get(tid)
        if opened:
            return None
        key = group if peer is None else group + ":p2p"
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        # The user's frame above the caller (a wrapper, safe_all_reduce), kept as code and offset.
        frame = _user_frame(_getframe(2))
        # Built field by field: binding __init__'s 16 arguments costs more than these stores,
        # and this runs on every collective. Keep in step with FlightRecord.__init__.
        rec = _new_record(FlightRecord)
        rec.seq = seq
        rec.op = op
        rec.group = group
        rec.numel = numel
        rec.dtype = dtype
        rec.start = _time()
        rec.state = "started"
        rec.end = None
        rec.phase = _MAIN_PHASES.path if tid == _MAIN_PHASES.ident else current_phase()
        rec.error = None
        rec.async_op = async_op
        rec.peer = peer
        rec.thread = tid
        rec.work = None
        rec.chunks_done = rec.chunks = rec.bytes_done = 0
        if frame is None:
            rec._site, rec._code, rec._lasti = "?", None, -1
        else:
            rec._site, rec._code, rec._lasti = None, frame.f_code, frame.f_lasti
        self._records.append(rec)
        if opened is None:
            self._open[tid] = [rec]
        else:
            opened.append(rec)
        return rec

    def close_ok(self, rec: FlightRecord | None) -> None:
        """Closes ``rec`` as completed: :meth:`finish` without an error, its usual case (the
        innermost open record of its thread) in a few steps. None (a nested op's): nothing."""
        if rec is None:
            return
        stack = self._open.get(rec.thread)
        if stack and stack[-1] is rec and rec.state == "started":
            stack.pop()
            rec.end = _time()
            rec.state = "completed"
            key = rec.group if rec.peer is None else rec.group + ":p2p"
            if rec.seq > self._done.get(key, 0):  # async ops may complete out of order
                self._done[key] = rec.seq
            return
        self.finish(rec)

    def _close(self, rec: FlightRecord) -> None:
        stack = self._open.get(rec.thread)
        if stack:
            if stack[-1] is rec:
                stack.pop()
            else:
                with contextlib.suppress(ValueError):
                    stack.remove(rec)

    def finish(self, rec: FlightRecord, error: BaseException | str | None = None) -> None:
        """Closes ``rec`` as completed, or as failed with ``error``."""
        stack = self._open.get(rec.thread)  # the issuing thread's: the one that finishes a sync op
        if stack and stack[-1] is rec:  # the usual case, inline: this runs on every collective
            stack.pop()
        elif stack:
            self._close(rec)
        if rec.state != "started":
            return
        rec.end = _time()
        rec.work = None
        self._async.pop(id(rec), None)  # an async op's, or one handed off
        if error is not None:
            rec.state = "failed"
            rec.error = (str(error) or type(error).__name__)[:500]
            return
        rec.state = "completed"
        key = rec.group if rec.peer is None else rec.group + ":p2p"
        if rec.seq > self._done.get(key, 0):  # async ops may complete out of order
            self._done[key] = rec.seq

    @staticmethod
    def progress(rec: FlightRecord, chunks_done: int, chunks: int, bytes_done: int) -> None:
        """Notes that ``chunks_done`` of the ``chunks`` chunks of ``rec`` completed, ``bytes_done``
        bytes in all. Three attribute writes, no lock: the watchdog reads them into the heartbeat
        (a read racing a write may see ``chunks_done`` one chunk ahead of ``bytes_done``)."""
        rec.chunks = chunks
        rec.chunks_done = chunks_done
        rec.bytes_done = bytes_done

    def progress_here(self, chunks_done: int, chunks: int, bytes_done: int) -> None:
        """:meth:`progress` of the record the calling thread has open (the chunked call it is
        in); nothing when it has none. For the chunk loop, which does not hold the record."""
        opened = self._open.get(_get_ident())
        if opened:
            rec = opened[-1]
            rec.chunks = chunks
            rec.chunks_done = chunks_done
            rec.bytes_done = bytes_done

    def attach(self, rec: FlightRecord, work: Any) -> None:
        """Hands an async op's ``Work`` to ``rec``: it stays in flight until the work completes
        (noticed by :meth:`sweep`), and the calling thread is free again."""
        self._close(rec)
        if work is None:  # a rank outside the group gets no Work; nothing is in flight
            self.finish(rec)
            return
        rec.work = work
        self._async[id(rec)] = rec

    def hand_off(self, rec: FlightRecord) -> None:
        """The op of ``rec`` goes on without the calling thread (a future will finish it): it
        leaves the thread's open records, so later ops of the thread are recorded, and stays in
        flight until :meth:`finish`."""
        self._close(rec)
        self._async[id(rec)] = rec

    def sweep(self) -> None:
        """Finishes the async records whose Work has completed (the watchdog calls this)."""
        for rec in list(self._async.values()):
            work = rec.work
            if work is None:
                continue
            try:
                if not work.is_completed():
                    continue
                exc = compat.work_error(work)
            except Exception as err:  # noqa: BLE001 - a broken Work is a failed op
                exc = err
            self.finish(rec, exc)

    def inflight(self) -> list[FlightRecord]:
        """Records started and not finished, oldest first."""
        opened = [r for stack in list(self._open.values()) for r in list(stack)]
        return sorted((r for r in opened + list(self._async.values()) if r.state == "started"), key=lambda r: r.start)

    def last_seq(self) -> dict[str, int]:
        """The last sequence number issued, per group (``"<group>:p2p"`` for send/recv)."""
        return dict(self._seq)

    def last_completed(self) -> dict[str, int]:
        """The highest sequence number completed, per group."""
        return dict(self._done)

    def records(self, last: int | None = None) -> list[FlightRecord]:
        """A copy of the ring (or its newest ``last`` records), oldest first."""
        recs = list(self._records)
        return recs[-last:] if last else recs

    def clear(self) -> None:
        """Forgets every record and counter (a fresh process group starts counting again)."""
        self._records.clear()
        self._seq.clear()
        self._done.clear()
        self._async.clear()
        self._open.clear()

    def follow_world(self, change: WorldChange) -> None:
        """Starts the new world's numbering: forgets the old world's records and counters (its
        groups are gone, and every rank of the new world counts from 1 again).

        Args:
            change: the world change :func:`ncclguard.world.announce` reports.
        """
        if change.new is not change.old:
            self.clear()


recorder = FlightRecorder()
# The process's recorder follows the world; a recorder made elsewhere (a test's) does not.
subscribe(recorder.follow_world)
