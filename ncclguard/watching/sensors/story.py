"""What a rank did lately, kept for the pictures of an incident (:mod:`ncclguard.incidents.pictures`).

- :class:`MainThreadTrack`: where the main thread was, as spans. At each of its ticks the watchdog
  reads the main thread's phase and the user's frame above the frameworks (the frame the reports
  name); consecutive ticks in the same phase, or outside any phase in the same function, make one
  span. A script that sets no phase still shows its functions: ``evaluate()`` on the rank that is
  late, ``main()`` blocked in ``backward()`` on the ranks that wait.
- :func:`backend_entries`: the newest entries of torch's own flight recorder, read once when the
  rank dumps an incident: every op its backend ran, including those issued from C++ (DDP's bucket
  all_reduces, FSDP's all_gathers) that no Python wrapper sees.

Both go into the rank's dump (``rank<r>.json``: ``track``, ``backend``).
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import time
from collections import deque
from types import CodeType, FrameType

import torch.distributed as dist

from ncclguard import _torch_compat as compat
from ncclguard.errors import TorchCompatError
from ncclguard.incidents.model import BackendEntry, TrackSpan
from ncclguard.recording.phase import main_thread_phase
from ncclguard.recording.sites import user_frame
from ncclguard.watching.sensors import torchfr

__all__ = ["MAX_ENTRIES", "MAX_SPANS", "MainThreadTrack", "backend_entries", "script_frame"]

MAX_SPANS = 512  # spans a track keeps (the newest); at a tick of 0.5 s, at least 4 minutes
MAX_ENTRIES = 2000  # flight-recorder entries a dump keeps (torch keeps 2000 by default)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # an embedded interpreter's site module lacks them
        pass
    return tuple(sorted({os.path.join(d, "") for d in dirs if d}))


_LIBRARIES = _library_dirs()
_in_library: dict[str, bool] = {}  # co_filename -> installed or standard library code


def script_frame(frame: FrameType | None) -> FrameType | None:
    """The frame a span is named after: the innermost frame of the script's own code, above the
    frameworks (:func:`~ncclguard.recording.sites.user_frame`) and above any installed package or
    the standard library (a script's first optimizer imports sympy for seconds: the span is the
    script's line that made the optimizer, not sympy's module); the user frame where none is."""
    first = user_frame(frame)
    f = first
    while f is not None:
        name = f.f_code.co_filename
        lib = _in_library.get(name)
        if lib is None:
            lib = _in_library[name] = name.startswith(("<", *_LIBRARIES))
        if not lib:
            return f
        f = f.f_back
    return first


class _Open:
    """The span being extended: its key (phase, code object) and its fields."""

    __slots__ = ("key", "start", "end", "phase", "func", "site")

    def __init__(self, key: tuple[str, CodeType | None], now: float, phase: str, func: str, site: str) -> None:
        self.key, self.start, self.end = key, now, now
        self.phase, self.func, self.site = phase, func, site

    def span(self) -> TrackSpan:
        return TrackSpan(start=self.start, end=self.end, phase=self.phase, func=self.func, site=self.site)


class MainThreadTrack:
    """Where the main thread was, tick after tick, as spans (see the module doc).

    Args:
        main_ident: the main thread's ident.
        max_spans: spans kept, the newest.
    """

    def __init__(self, main_ident: int | None, max_spans: int = MAX_SPANS) -> None:
        self.main_ident = main_ident
        self._done: deque[TrackSpan] = deque(maxlen=max_spans)
        self._open: _Open | None = None

    def sample(self, now: float | None = None) -> None:
        """Reads where the main thread is now (one dictionary of frames and a short walk: a few
        microseconds) and extends or starts a span.

        Args:
            now: ``time.time()`` (default: now).
        """
        now = time.time() if now is None else now
        frame = script_frame(sys._current_frames().get(self.main_ident or -1))
        phase = main_thread_phase()
        code = frame.f_code if frame is not None else None
        key = (phase, None if phase else code)  # within a phase, functions do not split the span
        current = self._open
        if current is not None and current.key == key:
            current.end = now
            return
        if current is not None:
            self._done.append(current.span())
        func = code.co_name if code is not None else ""
        site = f"{code.co_filename}:{frame.f_lineno}" if frame is not None and code is not None else ""
        self._open = _Open(key, now, phase, func, site)

    def spans(self) -> list[TrackSpan]:
        """The spans kept, oldest first, the open one last (ending at its latest tick)."""
        out = list(self._done)
        if self._open is not None:
            out.append(self._open.span())
        return out


def backend_entries(limit: int = MAX_ENTRIES) -> list[BackendEntry]:
    """The newest ``limit`` entries of torch's flight recorder on this rank, oldest first; empty
    without a process group or where this torch cannot dump it.

    Args:
        limit: entries kept at most.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    for nccl in (False, True):  # the backend-neutral dump (gloo); NCCL's own where that one is empty
        if nccl and not dist.is_nccl_available():
            break
        try:
            dump = torchfr.parse_dump(compat.dump_flight_recorder(nccl=nccl))
        except (TorchCompatError, RuntimeError, ValueError):
            continue
        if dump.entries:
            return [
                BackendEntry(
                    group=e.group,
                    seq=e.p2p_seq if e.is_p2p else e.collective_seq,
                    p2p=e.is_p2p,
                    name=e.name,
                    numel=e.numel,
                    created=e.created,
                    open=torchfr.entry_open(e, dump.status),
                )
                for e in dump.entries[-limit:]
            ]
    return []
