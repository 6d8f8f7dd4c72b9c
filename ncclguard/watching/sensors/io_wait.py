"""A process's threads blocked in file I/O (read by :mod:`ncclguard.watching.sensors.proc_reading`,
judged by :mod:`ncclguard.watching.sensors.progress`).

A rank saving to network storage (NFS, Lustre, a FUSE mount of object storage) sits in ``close()``
or ``fsync()`` until the server has the data: its thread sleeps in the kernel (state ``S`` or ``D``),
uses no CPU and moves no byte counter, for as long as the save takes. What tells it apart from a rank
asleep for good is where it sleeps: ``/proc/<pid>/task/<tid>/syscall`` names the call and its first
argument (the file descriptor), ``/proc/<pid>/fd/<fd>`` the file, ``/proc/<pid>/task/<tid>/wchan``
the kernel function it waits in (``request_wait_answer`` for FUSE, ``nfs_...``/``rpc_...`` for NFS,
``folio_wait_bit_common`` for a page under writeback). The parsers here are pure; the reading never
raises (a piece that cannot be read is no evidence).

``close()`` drops the descriptor from the table before it waits for the flush, so its file is found
only in an earlier look at the process's descriptors (``known``, which proc_reading keeps per process
with :func:`files_to_keep`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "MAX_PATH",
    "MAX_THREADS",
    "BlockedIO",
    "file_target",
    "files_to_keep",
    "is_fs_wait",
    "parse_syscall_line",
    "read_blocked_io",
    "syscall_arch",
    "thread_blocked_io",
]

MAX_THREADS = 64  # threads of a process read per sample (its main thread first)
MAX_PATH = 200  # characters of a path kept in the evidence

# Calls whose first argument is a file descriptor, and calls on a path (their file is not named).
_FD_CALLS = {
    "x86_64": {0: "read", 1: "write", 3: "close", 5: "fstat", 17: "pread64", 18: "pwrite64", 19: "readv",
               20: "writev", 40: "sendfile", 74: "fsync", 75: "fdatasync", 77: "ftruncate", 78: "getdents",
               138: "fstatfs", 217: "getdents64", 277: "sync_file_range", 285: "fallocate", 295: "preadv",
               296: "pwritev", 306: "syncfs", 326: "copy_file_range", 327: "preadv2", 328: "pwritev2"},
    "aarch64": {44: "fstatfs", 46: "ftruncate", 47: "fallocate", 57: "close", 61: "getdents64", 63: "read",
                64: "write", 65: "readv", 66: "writev", 67: "pread64", 68: "pwrite64", 69: "preadv",
                70: "pwritev", 71: "sendfile", 80: "fstat", 82: "fsync", 83: "fdatasync", 84: "sync_file_range",
                267: "syncfs", 285: "copy_file_range", 286: "preadv2", 287: "pwritev2"},
}  # fmt: skip
_PATH_CALLS = {
    "x86_64": {2: "open", 4: "stat", 6: "lstat", 26: "msync", 76: "truncate", 82: "rename", 83: "mkdir",
               84: "rmdir", 85: "creat", 86: "link", 87: "unlink", 137: "statfs", 162: "sync", 257: "openat",
               258: "mkdirat", 262: "newfstatat", 263: "unlinkat", 264: "renameat", 316: "renameat2",
               332: "statx", 437: "openat2"},
    "aarch64": {34: "mkdirat", 35: "unlinkat", 37: "linkat", 38: "renameat", 43: "statfs", 45: "truncate",
                56: "openat", 79: "newfstatat", 81: "sync", 227: "msync", 276: "renameat2", 291: "statx",
                437: "openat2"},
}  # fmt: skip

# The kernel functions a thread waits in for a filesystem: by name start, and anywhere in the name.
_FS_PREFIXES = (
    "nfs", "rpc_", "__rpc_", "fuse_", "request_wait_answer", "ll_", "lov_", "osc_", "mdc_", "ptlrpc", "ldlm_",
    "cl_sync", "ceph", "p9_", "v9fs", "cifs", "smb2", "smb_", "wait_for_response", "xfs_", "ext4_", "jbd2",
    "btrfs_", "gfs2", "ocfs2", "orangefs", "afs_", "folio_wait", "__folio_lock", "wait_on_page", "__lock_page",
    "lock_page", "io_schedule", "bit_wait_io", "filemap_", "__filemap_", "wait_on_buffer", "__wait_on_buffer",
    "wb_wait", "writeback", "__writeback", "submit_bio", "blk_mq_", "dio_", "iomap_", "vfs_fsync", "file_write_and_wait",
)  # fmt: skip
_FS_MARKS = ("nfs", "fuse", "lustre", "ceph", "cifs", "writeback", "io_schedule", "folio_wait")
# Waits that are no file I/O even on a path: a named pipe, a terminal, a socket, a futex, a poll.
_NOT_FS = (
    "pipe_", "wait_for_partner", "fifo_", "unix_", "sk_wait", "inet_", "tcp_", "n_tty", "tty_", "wait_woken",
    "futex", "ep_poll", "do_epoll", "do_sys_poll", "poll_schedule", "do_select", "do_nanosleep", "hrtimer_",
    "sigsuspend", "do_wait", "inotify", "eventfd",
)  # fmt: skip


class BlockedIO(NamedTuple):
    """A thread asleep in file I/O: the call (``""`` where unknown), its file (``""`` where unknown),
    the thread's id and the kernel function it waits in (``wchan``, ``""`` where unread)."""

    call: str
    path: str
    tid: int
    wait: str

    def describe(self) -> str:
        """In words: ``close() on /mnt/ckpt/model.pt``, ``a filesystem wait (request_wait_answer)``."""
        what = f"{self.call}()" if self.call else "a filesystem wait"
        where = f" on {self.path}" if self.path else ""
        return f"{what}{where}" + (f" ({self.wait})" if self.wait and (not self.path or not self.call) else "")


def syscall_arch(machine: str | None = None) -> str:
    """The syscall table to read ``/proc/<pid>/task/<tid>/syscall`` with: ``x86_64``, ``aarch64``, or
    ``""`` (none known: only the kernel's wait then tells file I/O).

    Args:
        machine: ``platform.machine()`` (its value here when None).
    """
    m = (platform.machine() if machine is None else machine).lower()
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(m, "")


def parse_syscall_line(text: str, arch: str) -> tuple[str, int | None] | None:
    """A thread's ``/proc/<pid>/task/<tid>/syscall`` (``"3 0x5 0x0 ..."``: the number, then the
    arguments in hex), when the call is file I/O.

    Args:
        text: the file's text.
        arch: the syscall table (:func:`syscall_arch`).

    Returns:
        ``(name, fd)``: the call's name and its descriptor (None for a call on a path); None when the
        thread runs, is blocked outside a call (``-1``), in another call, or the text does not parse.
    """
    cols = text.split()
    if not cols or not cols[0].lstrip("-").isdigit():
        return None
    nr = int(cols[0])
    if nr in _FD_CALLS.get(arch, {}):
        try:
            fd = int(cols[1], 16) if len(cols) > 1 else -1
        except ValueError:
            return None
        fd = fd - (1 << 64) if fd >= 1 << 63 else fd
        return (_FD_CALLS[arch][nr], fd) if fd >= 0 else None
    if nr in _PATH_CALLS.get(arch, {}):
        return _PATH_CALLS[arch][nr], None
    return None


def is_fs_wait(wchan: str) -> bool:
    """Whether a thread's ``wchan`` names a filesystem's or the page cache's wait (``request_wait_answer``,
    ``nfs_wait_bit_killable``, ``rpc_wait_bit_killable``, ``ptlrpc_set_wait``, ``folio_wait_bit_common``,
    ``io_schedule``...), not a futex, a poll, a socket or a pipe."""
    w = wchan.strip()
    return bool(w) and w != "0" and (w.startswith(_FS_PREFIXES) or any(m in w for m in _FS_MARKS))


def file_target(link: str | None) -> str | None:
    """The file a ``/proc/<pid>/fd`` link names when it is one on a filesystem (``/mnt/ckpt/x (deleted)``
    -> ``/mnt/ckpt/x``); None for a socket, a pipe, an anonymous inode, a device, ``/proc`` or ``/sys``."""
    if not link or not link.startswith("/") or link.startswith(("/dev/", "/proc/", "/sys/", "/memfd:")):
        return None
    return link.removesuffix(" (deleted)")[:MAX_PATH]


def thread_blocked_io(
    tid: int, state: str, call: tuple[str, int | None] | None, link: str | None, wchan: str
) -> BlockedIO | None:
    """Whether one thread is asleep in file I/O, as read (pure).

    Args:
        tid: the thread's id.
        state: its state letter (``/proc/<pid>/task/<tid>/stat``).
        call: its call (:func:`parse_syscall_line`), None when it is in none of file I/O.
        link: where its call's descriptor points (``/proc/<pid>/fd/<fd>``, or an earlier look for a
            descriptor ``close()`` already dropped), None when unknown.
        wchan: the kernel function it waits in.

    Returns:
        What it waits on: a call on a file, any call in a filesystem's wait, or a file call in
        uninterruptible sleep (``D``); None otherwise (running, stopped, a socket, a pipe, a futex).
    """
    if state not in ("S", "D"):
        return None
    fs = is_fs_wait(wchan)
    wait = wchan.strip() if fs or state == "D" else ""
    if call is not None:
        name, fd = call
        path = file_target(link) if fd is not None else ""
        if (fd is not None and link is not None and path is None) or wchan.strip().startswith(_NOT_FS):
            return None  # a socket, a pipe, a device, a terminal: not file I/O whatever the call
        if path or fs or state == "D":
            return BlockedIO(name, path or "", tid, wait)
        return None
    return BlockedIO("", "", tid, wait) if fs else None


def _text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(512).decode("ascii", "replace")
    except OSError:
        return None


def read_blocked_io(
    pid: int, known: Mapping[int, str] | None = None, arch: str | None = None
) -> tuple[BlockedIO, ...] | None:
    """The threads of process ``pid`` asleep in file I/O (its main thread first, at most
    :data:`MAX_THREADS` read). Never raises.

    Args:
        pid: the process.
        known: descriptor -> link from an earlier look at its descriptors (for ``close()``).
        arch: the syscall table (:func:`syscall_arch` of this machine when None).

    Returns:
        One :class:`BlockedIO` a thread in such a wait (empty: none), None when its threads cannot be listed.
    """
    table = syscall_arch() if arch is None else arch
    try:
        tids = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit()), key=lambda t: (t != pid, t))
    except OSError:
        return None
    out = []
    for tid in tids[:MAX_THREADS]:
        base = f"/proc/{pid}/task/{tid}"
        wchan = _text(f"{base}/wchan") or ""
        if wchan.startswith(_NOT_FS):
            continue  # most threads: a futex, a poll (one read, not three)
        fields = (_text(f"{base}/stat") or "").rsplit(")", 1)[-1].split()
        state = fields[0] if fields else ""
        if state not in ("S", "D"):
            continue
        call = parse_syscall_line(_text(f"{base}/syscall") or "", table)
        link = None
        if call is not None and call[1] is not None:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{call[1]}")  # a link's text: no call reaches the filesystem
            except OSError:
                link = (known or {}).get(call[1])
        found = thread_blocked_io(tid, state, call, link, wchan)
        if found is not None:
            out.append(found)
    return tuple(out)


def files_to_keep(
    was_open: Mapping[int, str], known: Mapping[int, str], open_now: Mapping[int, str], waited: set[str]
) -> dict[int, str]:
    """The files of a process's descriptors gone since they were open, kept for its next look (pure).

    A look reads the threads' waits before the descriptors. A ``close()`` that begins between the two
    drops its descriptor unseen in a wait; kept one more look, its file is named when that look finds
    the wait (then it stays as long as a thread waits on it).

    Args:
        was_open: descriptor -> path, open at the last look.
        known: what this look's threads were read with (the open ones and the ones kept).
        open_now: the descriptors open at this look.
        waited: the files this look's threads wait on.

    Returns:
        descriptor -> path for the ones not open now that were open at the last look, or are waited on.
    """
    return {
        fd: p for fd, p in known.items() if fd not in open_now and (was_open.get(fd) == p or file_target(p) in waited)
    }
