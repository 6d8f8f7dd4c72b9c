"""Progress evidence: is a rank that others wait for stuck, or slow but moving?

A rank is *stuck* only when nothing of it moves for ``still_s`` seconds. What counts as movement,
each a kind of evidence:

- ``ops``: its backend sequence numbers (every collective its backend ran, whoever issued it);
- ``stack``: its main thread at a call site not seen before in the window (a loop cycling through
  the same lines is not movement by this evidence; its CPU time says it is busy);
- ``cpu``: its main thread's CPU time grew by more than :data:`CPU_SHARE` of the time passed;
- ``io``: its storage reads and writes grew by more than :data:`IO_BYTES` (a save);
- ``stopped``: the operating system says the process is stopped (SIGSTOP): evidence of being stuck.

Evidence comes from the rank's own heartbeat while its watchdog thread runs, and from outside
(:func:`sample_process`: ``/proc`` through psutil) for a process on this host whose heartbeat
stopped (a SIGSTOPped process, or one whose main thread holds the GIL in C code). A rank with no
evidence in the window is ``unknown``, never stuck. :class:`Progress` is pure: every method takes
``now``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from ncclguard.world import Slot

__all__ = ["CPU_SHARE", "IO_BYTES", "JUDGED", "Judgment", "Progress", "Sample", "own_sample", "sample_process"]

CPU_SHARE = 0.05  # a main thread using more than 5% of a core is busy (a sleep loop uses ~0.02%)
IO_BYTES = 1 << 20  # more than 1 MiB read or written counts (a rank's own incident dump is less)

State = Literal["moving", "stuck", "unknown"]

# The verdict's last judgment of each rank this one waits for ("2": "stuck: nothing moved ..."), in
# this world's numbering: the recovery engine writes it, the heartbeat carries it (status shows it).
JUDGED: Slot[dict[str, str]] = Slot("judged", lambda world: {})
MAX_JUDGED_CHARS = 160


@dataclass(frozen=True)
class Sample:
    """One look at a rank.

    Attributes:
        at: ``time.monotonic()`` of the look.
        source: ``"heartbeat"`` (the rank said it) or ``"process"`` (read from ``/proc`` here).
        ops: the sum of its backend sequence numbers, where known.
        site: its main thread's call site, where known.
        cpu_s: its main thread's CPU seconds, where known.
        io_bytes: its storage bytes read and written, where known.
        stopped: the process is stopped (SIGSTOP) or a zombie.
    """

    at: float
    source: str
    ops: int | None = None
    site: str | None = None
    cpu_s: float | None = None
    io_bytes: int | None = None
    stopped: bool = False


@dataclass(frozen=True)
class Judgment:
    """What :meth:`Progress.judge` decided, and on what evidence."""

    state: State
    still_s: float  # how long nothing has moved (0 when something just did)
    evidence: str  # which evidence decided, in words


@dataclass
class Progress:
    """The samples of one rank, and the judgment (see the module doc).

    Each kind of evidence is compared with the last sample that carried it: a rank sampled from
    its heartbeat and from ``/proc`` in turn has ops in one and not the other.

    Args:
        still_s: how long nothing may move before the rank is stuck.
    """

    still_s: float
    last_at: float | None = None
    since: float | None = None  # first sample
    moved_at: float | None = None
    moved_by: str = ""
    stopped: bool = False
    kinds: set[str] = field(default_factory=set)  # the kinds of evidence seen
    ops: int | None = None
    cpu: tuple[float, float] | None = None  # (at, seconds)
    io: int | None = None
    sites: set[str] = field(default_factory=set)  # every site seen: a loop's lines move it once

    def observe(self, s: Sample) -> None:
        """Takes in one sample (from either source, in time order)."""
        if self.since is None:
            self.since = s.at
        self.last_at, self.stopped = s.at, s.stopped
        moved = []
        if s.ops is not None:
            if self.ops is not None and s.ops != self.ops:
                moved.append(f"ops {self.ops}->{s.ops}")
            self.ops = s.ops
            self.kinds.add("ops")
        if s.cpu_s is not None:
            if self.cpu is not None and s.cpu_s - self.cpu[1] > CPU_SHARE * max(s.at - self.cpu[0], 0.5):
                moved.append(f"main-thread cpu +{s.cpu_s - self.cpu[1]:.2f} s in {s.at - self.cpu[0]:.1f} s")
            self.cpu = (s.at, s.cpu_s)
            self.kinds.add("cpu")
        if s.io_bytes is not None:
            if self.io is not None and s.io_bytes - self.io > IO_BYTES:
                moved.append(f"io +{(s.io_bytes - self.io) >> 20} MiB")
            if self.io is None or s.io_bytes - self.io > IO_BYTES:
                self.io = s.io_bytes  # small writes add up until they count
            self.kinds.add("io")
        if s.site and s.site != "?":
            if self.sites and s.site not in self.sites:
                moved.append(f"stack at {s.site}")
            self.sites.add(s.site)
            self.kinds.add("stack")
        if s.stopped:
            self.kinds.add("stopped")
        elif moved:
            self.moved_at, self.moved_by = s.at, "; ".join(moved)

    def judge(self, now: float) -> Judgment:
        """The rank's state now.

        Returns:
            ``moving`` (something moved within ``still_s``: what), ``stuck`` (nothing moved for
            ``still_s`` with CPU or op evidence, or the process is stopped), or ``unknown``.
        """
        if self.last_at is None or self.since is None:
            return Judgment("unknown", 0.0, "no sample of this rank")
        still = round(now - (self.moved_at if self.moved_at is not None else self.since), 3)
        if self.moved_at is not None and still < self.still_s:
            return Judgment("moving", still, f"moved {still:.1f} s ago: {self.moved_by}")
        if still < self.still_s or now - self.last_at > self.still_s:
            return Judgment("unknown", still, f"samples do not cover {self.still_s:g} s yet")
        if self.stopped:
            return Judgment("stuck", still, f"the process is stopped (SIGSTOP) or gone for {still:.1f} s")
        if not {"cpu", "ops"} & self.kinds:
            return Judgment("unknown", still, "no CPU or op evidence of this rank")
        return Judgment("stuck", still, f"nothing moved for {still:.1f} s ({', '.join(sorted(self.kinds))})")


def _main_cpu(proc: object, pid: int) -> float | None:
    for t in proc.threads():  # type: ignore[attr-defined]
        if t.id == pid:  # Linux: the main thread's id is the process id
            return float(t.user_time + t.system_time)
    return None


def sample_process(pid: int, now: float | None = None) -> Sample | None:
    """Reads a process of this host from ``/proc``: stopped or not, its main thread's CPU time, its I/O.

    Returns:
        The sample, or None when there is no such process (or it cannot be read).
    """
    import psutil

    try:
        proc = psutil.Process(pid)
        status = proc.status()
        stopped = status in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, "tracing-stop")
        io = proc.io_counters() if hasattr(proc, "io_counters") else None
        return Sample(
            at=time.monotonic() if now is None else now,
            source="process",
            cpu_s=_main_cpu(proc, pid),
            io_bytes=(io.read_bytes + io.write_bytes) if io is not None else None,
            stopped=stopped,
        )
    except psutil.NoSuchProcess:  # gone: it will not come to the op either
        return Sample(at=time.monotonic() if now is None else now, source="process", stopped=True)
    except (psutil.Error, OSError):
        return None


def own_sample() -> tuple[float | None, int | None]:
    """This process's main-thread CPU seconds and storage bytes (for its heartbeat)."""
    cpu: float | None = None
    try:
        ident = threading.main_thread().ident
        if ident is not None:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError, OverflowError):
        cpu = None
    io: int | None = None
    try:
        with open(f"/proc/{os.getpid()}/io", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        io = int(fields[b"read_bytes"]) + int(fields[b"write_bytes"])
    except (OSError, KeyError, ValueError):
        io = None
    return cpu, io
