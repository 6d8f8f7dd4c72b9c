"""Reading a process for progress evidence (:mod:`ncclguard.watching.sensors.progress` judges it):
one :class:`Sample` of a process of this host (:func:`sample_process`: ``/proc`` through psutil, and
the kernel's ``sock_diag`` over netlink), of this process for its own heartbeat (:func:`own_sample`,
:func:`beat_evidence`), and of a peer on another host from its heartbeat (:func:`beat_sample`).
Reading never raises: a process gone is ``stopped``, a piece that cannot be read (permissions, a
race) is no evidence. Its threads asleep in file I/O (a save's ``close()`` on network storage) are
read by :mod:`ncclguard.watching.sensors.io_wait`.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ncclguard.watching.sensors.io_wait import MAX_PATH, BlockedIO, file_target, files_to_keep, read_blocked_io

__all__ = [
    "BLOCKED_READING",
    "MAX_CHILDREN",
    "MAX_FDS",
    "BlockedIO",
    "Pairs",
    "Sample",
    "beat_evidence",
    "beat_sample",
    "own_sample",
    "parse_proc_net_tcp",
    "parse_sock_diag",
    "sample_process",
    "socket_inode",
]

_log = logging.getLogger("ncclguard")

MAX_CHILDREN = 32  # processes of the tree read per sample
MAX_FDS = 4096  # file descriptors looked at per sample (the process's and its children's)
MAX_DIAG = 65536  # sockets of the host walked per netlink dump
MAX_FILES = 256  # a process's open files remembered (a close() drops its descriptor before it waits)
MAX_KNOWN = 64  # processes whose open files are remembered
BLOCKED_READING = "blocked-io"  # the heartbeat's ``readings`` entry of a thread asleep in file I/O


Pairs = tuple[tuple[int, float], ...]  # (id, value), sorted: a child's pid and CPU, a socket's inode and bytes


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
        threads_cpu_s: the CPU seconds of its threads but the main one, where known.
        children_cpu: ``(pid, CPU seconds)`` of each process of its tree read, where known.
        net: ``(inode, bytes acknowledged + received)`` of each TCP socket of its tree, where known.
        net_queues: ``(inode, send queue + receive queue)`` of each, where the counters are unknown.
        chars: its bytes through ``read()`` and ``write()`` (``rchar + wchar``), where known.
        blocked_io: its threads asleep in file I/O (main thread first; empty: none), where known.
    """

    at: float
    source: str
    ops: int | None = None
    site: str | None = None
    cpu_s: float | None = None
    io_bytes: int | None = None
    stopped: bool = False
    threads_cpu_s: float | None = None
    children_cpu: Pairs | None = None
    net: Pairs | None = None
    net_queues: Pairs | None = None
    chars: int | None = None
    blocked_io: tuple[BlockedIO, ...] | None = None


def socket_inode(link: str) -> int | None:
    """The inode of a ``/proc/<pid>/fd`` link's target ``socket:[12345]``, or None for anything else."""
    if link.startswith("socket:[") and link.endswith("]"):
        digits = link[8:-1]
        return int(digits) if digits.isdigit() else None
    return None


def parse_proc_net_tcp(text: str, inodes: set[int] | None = None) -> dict[int, int]:
    """``/proc/<pid>/net/tcp`` (or ``tcp6``) rows: inode -> send queue + receive queue bytes.

    Args:
        text: the file's text (a header line, then one row a socket).
        inodes: keep only these sockets (None: every row).

    Returns:
        The queues by inode; a row that does not parse is skipped.
    """
    out: dict[int, int] = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or ":" not in cols[4]:
            continue
        try:
            tx, rx = (int(x, 16) for x in cols[4].split(":", 1))
            inode = int(cols[9])
        except ValueError:
            continue
        if inode and (inodes is None or inode in inodes):
            out[inode] = tx + rx
    return out


_NLMSG_ERROR, _NLMSG_DONE, _SOCK_DIAG_BY_FAMILY, _INET_DIAG_INFO = 2, 3, 20, 2
_DIAG_MSG = 72  # struct inet_diag_msg; its idiag_inode is at offset 68
_TCPI_BYTES = 120  # struct tcp_info: tcpi_bytes_acked (u64) at 120, tcpi_bytes_received (u64) at 128


def parse_sock_diag(data: bytes, inodes: set[int] | None = None) -> tuple[dict[int, int], bool]:
    """One netlink ``sock_diag`` answer (``inet_diag_msg`` messages with an ``INET_DIAG_INFO``
    attribute): inode -> bytes acknowledged + bytes received.

    Args:
        data: the bytes of one ``recv``.
        inodes: keep only these sockets (None: every one).

    Returns:
        The bytes by inode, and whether the dump is done (``NLMSG_DONE`` or an error).
    """
    out: dict[int, int] = {}
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if kind in (_NLMSG_DONE, _NLMSG_ERROR):
            return out, True
        if length < 16 or off + length > len(data):
            return out, True  # a broken answer: what was read stands
        body = off + 16
        if length >= 16 + _DIAG_MSG:
            (inode,) = struct.unpack_from("=I", data, body + 68)
            a = body + _DIAG_MSG
            while a + 4 <= off + length:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype == _INET_DIAG_INFO and alen - 4 >= _TCPI_BYTES + 16 and a + alen <= off + length:
                    acked, received = struct.unpack_from("=QQ", data, a + 4 + _TCPI_BYTES)
                    if inodes is None or inode in inodes:
                        out[inode] = acked + received
                a += (alen + 3) & ~3
        off += (length + 3) & ~3
    return out, False


_CACHE_S = 0.5  # one dump of the host's sockets and processes serves every peer sampled meanwhile
_cache_lock = threading.Lock()
_cache: dict[str, tuple[float, Any]] = {}
# Every TCP state but TIME_WAIT (6) and LISTEN (10): they move no bytes.
_STATES = 0xFFF & ~(1 << 6) & ~(1 << 10)


def _cached(name: str, read: Any) -> Any:
    """``read()``, or its value of less than :data:`_CACHE_S` ago."""
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(name)
        if hit is not None and now - hit[0] < _CACHE_S:
            return hit[1]
    value = read()
    with _cache_lock:
        _cache[name] = (now, value)
    return value


def _diag_dump() -> dict[int, int] | None:
    """Bytes acknowledged + received of every TCP socket of this network namespace, from one netlink
    ``sock_diag`` dump per address family (at most :data:`MAX_DIAG` sockets); None when netlink
    cannot be read here."""
    out: dict[int, int] = {}
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:  # NETLINK_SOCK_DIAG
            nl.settimeout(1.0)
            for family in (socket.AF_INET, socket.AF_INET6):
                # inet_diag_req_v2: family, protocol, extensions (INET_DIAG_INFO), pad, states, sockid.
                req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), _STATES)
                req += bytes(48)
                nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + req)
                done = False
                while not done and len(out) < MAX_DIAG:
                    data = nl.recv(1 << 16)
                    if not data:
                        break
                    part, done = parse_sock_diag(data)
                    out.update(part)
                if not done:
                    return out  # bounded: the rest of the dump goes with the socket
    except OSError:
        return None
    return out


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, over every process of this host (``/proc/<pid>/stat``)."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def _tree(pid: int) -> list[int]:
    """The processes below ``pid`` (breadth first, at most :data:`MAX_CHILDREN`)."""
    kids = _cached("children", _children_map)
    out: list[int] = []
    todo = list(kids.get(pid, []))
    while todo and len(out) < MAX_CHILDREN:
        p = todo.pop(0)
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _tree_sockets(pids: Iterable[int], files: dict[int, str] | None = None) -> dict[int, int]:
    """Socket inode -> the pid whose descriptor holds it, over ``pids`` (at most :data:`MAX_FDS`
    descriptors looked at); the first process's open files go into ``files`` (descriptor -> path)."""
    out: dict[int, int] = {}
    budget = MAX_FDS
    for n, pid in enumerate(pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds[:budget]:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = socket_inode(link)
            if inode is not None:
                out.setdefault(inode, pid)
            elif n == 0 and files is not None and len(files) < MAX_FILES and fd.isdigit() and file_target(link):
                files[int(fd)] = link
        budget -= min(len(fds), budget)
        if budget <= 0:
            break
    return out


def _net(pids: list[int], files: dict[int, str] | None = None) -> tuple[Pairs | None, Pairs | None]:
    """The tree's TCP sockets: ``(counters, None)`` where netlink reads them, else ``(None, queues)``
    from ``/proc/<pid>/net/tcp`` and ``tcp6``; ``(None, None)`` when nothing can be read. The first
    process's open files go into ``files``."""
    sockets = _tree_sockets(pids, files)
    if not sockets:
        return (), None
    inodes = set(sockets)
    dump = _cached("diag", _diag_dump)
    counters = {k: v for k, v in (dump or {}).items() if k in inodes}
    if counters:
        return tuple(sorted((k, float(v)) for k, v in counters.items())), None
    queues: dict[int, int] = {}
    for pid in dict.fromkeys(sockets.values()):  # another network namespace: its own view
        for name in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{name}") as f:
                    queues.update(parse_proc_net_tcp(f.read(), inodes))
            except OSError:
                continue
    if not queues:
        return None, None
    return None, tuple(sorted((k, float(v)) for k, v in queues.items()))


# pid -> its open files at the last look, and the ones kept since (descriptor -> path each).
_known: dict[int, tuple[dict[int, str], dict[int, str]]] = {}


def _files_known(pid: int) -> tuple[dict[int, str], dict[int, str]]:
    """``pid``'s files at its last look: open then, and the descriptors gone but kept (``known``: both)."""
    with _cache_lock:
        was_open, kept = _known.get(pid, ({}, {}))
    return was_open, {**kept, **was_open}


def _remember(
    pid: int,
    files: dict[int, str],
    was_open: dict[int, str],
    known: dict[int, str],
    blocked: tuple[BlockedIO, ...] | None,
) -> None:
    """Keeps ``pid``'s open files for its next look, with the ones gone since (:func:`files_to_keep`)."""
    kept = files_to_keep(was_open, known, files, {b.path for b in blocked or ()})
    with _cache_lock:
        _known.pop(pid, None)
        _known[pid] = (files, kept)
        while len(_known) > MAX_KNOWN:
            _known.pop(next(iter(_known)))


def _main_cpu(proc: Any, pid: int) -> tuple[float | None, float | None]:
    """The main thread's CPU seconds and the other threads' together."""
    main, rest = None, 0.0
    for t in proc.threads():
        if t.id == pid:  # Linux: the main thread's id is the process id
            main = float(t.user_time + t.system_time)
        else:
            rest += float(t.user_time + t.system_time)
    return main, (rest if main is not None else None)


def _read(what: str, pid: int, fn: Any) -> Any:
    """``fn()``, or None where that piece of the process cannot be read now (logged at debug)."""
    import psutil

    try:
        return fn()
    except (psutil.Error, OSError, ValueError) as exc:
        _log.debug("progress: cannot read %s of pid %d (%s)", what, pid, exc)
        return None


def sample_process(pid: int, now: float | None = None) -> Sample | None:
    """Reads a process of this host: stopped or not, the CPU of its main thread, of its other threads
    and of its process tree, its storage bytes and ``read``/``write`` bytes, its tree's TCP sockets,
    its threads asleep in file I/O.

    Returns:
        The sample (a piece that cannot be read is None in it), a stopped one when there is no such
        process, or None when it cannot be read at all.
    """
    import psutil

    at = time.monotonic() if now is None else now
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            status = proc.status()
            stopped = status in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD, "tracing-stop")
            main, rest = _read("threads", pid, lambda: _main_cpu(proc, pid)) or (None, None)
            io = _read("io", pid, proc.io_counters) if hasattr(proc, "io_counters") else None
        tree = _read("children", pid, lambda: _tree(pid))
        kids = list(tree or [])
        children: list[tuple[int, float]] = []
        for kid in kids:
            t = _read("a child's cpu", kid, lambda k=kid: psutil.Process(k).cpu_times())
            if t is not None:
                children.append((kid, float(t.user + t.system)))
        was_open, known = _files_known(pid)
        blocked = _read("threads' waits", pid, lambda: read_blocked_io(pid, known))
        files: dict[int, str] = {}
        read_net = _read("sockets", pid, lambda: _net([pid, *kids], files))
        if read_net is not None:
            _remember(pid, files, was_open, known, blocked)
        net, queues = read_net or (None, None)
        chars = getattr(io, "read_chars", None), getattr(io, "write_chars", None)
        return Sample(
            at=at,
            source="process",
            cpu_s=main,
            io_bytes=(io.read_bytes + io.write_bytes) if io is not None else None,
            stopped=stopped,
            threads_cpu_s=rest,
            children_cpu=tuple(sorted(children)) if tree is not None else None,
            net=net,
            net_queues=queues,
            chars=chars[0] + chars[1] if chars[0] is not None and chars[1] is not None else None,
            blocked_io=blocked,
        )
    except psutil.NoSuchProcess:  # gone: it will not come to the op either
        return Sample(at=at, source="process", stopped=True)
    except (psutil.Error, OSError):
        return None


def beat_evidence() -> dict[str, Any]:
    """What this process's heartbeat carries besides its main thread, read from its own ``/proc``:
    each process of its tree's CPU seconds, its TCP sockets' bytes together, its ``read``/``write``
    bytes. A peer on another host, which cannot read this ``/proc``, judges it from these as one on
    this host would (an upload blocked in ``send()``, DataLoader workers). Its other threads' CPU is
    not carried: ncclguard's own threads work in bursts that a beat's 5 s would count as progress.
    A thread asleep in file I/O (a save's ``close()`` on network storage) is carried, the first one
    only, as the reading :data:`BLOCKED_READING` (``call``, ``path``, ``tid``, ``wait``): the heartbeat
    has no field of its own for it, and its ``readings`` are a sensor's place for such figures.

    Returns:
        The heartbeat's fields (``children_cpu``, ``net_bytes``, ``chars``, and ``readings`` while a
        thread is asleep in file I/O); None where unreadable.
    """
    s = sample_process(os.getpid())
    if s is None:
        return {}
    out: dict[str, Any] = {
        "children_cpu": [(int(k), v) for k, v in s.children_cpu] if s.children_cpu is not None else None,
        "net_bytes": int(sum(v for _, v in s.net)) if s.net is not None else None,
        "chars": s.chars,
    }
    if s.blocked_io:
        out["readings"] = {BLOCKED_READING: s.blocked_io[0]._asdict()}
    return out


def _beat_blocked(hb: Any) -> tuple[BlockedIO, ...] | None:
    """The thread asleep in file I/O that a heartbeat's readings carry; none (empty) in a beat that
    carries :func:`beat_evidence` without it (its ``chars``); None where the beat tells nothing."""
    got = (getattr(hb, "readings", None) or {}).get(BLOCKED_READING)
    if got is None:
        return () if getattr(hb, "chars", None) is not None else None
    try:
        return (BlockedIO(str(got["call"]), str(got["path"])[:MAX_PATH], int(got["tid"]), str(got["wait"])[:64]),)
    except (KeyError, TypeError, ValueError):
        return None


def beat_sample(hb: Any, at: float) -> Sample:
    """The heartbeat ``hb`` of a peer on another host as a sample: its ops, call site, main-thread
    CPU, storage bytes and what :func:`beat_evidence` put in it (a thread asleep in file I/O too)."""
    ops = sum((hb.backend_seq or {}).values()) if hb.backend_seq else None
    return Sample(
        at,
        "heartbeat",
        ops,
        hb.site,
        hb.main_cpu_s,
        hb.io_bytes,
        children_cpu=tuple((int(k), float(v)) for k, v in hb.children_cpu) if hb.children_cpu is not None else None,
        net=((0, float(hb.net_bytes)),) if hb.net_bytes is not None else None,
        chars=hb.chars,
        blocked_io=_beat_blocked(hb),
    )


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
