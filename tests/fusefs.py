"""A FUSE mount whose storage takes its time, for tests of a rank saving to network storage
(tests/watching/test_io_wait.py, tests/watching/test_slow_save_multirank.py).

The filesystem (mfusepy, in a process of its own, files kept in its memory) takes ``write_s`` per
write, and the flush of a file written to (what its ``close()`` waits for, as NFS, Lustre or a FUSE
mount of object storage make it wait until the server has the data) waits until the file
``release`` exists, ``flush_s`` at most. Reads, and the close of a file only read, are immediate. :func:`fuse_missing` says why no such
mount can be made here (no ``/dev/fuse``, no ``fusermount3`` of Debian's fuse3, no ``mfusepy`` with
libfuse3); :func:`slow_mount` mounts it for a ``with`` block and unmounts it after, bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["SLOW_FS", "fuse_missing", "slow_mount"]

# argv: MOUNT RELEASE WRITE_S FLUSH_S (see the module doc).
SLOW_FS = textwrap.dedent(
    """
    import errno, os, stat, sys, time
    import mfusepy as fuse

    MOUNT, RELEASE, WRITE_S, FLUSH_S = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])

    class Slow(fuse.Operations):
        use_ns = True

        def __init__(self):
            self.files, self.fh, self.dirty = {}, 0, set()

        def getattr(self, path, fh=None):
            if path == "/":
                return dict(st_mode=stat.S_IFDIR | 0o755, st_nlink=2)
            if path in self.files:
                return dict(st_mode=stat.S_IFREG | 0o644, st_nlink=1, st_size=len(self.files[path]))
            raise fuse.FuseOSError(errno.ENOENT)

        def readdir(self, path, fh):
            return [".", ".."] + [p[1:] for p in self.files]

        def create(self, path, mode, fi=None):
            self.files[path] = bytearray()
            self.fh += 1
            return self.fh

        def open(self, path, flags):
            self.fh += 1
            return self.fh

        def truncate(self, path, length, fh=None):
            del self.files[path][length:]

        def read(self, path, size, offset, fh):
            return bytes(self.files[path][offset : offset + size])

        def write(self, path, data, offset, fh):
            time.sleep(WRITE_S)
            self.files[path][offset : offset + len(data)] = data
            self.dirty.add(path)
            return len(data)

        def flush(self, path, fh):
            if path not in self.dirty:
                return 0  # nothing written since the last flush (a read): at once
            self.dirty.discard(path)
            end = time.monotonic() + FLUSH_S
            while not os.path.exists(RELEASE) and time.monotonic() < end:
                time.sleep(0.05)
            return 0

        def release(self, path, fh):
            return 0

    fuse.FUSE(Slow(), MOUNT, foreground=True, nothreads=True)
    """
)


def fuse_missing() -> str | None:
    """Why a FUSE mount cannot be made here, or None."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no /dev/fuse (or not root)"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian's fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy (with libfuse3) does not load: {exc}"
    return None


@contextlib.contextmanager
def slow_mount(mount: Path, release: Path, write_s: float, flush_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """The slow filesystem mounted on the empty directory ``mount`` for the ``with`` block (its process
    yielded); unmounted after (``fusermount3 -u``, else a lazy ``umount``), its process ended, each
    step bounded. ``release`` is touched first, so that a flush still waiting ends at once.

    Skips the test (with the filesystem's own words) where the mount does not come up within 15 s."""
    fs = subprocess.Popen(
        [sys.executable, "-c", SLOW_FS, str(mount), str(release), str(write_s), str(flush_s)], stderr=subprocess.PIPE
    )
    try:
        end = time.monotonic() + 15
        while not os.path.ismount(mount) and fs.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        if not os.path.ismount(mount):
            fs.kill()
            err = fs.communicate(timeout=10)[1].decode(errors="replace")[-500:]
            pytest.skip(f"the FUSE mount did not come up here: {err}")
        yield fs
    finally:
        release.touch()
        for cmd in (["fusermount3", "-u", str(mount)], ["umount", "-l", str(mount)]):
            if not os.path.ismount(mount):
                break
            subprocess.run(cmd, timeout=20, capture_output=True, check=False)
        fs.kill()
        fs.wait(timeout=20)
