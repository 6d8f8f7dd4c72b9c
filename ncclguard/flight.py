"""The flight recorder: a per-process ring buffer of the collectives this rank issued.

Each record holds a sequence number per group, the op, size, dtype, group, times, state, the
phase and the user's call site. ``safe_*`` calls are always recorded; ``ncclguard.instrument()``
records the plain ``torch.distributed`` calls too. Recording is a few attribute writes and a
frame walk, cheap enough for every call.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from ncclguard.config import get_config
from ncclguard.phase import current_phase

__all__ = ["FlightRecord", "FlightRecorder", "recorder", "call_site"]

# Frames from these packages are skipped when looking for the user's call site. Prefixes are
# the packages' real directories, so a checkout that happens to be named "ncclguard" still counts.
_FRAMEWORKS = ("torch", "deepspeed", "transformers", "accelerate")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_skip_cache: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


def _skip_prefixes() -> tuple[str, ...]:
    global _skip_cache
    loaded = tuple(name for name in _FRAMEWORKS if name in sys.modules)
    if loaded != _skip_cache[0]:
        dirs = [_PACKAGE_DIR, os.path.realpath(os.path.join(_PACKAGE_DIR, "integrations")), contextlib.__file__]
        for name in loaded:
            path = getattr(sys.modules[name], "__file__", None)
            if path:
                dirs.append(os.path.dirname(path))
        _skip_cache = (loaded, tuple(os.path.join(d, "") if not d.endswith(".py") else d for d in dirs))
    return _skip_cache[1]


def call_site(skip: int = 2) -> str:
    """``file:line`` of the first frame outside torch, deepspeed, transformers and ncclguard."""
    prefixes = _skip_prefixes()
    frame = sys._getframe(skip)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(prefixes) and not path.startswith("<"):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclass
class FlightRecord:
    """One collective as this rank saw it. ``state`` is ``started``, ``completed`` or ``failed``."""

    seq: int
    op: str
    group: str
    numel: int
    dtype: str
    start: float  # time.time()
    state: str = "started"
    end: float | None = None
    phase: str = ""
    site: str = ""
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FlightRecorder:
    """A bounded, thread-safe ring of :class:`FlightRecord` with a sequence counter per group."""

    def __init__(self, size: int | None = None) -> None:
        self._lock = threading.Lock()
        self._records: deque[FlightRecord] = deque(maxlen=size or get_config().flight_records)
        self._seq: dict[str, int] = {}
        self._inflight: dict[int, FlightRecord] = {}  # id(record) -> record

    def start(self, op: str, group: str, numel: int, dtype: str, *, site: str | None = None) -> FlightRecord:
        """Opens a record for a collective that is about to be issued."""
        rec = FlightRecord(
            seq=0, op=op, group=group, numel=numel, dtype=dtype, start=time.time(),
            phase=current_phase(), site=site if site is not None else call_site(3),
        )
        with self._lock:
            rec.seq = self._seq.get(group, 0) + 1
            self._seq[group] = rec.seq
            self._records.append(rec)
            self._inflight[id(rec)] = rec
        return rec

    def finish(self, rec: FlightRecord, error: BaseException | str | None = None) -> None:
        """Closes ``rec`` as completed, or as failed with ``error``."""
        rec.end = time.time()
        rec.state = "completed" if error is None else "failed"
        rec.error = None if error is None else str(error)[:500]
        with self._lock:
            self._inflight.pop(id(rec), None)

    def inflight(self) -> list[FlightRecord]:
        """Records started and not finished, oldest first."""
        with self._lock:
            return sorted(self._inflight.values(), key=lambda r: r.start)

    def last_seq(self) -> dict[str, int]:
        """The last sequence number issued, per group."""
        with self._lock:
            return dict(self._seq)

    def records(self) -> list[FlightRecord]:
        """A copy of the ring, oldest first."""
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._seq.clear()
            self._inflight.clear()


recorder = FlightRecorder()
