"""The flight recorder: a per-process ring of the collectives this rank issued.

Each record holds a sequence number per group, the op, size, dtype, group, times, state, the
phase and the user's call site. ``safe_*`` calls are always recorded; ``ncclguard.instrument()``
records the plain ``torch.distributed`` calls too.

Sequence numbers count per group and per process, so the n-th collective of one rank meets the
n-th of the others: a rank whose number is lower than its peers' is somewhere else. Point-to-point
ops (send/recv) count separately (``"<group>:p2p"``), because their counts differ between ranks
by design. The numbering is per world: the recorder forgets its records and counters when a new
world is announced (:func:`ncclguard.world.announce`, after ``rebuild_world``), because the new
world's ranks all count from 1 again.

What a record costs (``benchmarks/recording_breakdown.py`` measures it part by part): a
record is one list built in one step (:mod:`ncclguard.recording.record`), holding what the call has
at hand, unformatted, and appended to a ``deque`` whose ``maxlen`` drops the oldest. There is no
lock on the path. Threads: one thread issues a group's collectives (torch needs that order
anyway) and writes its records; the watchdog's thread reads them (and closes async ones in
:meth:`FlightRecorder.sweep`). Under the GIL each step below is one bytecode-level operation on a
list, dict or deque, so a reader sees it whole or not at all:

- a record is built completely before it is appended: the ring never holds half a record, and a
  copy of the ring (``list(deque)``, one C call) holds whole records;
- after that only single slots change: ``ERROR`` before ``END`` (a reader reads ``END`` first, so
  a failed record never reads as completed), ``PROGRESS`` as one tuple;
- a ring slot is a reference: when the ring wraps, the oldest record is dropped as a whole and a
  reader's copy keeps it alive; a record is never rewritten for another op, so an op finishing
  after its record left the ring writes into its own list, not a newer op's;
- the counters (``Count``) are written by the issuing thread, except ``C_OTHER`` (ops finished
  by another thread: a sweep, a DDP hook's future), which only :meth:`finish` writes, under a
  lock, so the two never lose each other's updates.

The compiled hot path (``_hotpath.c``) holds the GIL through each of these steps as well, so the
same holds for the records it writes.

Two doors in: :meth:`FlightRecorder.start` / :meth:`~FlightRecorder.finish` for any caller, and
the hot path's :meth:`~FlightRecorder.open_fast` / :meth:`~FlightRecorder.close_ok`, which
``safe_all_reduce`` takes through :func:`doors` (compiled where built); ``instrument()``'s wrappers,
compiled or generated, write the same list inline. Nothing outside ``recording/`` touches a
record's slots.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ncclguard import _torch_compat as compat
from ncclguard.config import get_config
from ncclguard.recording import sites
from ncclguard.recording.phase import MAIN as _MAIN_PHASES
from ncclguard.recording.phase import current_phase
from ncclguard.recording.record import (
    END,
    ERROR,
    GROUP,
    PEER,
    PREV,
    PROGRESS,
    SEQ,
    START,
    THREAD,
    WORK,
    FlightRecord,
    OpKind,
    Raw,
    new_raw,
    seq_key,
)
from ncclguard.recording.sites import user_files, user_frame
from ncclguard.world import WorldChange, subscribe

__all__ = [
    "FlightRecord",
    "FlightRecorder",
    "doors",
    "recorder",
    "seq_key",
]

_get_ident = threading.get_ident
_time = time.time
_getframe = sys._getframe

# The compiled hot path (recording/_hotpath.c, built by setup.py where a C compiler is): the
# recording wrapper instrument() installs and the doors safe_all_reduce opens records through.
# None: the Python code here and in instrument.py does it all, the same way.
hotpath: ModuleType | None
try:
    hotpath = importlib.import_module("ncclguard.recording._hotpath")
except ImportError:  # pragma: no cover - depends on the install
    hotpath = None


# A counter (a group's collectives, or its send/recv) is a list of three ints, so that the
# generated wrappers and the compiled one (_hotpath.c) update it by index: the last number issued,
# the highest completed by the issuing thread, and the highest completed by any other (finish(),
# under its lock). Completed is the larger of the two.
C_SEQ, C_DONE, C_OTHER = 0, 1, 2
Count = list[int]


def _completed(c: Count) -> int:
    return c[C_DONE] if c[C_DONE] >= c[C_OTHER] else c[C_OTHER]


class _Reading:
    """What the readers of a recorder ask (the watchdog's thread, reports): its records and counters.
    Each answer is built from copies taken in one step each (see the module doc)."""

    ring: deque[Raw]
    counts: dict[str, Count]
    p2p_counts: dict[str, Count]
    opened: dict[int, Raw]
    pending: dict[int, Raw]

    def inflight(self) -> list[FlightRecord]:
        """Records started and not finished, oldest first."""
        found: dict[int, Raw] = dict(self.pending)
        for top in list(self.opened.values()):
            node: Raw | None = top
            while node is not None:
                found[id(node)] = node
                node = node[PREV]
        opened = [r for r in found.values() if r[END] is None]
        return [FlightRecord.of(r) for r in sorted(opened, key=lambda r: r[START])]

    def last_seq(self) -> dict[str, int]:
        """The last sequence number issued, per group (``"<group>:p2p"`` for send/recv)."""
        out = {g: c[C_SEQ] for g, c in list(self.counts.items()) if c[C_SEQ]}
        out.update({seq_key(g, True): c[C_SEQ] for g, c in list(self.p2p_counts.items()) if c[C_SEQ]})
        return out

    def last_completed(self) -> dict[str, int]:
        """The highest sequence number completed, per group."""
        out = {g: _completed(c) for g, c in list(self.counts.items()) if _completed(c)}
        out.update({seq_key(g, True): _completed(c) for g, c in list(self.p2p_counts.items()) if _completed(c)})
        return out

    def raw(self, last: int | None = None) -> list[Raw]:
        """A copy of the ring's raw records (or its newest ``last``), oldest first."""
        recs = list(self.ring)  # one C call under the GIL: whole records, none half-appended
        return recs[-last:] if last else recs

    def records(self, last: int | None = None) -> list[FlightRecord]:
        """The records kept (or the newest ``last``), oldest first, as views read live."""
        return [FlightRecord.of(r) for r in self.raw(last)]


class FlightRecorder(_Reading):
    """A bounded ring of flight records with a sequence counter per group.

    Args:
        size: records kept (the oldest are dropped); default ``Config.flight_records`` (2000).
    """

    def __init__(self, size: int | None = None) -> None:
        kept = self._check_size(size if size is not None else get_config().flight_records)
        # The ring: instrument()'s wrappers append to ``recorder.ring`` (read on every call, so that
        # resize(), which replaces it, takes effect at once).
        self.ring: deque[Raw] = deque(maxlen=kept)
        # Counters by group name, collectives and send/recv apart. Wrappers bind these dicts:
        # they are cleared in place, never replaced.
        self.counts: dict[str, Count] = {}
        self.p2p_counts: dict[str, Count] = {}
        # Per thread ident: its innermost open record (records opened by start() inside it are
        # chained through their PREV slot). While a thread has one, instrument()'s wrappers do not
        # record again (safe_all_reduce's chunks). A dict keyed by ident: cheaper than threading.local.
        self.opened: dict[int, Raw] = {}
        # Records of ops going on without their thread (async ops with their Work, hand-offs): id -> record.
        self.pending: dict[int, Raw] = {}
        self._finish_lock = threading.Lock()  # finish() only: never taken on the hot path

    @staticmethod
    def _check_size(size: Any) -> int:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"the flight recorder's size must be a positive int (records kept), got {size!r}")
        return size

    @property
    def size(self) -> int:
        """Records kept."""
        return self.ring.maxlen or 0

    def resize(self, size: int) -> None:
        """Keeps the newest ``size`` records from now on.

        Raises:
            ValueError: ``size`` is not a positive int.
        """
        self.ring = deque(self.ring, maxlen=self._check_size(size))

    def busy(self) -> bool:
        """True while the calling thread is inside a recorded collective (nested calls are not recorded)."""
        return _get_ident() in self.opened

    def count(self, group: str, p2p: bool = False) -> Count:
        """The counter of ``group`` (its send/recv's with ``p2p``), made on first use."""
        counts = self.p2p_counts if p2p else self.counts
        c = counts.get(group)
        if c is None:
            c = counts.setdefault(group, [0, 0, 0])
        return c

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
        c = self.count(group, peer is not None)
        c[C_SEQ] = seq = c[C_SEQ] + 1
        phase = _MAIN_PHASES.path if tid == _MAIN_PHASES.ident else current_phase()
        where: Any = site
        lasti = -1
        if site is None:
            # The user's frame, found now (the stack is gone later); its line is looked up when
            # the site is read (FlightRecord.site): f_lineno costs more than the whole walk.
            frame = user_frame(_getframe(1))
            if frame is not None:
                where, lasti = frame.f_code, frame.f_lasti
        r = new_raw(seq, op, group, numel, dtype, _time(), phase, where, lasti, tid, async_op, peer)
        self.ring.append(r)
        r[PREV] = self.opened.get(tid)  # start() may open inside another open record (a stack)
        self.opened[tid] = r
        return FlightRecord.of(r)

    def open_fast(
        self,
        op: str | OpKind,
        group: str,
        numel: int,
        dtype: Any,
        async_op: bool = False,
        peer: int | None = None,
    ) -> Raw | None:
        """Opens a record for a collective the calling thread is about to issue (the hot path).

        :meth:`start` for code that runs on every collective (``safe_all_reduce``): the call site
        always looked for (from the caller's caller up), no record for a nested op, and the raw
        record returned (no view made).

        Args:
            op: the operation's name (or kind).
            group: the process group's name.
            numel: elements moved (input side).
            dtype: the tensor's dtype (a ``torch.dtype`` or its name).
            async_op: the caller does not block in the op.
            peer: the other rank of a point-to-point op (numbers it in ``"<group>:p2p"``).

        Returns:
            The raw record, to close with :meth:`close_ok`, :meth:`finish` or :meth:`attach`; None
            while the calling thread is inside a recorded call already: the op is part of that
            call (safe_all_reduce's chunks) and is not counted again.
        """
        tid = _get_ident()
        opened = self.opened
        if tid in opened:
            return None
        c = (self.p2p_counts if peer is not None else self.counts).get(group) or self.count(group, peer is not None)
        c[C_SEQ] = seq = c[C_SEQ] + 1
        frame = user_frame(_getframe(2))  # the caller's caller: the caller is a library frame
        phase = _MAIN_PHASES.path if tid == _MAIN_PHASES.ident else current_phase()
        if frame is None:
            code, lasti = None, -1
        else:
            code, lasti = frame.f_code, frame.f_lasti
        # The layout of record.new_raw, inline (one call less on every collective).
        r = [
            seq,
            op,
            None,
            group,
            numel,
            dtype,
            _time(),
            None,
            phase,
            code,
            lasti,
            tid,
            async_op,
            peer,
            None,
            None,
            None,
            None,
        ]
        self.ring.append(r)
        opened[tid] = r
        return r

    def close_ok(self, rec: Raw | None) -> None:
        """Closes ``rec`` (from :meth:`open_fast`) as completed: :meth:`finish` without an error,
        its usual case (the innermost open record of its thread) in a few steps. None (a nested
        op's): nothing."""
        if rec is None:
            return
        opened = self.opened
        tid = rec[THREAD]
        if opened.get(tid) is rec and rec[PREV] is None and rec[END] is None:
            del opened[tid]
            rec[END] = _time()
            c = (self.p2p_counts if rec[PEER] is not None else self.counts).get(rec[GROUP])
            if c is not None and rec[SEQ] > c[C_DONE]:
                c[C_DONE] = rec[SEQ]
            return
        self.finish(rec)

    def _unopen(self, r: Raw) -> None:
        """Takes ``r`` off its thread's open records (wherever it is in the chain)."""
        tid = r[THREAD]
        top = self.opened.get(tid)
        if top is r:
            if r[PREV] is None:
                self.opened.pop(tid, None)
            else:
                self.opened[tid] = r[PREV]
        else:
            node = top
            while node is not None and node[PREV] is not r:
                node = node[PREV]
            if node is not None:
                node[PREV] = r[PREV]
        r[PREV] = None

    def finish(self, rec: FlightRecord | Raw, error: BaseException | str | None = None) -> None:
        """Closes ``rec`` as completed, or as failed with ``error``.

        Args:
            rec: the record (from :meth:`start`, or raw from :meth:`open_fast`).
            error: why it failed; None: it completed.
        """
        r = rec._r if isinstance(rec, FlightRecord) else rec
        self._unopen(r)
        if r[END] is not None:
            return
        self.pending.pop(id(r), None)  # an async op's, or one handed off
        r[WORK] = None
        if error is not None:
            r[ERROR] = (str(error) or type(error).__name__)[:500]
            r[END] = _time()  # after ERROR: a reader that sees END reads the final ERROR
            return
        r[END] = _time()
        c = (self.p2p_counts if r[PEER] is not None else self.counts).get(r[GROUP])
        if c is not None:
            with self._finish_lock:  # another thread's finish may race this one (see the module doc)
                if r[SEQ] > c[C_OTHER]:  # async ops may complete out of order
                    c[C_OTHER] = r[SEQ]

    @staticmethod
    def progress(rec: FlightRecord | Raw, chunks_done: int, chunks: int, bytes_done: int) -> None:
        """Notes that ``chunks_done`` of the ``chunks`` chunks of ``rec`` completed, ``bytes_done``
        bytes in all: one store of one tuple, so a reader sees the three of one moment."""
        r = rec._r if isinstance(rec, FlightRecord) else rec
        r[PROGRESS] = (chunks_done, chunks, bytes_done)

    def progress_here(self, chunks_done: int, chunks: int, bytes_done: int) -> None:
        """:meth:`progress` of the record the calling thread has open (the chunked call it is
        in); nothing when it has none. For the chunk loop, which does not hold the record."""
        r = self.opened.get(_get_ident())
        if r is not None:
            r[PROGRESS] = (chunks_done, chunks, bytes_done)

    def attach(self, rec: FlightRecord | Raw, work: Any) -> None:
        """Hands an async op's ``Work`` to ``rec``: it stays in flight until the work completes
        (noticed by :meth:`sweep`), and the calling thread is free again."""
        r = rec._r if isinstance(rec, FlightRecord) else rec
        if work is None:  # a rank outside the group gets no Work; nothing is in flight
            self.finish(r)
            return
        r[WORK] = work
        self.pending[id(r)] = r  # before it leaves the open records: inflight() always finds it
        self._unopen(r)

    def hand_off(self, rec: FlightRecord | Raw) -> None:
        """The op of ``rec`` goes on without the calling thread (a future will finish it): it
        leaves the thread's open records, so later ops of the thread are recorded, and stays in
        flight until :meth:`finish`."""
        r = rec._r if isinstance(rec, FlightRecord) else rec
        self.pending[id(r)] = r
        self._unopen(r)

    def sweep(self) -> None:
        """Finishes the async records whose Work has completed (the watchdog calls this)."""
        for r in list(self.pending.values()):
            work = r[WORK]
            if work is None:
                continue
            try:
                if not work.is_completed():
                    continue
                exc = compat.work_error(work)
            except Exception as err:  # noqa: BLE001 - a broken Work is a failed op
                exc = err
            self.finish(r, exc)

    def clear(self) -> None:
        """Forgets every record and counter (a fresh process group starts counting again)."""
        self.ring.clear()
        self.counts.clear()
        self.p2p_counts.clear()
        self.pending.clear()
        self.opened.clear()

    def follow_world(self, change: WorldChange) -> None:
        """Starts the new world's numbering: forgets the old world's records and counters (its
        groups are gone, and every rank of the new world counts from 1 again).

        Args:
            change: the world change :func:`ncclguard.world.announce` reports.
        """
        if change.new is not change.old:
            self.clear()


def doors(
    rec: FlightRecorder, compiled: bool | None = None
) -> tuple[Callable[..., Raw | None], Callable[[Raw | None], Any]]:
    """``(open, close)``: ``rec``'s :meth:`~FlightRecorder.open_fast` and :meth:`~FlightRecorder.close_ok`,
    for code that records its own call (``safe_all_reduce``), compiled where the hot path was built
    (the same steps in C), else those methods. ``open(op, group, numel, dtype)``; ``close(record)``.

    Args:
        rec: the recorder.
        compiled: the compiled doors (True), the methods (False), or the compiled ones where built.

    Raises:
        RuntimeError: ``compiled=True`` where the hot path was not built.
    """
    if compiled is None:
        compiled = hotpath is not None
    if not compiled:
        return rec.open_fast, rec.close_ok
    if hotpath is None:
        raise RuntimeError("the compiled hot path is not built here")
    namespace = {
        "recorder": rec,
        "opened": rec.opened,
        "counts": rec.counts,
        "count": rec.count,
        "user_files": user_files,
        "is_framework": sites._is_framework,
        "user_frame": user_frame,
        "main": _MAIN_PHASES,
        "current_phase": current_phase,
        "finish": rec.finish,
    }
    opener = hotpath.Opener(namespace)
    return opener.open, opener.close


recorder = FlightRecorder()
# The process's recorder follows the world; a recorder made elsewhere (a test's) does not.
subscribe(recorder.follow_world)
