"""Progress evidence: is a rank that others wait for stuck, or slow but moving?

A rank is *stuck* only when nothing of it moves for ``still_s`` seconds. What counts as movement,
each a kind of evidence, named so in a judgment's evidence:

- ``ops``: its backend sequence numbers (every collective its backend ran, whoever issued it);
- ``stack``: its main thread at a call site not seen before in the window (a loop cycling through
  the same lines is not movement by this evidence; its CPU time says it is busy);
- ``cpu``: its main thread's CPU time grew by more than :data:`CPU_SHARE` of the time passed;
- ``threads``: its other threads' CPU time grew by more than :data:`THREADS_SHARE` of the time
  passed, :data:`STREAK` looks in a row (a watchdog thread's bursts do not; an upload thread at work does);
- ``children``: its process tree (DataLoader workers, an upload's subprocess; at most
  :data:`MAX_CHILDREN`) used more than :data:`CPU_SHARE` of a core, :data:`STREAK` looks in a row;
- ``net``: its TCP sockets (and its children's, at most :data:`MAX_FDS` descriptors read) moved more
  than :data:`NET_RATE` bytes a second: bytes acknowledged and received per socket (the kernel's
  ``tcp_info``, read over netlink ``sock_diag``), or, where that cannot be read (another network
  namespace), a change of a socket's send or receive queue in ``/proc/<pid>/net/tcp`` and ``tcp6``;
- ``io``: its storage reads and writes grew by more than :data:`IO_BYTES` (a save), or its
  ``read()``/``write()`` calls (``rchar``/``wchar``, which count pipes and sockets written with
  ``write``) moved more than :data:`CHAR_RATE` bytes a second;
- ``blocked-io``: a thread of it asleep in file I/O (:mod:`ncclguard.watching.sensors.io_wait`: a
  save's ``close()`` or ``fsync()`` on network storage, which moves nothing else for minutes): the
  rank is busy while that one wait lasts under ``io_s`` (:data:`IO_WAIT_S`, or
  :data:`IO_WAIT_VAR` in the environment; 0 turns it off), and the wait's end is movement; past
  ``io_s`` it counts no more, and ``still_s`` later the rank is stuck, the wait named;
- ``stopped``: the operating system says the process is stopped (SIGSTOP): evidence of being stuck.

Evidence comes from the rank's own heartbeat while its watchdog thread runs (ops, stack, main-thread
CPU, storage bytes), and from outside (:func:`sample_process`: ``/proc`` through psutil, and netlink)
for a process on this host: every kind above. A rank with no evidence in the window is ``unknown``,
never stuck. :class:`Progress` is pure: every method takes ``now``. Reading a process never raises:
a process gone is ``stopped``, a piece that cannot be read (permissions, a race) is no evidence.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from ncclguard.watching.sensors.proc_reading import (
    MAX_CHILDREN,
    MAX_FDS,
    BlockedIO,
    Pairs,
    Sample,
    beat_evidence,
    beat_sample,
    own_sample,
    parse_proc_net_tcp,
    parse_sock_diag,
    sample_process,
    socket_inode,
)
from ncclguard.world import Slot

__all__ = [
    "CHAR_RATE",
    "CPU_SHARE",
    "IO_BYTES",
    "IO_WAIT_S",
    "IO_WAIT_VAR",
    "JUDGED",
    "JUDGED_ABOUT",
    "MAX_CHILDREN",
    "MAX_FDS",
    "NET_RATE",
    "STREAK",
    "THREADS_SHARE",
    "BlockedIO",
    "Judgment",
    "VotesAbout",
    "beat_evidence",
    "beat_sample",
    "io_wait_bound",
    "Progress",
    "Sample",
    "own_sample",
    "parse_proc_net_tcp",
    "parse_sock_diag",
    "sample_process",
    "socket_inode",
]

CPU_SHARE = 0.05  # a main thread using more than 5% of a core is busy (a sleep loop uses ~0.02%)
THREADS_SHARE = 0.10  # the other threads together: a watchdog's heartbeat thread stays well under
# Threads and children count only when they kept busy this many looks in a row: ncclguard's own
# threads work in bursts while the peers wait (statements, incidents: 0.25 s of CPU in 1 s, measured
# in a rank asleep for good), an upload's or a DataLoader's work goes on.
STREAK = 3
IO_BYTES = 1 << 20  # more than 1 MiB read or written counts (a rank's own incident dump is less)
NET_RATE = 64 << 10  # bytes a second on its sockets (a watchdog's store traffic is a few KiB a second)
CHAR_RATE = 256 << 10  # bytes a second through read()/write() (a watchdog reads a few KiB of /proc)
IO_WAIT_S = 1800.0  # one wait in file I/O counts as busy this long (a 100 GB save to slow storage: minutes)
IO_WAIT_VAR = "NCCLGUARD_IO_WAIT_S"
_log = logging.getLogger("ncclguard")
_SAID_VAR: set[str] = set()  # the wrong IO_WAIT_VAR values said (each once)
State = Literal["moving", "stuck", "unknown"]

# The verdict's last judgment of each rank this one waits for ("2": "stuck: nothing moved ..."), in
# this world's numbering: the recovery engine writes it, the heartbeat carries it (status shows it).
JUDGED: Slot[dict[str, str]] = Slot("judged", lambda world: {})
MAX_JUDGED_CHARS = 160


@dataclass
class VotesAbout:
    """The look the votes in :data:`JUDGED` are about: ``"<generation>/<step>"`` while a step is
    judged, None between steps. The heartbeat carries it beside them, so that a peer counts a vote
    only for the step it judges itself (a vote left from another step is no vote)."""

    key: str | None = None


JUDGED_ABOUT: Slot[VotesAbout] = Slot("judged_about", lambda world: VotesAbout())


@dataclass
class SnapshotsSay:
    """What the snapshot keeper says of its takes while they keep failing (None once one commits):
    the recovery engine writes it, the heartbeat carries it, ``ncclguard status`` shows it."""

    text: str | None = None


SNAPSHOTS_SAY: Slot[SnapshotsSay] = Slot("snapshots_say", lambda world: SnapshotsSay())
MAX_SNAPSHOTS_CHARS = 240


@dataclass(frozen=True)
class Judgment:
    """What :meth:`Progress.judge` decided, and on what evidence."""

    state: State
    still_s: float  # how long nothing has moved (0 when something just did)
    evidence: str  # which evidence decided, in words


def io_wait_bound() -> float:
    """How long one wait in file I/O counts as busy: :data:`IO_WAIT_VAR` in seconds (0: never), else
    :data:`IO_WAIT_S`; a value that is no number of seconds is said once and the default kept."""
    raw = os.environ.get(IO_WAIT_VAR, "").strip()
    if not raw:
        return IO_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if 0 <= value and math.isfinite(value):
        return value
    if raw not in _SAID_VAR:
        _SAID_VAR.add(raw)
        _log.warning("progress: %s=%r is no number of seconds; %g s kept", IO_WAIT_VAR, raw, IO_WAIT_S)
    return IO_WAIT_S


def _bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _grown(before: Pairs, after: Pairs) -> float:
    """What grew between two ``(id, value)`` sets, over the ids in both (a new child or socket is a
    baseline; one gone takes nothing away)."""
    old = dict(before)
    return sum(max(0.0, v - old[k]) for k, v in after if k in old)


@dataclass
class Progress:
    """The samples of one rank, and the judgment (see the module doc).

    Each kind of evidence is compared with the last sample that carried it: a rank sampled from
    its heartbeat and from ``/proc`` in turn has ops in one and not the other.

    Args:
        still_s: how long nothing may move before the rank is stuck.
        io_s: how long one wait of a thread in file I/O counts as busy (:func:`io_wait_bound`).
    """

    still_s: float
    io_s: float = field(default_factory=io_wait_bound)
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
    threads: tuple[float, float] | None = None  # (at, seconds)
    children: tuple[float, Pairs] | None = None  # (at, per pid)
    net: tuple[float, Pairs] | None = None  # (at, per socket)
    queues: Pairs | None = None
    chars: tuple[float, int] | None = None  # (at, bytes)
    streaks: dict[str, int] = field(default_factory=dict)  # threads, children: busy looks in a row
    blocked: BlockedIO | None = None  # the wait in file I/O seen at the last look that read threads
    blocked_since: float = 0.0  # the first look that saw that wait
    blocked_at: float = 0.0  # the last look that saw it

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
        if s.threads_cpu_s is not None:
            if self.threads is not None:
                grew, dt = s.threads_cpu_s - self.threads[1], s.at - self.threads[0]
                if self._streak("threads", grew > THREADS_SHARE * max(dt, 0.5)):
                    moved.append(f"threads cpu +{grew:.2f} s in {dt:.1f} s")
            self.threads = (s.at, s.threads_cpu_s)
            self.kinds.add("threads")
        if s.children_cpu is not None:
            if self.children is not None:
                grew, dt = _grown(self.children[1], s.children_cpu), s.at - self.children[0]
                if self._streak("children", grew > CPU_SHARE * max(dt, 0.5)):
                    moved.append(f"children cpu +{grew:.2f} s in {dt:.1f} s")
            self.children = (s.at, s.children_cpu)
            self.kinds.add("children")
        if s.net is not None:
            if self.net is not None:
                grew, dt = _grown(self.net[1], s.net), s.at - self.net[0]
                if grew > NET_RATE * max(dt, 0.5):
                    moved.append(f"net +{_bytes(grew)}")
            self.net = (s.at, s.net)
            self.kinds.add("net")
        if s.net_queues is not None:
            if self.queues is not None:
                old = dict(self.queues)
                changed = sum(1 for k, v in s.net_queues if k in old and v != old[k])
                if changed:
                    moved.append(f"net queues changed on {changed} socket(s)")
            self.queues = s.net_queues
            self.kinds.add("net")
        if s.io_bytes is not None:
            if self.io is not None and s.io_bytes - self.io > IO_BYTES:
                moved.append(f"io +{(s.io_bytes - self.io) >> 20} MiB")
            if self.io is None or s.io_bytes - self.io > IO_BYTES:
                self.io = s.io_bytes  # small writes add up until they count
            self.kinds.add("io")
        if s.chars is not None:
            if self.chars is not None:
                grew, dt = s.chars - self.chars[1], s.at - self.chars[0]
                if grew > CHAR_RATE * max(dt, 0.5):
                    moved.append(f"io read/write +{_bytes(grew)}")
            self.chars = (s.at, s.chars)
            self.kinds.add("io")
        if s.site and s.site != "?":
            if self.sites and s.site not in self.sites:
                moved.append(f"stack at {s.site}")
            self.sites.add(s.site)
            self.kinds.add("stack")
        self._io_wait(s, moved)
        if s.stopped:
            self.kinds.add("stopped")
        elif moved:
            self.moved_at, self.moved_by = s.at, "; ".join(moved)

    def _io_wait(self, s: Sample, moved: list[str]) -> None:
        """A thread asleep in file I/O: movement while one wait lasts under ``io_s``, and at its end."""
        if s.blocked_io is None:
            return
        self.kinds.add("blocked-io")
        now = s.blocked_io[0] if s.blocked_io else None
        was = self.blocked
        if was is not None and (now is None or now[:3] != was[:3]):  # another call, file or thread
            moved.append(f"{was.describe()} ended after {s.at - self.blocked_since:.1f} s")
            self.blocked = None
        if now is None:
            return
        if self.blocked is None:
            self.blocked_since = s.at
        self.blocked, self.blocked_at = now, s.at
        if s.at - self.blocked_since < self.io_s:
            moved.append(f"blocked in {now.describe()} for {s.at - self.blocked_since:.1f} s")

    def _streak(self, kind: str, busy: bool) -> bool:
        """Counts busy looks in a row of ``kind``; True from the :data:`STREAK`-th on."""
        self.streaks[kind] = self.streaks.get(kind, 0) + 1 if busy else 0
        return self.streaks[kind] >= STREAK

    def judge(self, now: float) -> Judgment:
        """The rank's state now.

        Returns:
            ``moving`` (something moved within ``still_s``, or a thread is asleep in file I/O for
            under ``io_s``: what), ``stuck`` (nothing moved for ``still_s`` with CPU or op evidence,
            or the process is stopped), or ``unknown``.
        """
        if self.last_at is None or self.since is None:
            return Judgment("unknown", 0.0, "no sample of this rank")
        still = round(now - (self.moved_at if self.moved_at is not None else self.since), 3)
        b, waited = self.blocked, now - self.blocked_since
        if b is not None and not self.stopped and now - self.blocked_at <= self.still_s and waited < self.io_s:
            why = f"blocked in {b.describe()} for {waited:.1f} s (file I/O: busy for up to {self.io_s:g} s)"
            return Judgment("moving", round(now - self.blocked_at, 3), why)
        if self.moved_at is not None and still < self.still_s:
            return Judgment("moving", still, f"moved {still:.1f} s ago: {self.moved_by}")
        if still < self.still_s or now - self.last_at > self.still_s:
            return Judgment("unknown", still, f"samples do not cover {self.still_s:g} s yet")
        if self.stopped:
            return Judgment("stuck", still, f"the process is stopped (SIGSTOP) or gone for {still:.1f} s")
        if not {"cpu", "ops"} & self.kinds:
            return Judgment("unknown", still, "no CPU or op evidence of this rank")
        order = ["cpu", "threads", "children", "net", "io", "blocked-io", "ops", "stack"]
        kinds = [k for k in order if k in self.kinds] + sorted(self.kinds - set(order) - {"stopped"})
        tail = ""
        if b is not None and now - self.blocked_at <= self.still_s:
            tail = f"; blocked in {b.describe()} for {waited:.1f} s, past the file I/O bound of {self.io_s:g} s"
        return Judgment("stuck", still, f"nothing moved for {still:.1f} s ({', '.join(kinds)}){tail}")
