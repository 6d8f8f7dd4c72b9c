"""The flight recorder: a per-process ring buffer of the collectives this rank issued.

Each record holds a sequence number per group, the op, size, dtype, group, times, state, the
phase and the user's call site. ``safe_*`` calls are always recorded; ``ncclguard.instrument()``
records the plain ``torch.distributed`` calls too. Recording is a few attribute writes and a
short frame walk (benchmarks/recording_cost.py measures it), cheap enough for every call.

Sequence numbers count per group and per process, so the n-th collective of one rank meets the
n-th of the others: a rank whose number is lower than its peers' is somewhere else. Point-to-point
ops (send/recv) count separately (``"<group>:p2p"``), because their counts differ between ranks
by design.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ncclguard import _torch_compat as compat
from ncclguard.config import get_config
from ncclguard.diagnosis.phase import MAIN as _MAIN_PHASES
from ncclguard.diagnosis.phase import current_phase

__all__ = ["FlightRecord", "FlightRecorder", "recorder", "call_site", "frame_site", "format_stack", "seq_key"]

# Frames from these packages are skipped when looking for the user's call site. Prefixes are
# the packages' real directories, so a checkout that happens to be named "ncclguard" still counts.
_FRAMEWORKS = ("torch", "deepspeed", "transformers", "accelerate")
_get_ident = threading.get_ident
_time = time.time
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# ncclguard's own applications (the demo, the benchmark ranks) are user code, not library frames.
_APP_DIRS = tuple(os.path.join(_PACKAGE_DIR, d, "") for d in ("cli", "bench"))
_THREADING = threading.__file__


def _inductor_cache_dir() -> str:
    """Where torch.compile's inductor writes the code it generates (its frames are torch's, not
    the user's): ``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>`` as inductor's
    ``default_cache_dir`` builds it."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


_INDUCTOR_CACHE = _inductor_cache_dir()
_skip_prefixes_cache: tuple[int, tuple[str, ...]] = (-1, ())
# co_filename -> "is this a framework file?"; filenames are few, so the cache stays small.
_is_framework: dict[str, bool] = {}


def _skip_prefixes() -> tuple[str, ...]:
    global _skip_prefixes_cache
    # Frameworks imported later (deepspeed after ncclguard) change the answer; len(sys.modules)
    # is a cheap "did anything get imported" check.
    if _skip_prefixes_cache[0] != len(sys.modules):
        dirs = [
            _PACKAGE_DIR,
            os.path.realpath(os.path.join(_PACKAGE_DIR, "integrations")),
            contextlib.__file__,
            _THREADING,
            _INDUCTOR_CACHE,
        ]
        for name in _FRAMEWORKS:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None) if module is not None else None
            if path:
                dirs.append(os.path.dirname(path))
        # typing_extensions' @deprecated wrapper stands between torch's deprecated collectives
        # (all_gather_into_tensor, which DeepSpeed calls) and their caller: a file, not a package.
        wrapper = getattr(sys.modules.get("typing_extensions"), "__file__", None)
        if wrapper:
            dirs.append(wrapper)
        prefixes = tuple(d if d.endswith(".py") else os.path.join(d, "") for d in dirs)
        if prefixes != _skip_prefixes_cache[1]:
            _is_framework.clear()
        _skip_prefixes_cache = (len(sys.modules), prefixes)
    return _skip_prefixes_cache[1]


def frame_site(frame: FrameType | None) -> str:
    """``file:line`` of ``frame`` or the first frame above it outside torch, deepspeed,
    transformers, accelerate and ncclguard; ``"?"`` when there is none."""
    cache = _skip_prefixes_cache
    prefixes = cache[1] if cache[0] == len(sys.modules) else _skip_prefixes()
    known = _is_framework
    while frame is not None:
        path = frame.f_code.co_filename
        skip = known.get(path)
        if skip is None:
            skip = known[path] = (path.startswith(prefixes) and not path.startswith(_APP_DIRS)) or path.startswith("<")
        if not skip:
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def call_site(skip: int = 2) -> str:
    """``file:line`` of the caller's first frame outside the frameworks and ncclguard.

    Args:
        skip: frames to skip from here (1: the caller of ``call_site``).
    """
    return frame_site(sys._getframe(skip))


def format_stack(frame: FrameType | None, limit: int = 40) -> list[str]:
    """The stack of ``frame``, outermost first, as ``"file:line in func: code"`` lines (the
    innermost ``limit``)."""
    if frame is None:
        return []
    summary = traceback.extract_stack(frame, limit=limit)
    return [f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "") for f in summary]


@dataclass(slots=True)
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
        site: the user's ``file:line`` that issued it.
        error: the failure, as text.
        async_op: issued with ``async_op=True`` (or isend/irecv): the caller did not block in it.
        peer: the other rank of a send/recv.
        thread: ``threading.get_ident()`` of the issuing thread.
        chunks_done: chunks of a chunked call completed so far (0: not chunked, or none yet).
        chunks: chunks of the call (0 until the first chunk completes; see :meth:`FlightRecorder.progress`).
        bytes_done: bytes of the call reduced so far.
    """

    seq: int
    op: str
    group: str
    numel: int
    dtype: str
    start: float
    state: str = "started"
    end: float | None = None
    phase: str = ""
    site: str = ""
    error: str | None = None
    async_op: bool = False
    peer: int | None = None
    thread: int = 0
    work: Any = field(default=None, repr=False, compare=False)  # the async op's Work; never serialised
    chunks_done: int = 0
    chunks: int = 0
    bytes_done: int = 0

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
        rec = FlightRecord(
            seq,
            op,
            group,
            numel,
            dtype,
            _time(),
            "started",
            None,
            _MAIN_PHASES.path if tid == _MAIN_PHASES.ident else current_phase(),
            site if site is not None else frame_site(sys._getframe(2)),
            None,
            async_op,
            peer,
            tid,
        )
        self._records.append(rec)
        opened = self._open.get(tid)
        if opened is None:
            opened = self._open[tid] = []
        opened.append(rec)
        return rec

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
        if rec.work is not None:
            rec.work = None
            self._async.pop(id(rec), None)
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


recorder = FlightRecorder()
