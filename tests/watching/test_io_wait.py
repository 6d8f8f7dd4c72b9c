"""Threads asleep in file I/O (ncclguard/watching/sensors/io_wait.py): the ``/proc`` parsers on fixtures
written here, then one real save: ``torch.save`` into a FUSE mount whose writes are slow and whose
flush (the ``close()``) waits (tests/fusefs.py), read from ``/proc`` by ``sample_process`` and judged by ``Progress``
busy in ``close()`` on its file, never stuck. Skipped where ``/dev/fuse``, ``fusermount3`` or
``mfusepy`` (with libfuse) is missing. Bounds are hang guards, never speed targets."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fusefs import fuse_missing, slow_mount

from ncclguard.watching.sensors.io_wait import (
    BlockedIO,
    file_target,
    files_to_keep,
    is_fs_wait,
    parse_syscall_line,
    read_blocked_io,
    syscall_arch,
    thread_blocked_io,
)
from ncclguard.watching.sensors.progress import Progress, sample_process


def test_a_syscall_line_gives_the_file_call_and_its_descriptor_on_either_arch() -> None:
    # /proc/<pid>/task/<tid>/syscall: the number, six arguments in hex, the stack pointer, the pc.
    line = "3 0x5 0x0 0x0 0x7f47f4e61fb0 0x0 0x0 0x7ffcabb0c448 0x7f47f56c29f0"
    assert parse_syscall_line(line, "x86_64") == ("close", 5)
    assert parse_syscall_line("57 0x5 0x0 0x0 0x0 0x0 0x0 0x0 0x0", "aarch64") == ("close", 5)
    assert parse_syscall_line("74 0xc 0 0 0 0 0 0 0", "x86_64") == ("fsync", 12)
    assert parse_syscall_line("82 0xc 0 0 0 0 0 0 0", "aarch64") == ("fsync", 12)
    assert parse_syscall_line("1 0x1 0x7f 0x10 0 0 0 0 0", "x86_64") == ("write", 1)
    assert parse_syscall_line("18 0x7 0x7f 0x10 0x0 0 0 0 0", "x86_64") == ("pwrite64", 7)
    assert parse_syscall_line("277 0x9 0 0 0 0 0 0 0", "x86_64") == ("sync_file_range", 9)
    # openat(AT_FDCWD, ...): a call on a path, no descriptor; msync's first argument is an address.
    assert parse_syscall_line("257 0xffffffffffffff9c 0x7f 0x241 0x1b6 0 0 0 0", "x86_64") == ("openat", None)
    assert parse_syscall_line("227 0x7f0000 0x1000 0x4 0 0 0 0 0", "aarch64") == ("msync", None)
    # Running, blocked outside a call (a page fault), another call, garbage, an unknown arch: none.
    assert parse_syscall_line("running", "x86_64") is None
    assert parse_syscall_line("-1 0x7ffc 0x7f47", "x86_64") is None
    assert parse_syscall_line("202 0x7f 0x80 0 0 0 0 0 0", "x86_64") is None  # futex
    assert parse_syscall_line("3 0xzz", "x86_64") is None and parse_syscall_line("", "x86_64") is None
    assert parse_syscall_line("3 0x5 0 0 0 0 0 0 0", "") is None
    assert parse_syscall_line("0 0xffffffffffffffff 0 0 0 0 0 0 0", "x86_64") is None  # fd -1
    assert syscall_arch("x86_64") == syscall_arch("AMD64") == "x86_64"
    assert syscall_arch("aarch64") == syscall_arch("arm64") == "aarch64" and syscall_arch("riscv64") == ""


def test_a_wchan_names_a_filesystem_wait_or_not() -> None:
    for wait in (
        "request_wait_answer",  # FUSE
        "fuse_wait_on_page_writeback",
        "nfs_wait_bit_killable",
        "nfs4_wait_clnt_recover",
        "rpc_wait_bit_killable",
        "__rpc_wait_for_completion_task",
        "ptlrpc_set_wait",  # Lustre
        "ll_file_flush",
        "ldlm_completion_ast",
        "ceph_mdsc_wait_request",
        "p9_client_rpc",  # 9p
        "cifs_wait_mtu_credits",
        "wait_for_response",
        "folio_wait_bit_common",  # a page under writeback: xfs, ext4
        "wait_on_page_bit_common",
        "__lock_page",
        "io_schedule",
        "filemap_fdatawait_range",
        "jbd2_log_wait_commit",
        "xfs_log_force_seq",
        "wb_wait_for_completion",
    ):
        assert is_fs_wait(wait), wait
    for wait in ("0", "", "futex_do_wait", "do_epoll_wait", "poll_schedule_timeout", "do_nanosleep", "pipe_read"):
        assert not is_fs_wait(wait), wait
    assert not is_fs_wait("sk_wait_data") and not is_fs_wait("unix_stream_read_generic")
    assert not is_fs_wait("do_select") and not is_fs_wait("hrtimer_nanosleep")


def test_a_thread_is_in_file_io_by_its_call_file_or_wait_never_by_a_socket_or_pipe() -> None:
    assert file_target("/mnt/ckpt/model.pt") == "/mnt/ckpt/model.pt"
    assert file_target("/mnt/ckpt/model.pt.tmp (deleted)") == "/mnt/ckpt/model.pt.tmp"
    for link in ("socket:[5151]", "pipe:[12]", "anon_inode:[eventfd]", "/dev/pts/0", "/dev/nvidia0", "/proc/1/stat"):
        assert file_target(link) is None, link
    assert file_target(None) is None and len(file_target("/" + "x" * 500) or "") == 200
    close = ("close", 5)
    fuse = "request_wait_answer"
    assert thread_blocked_io(9, "S", close, "/mnt/ckpt/model.pt", fuse) == BlockedIO(
        "close", "/mnt/ckpt/model.pt", 9, fuse
    )
    assert thread_blocked_io(9, "S", close, None, fuse) == BlockedIO("close", "", 9, fuse)  # dropped fd
    assert thread_blocked_io(9, "D", ("fsync", 5), None, "") == BlockedIO("fsync", "", 9, "")
    assert thread_blocked_io(9, "S", ("fsync", 5), "/data/x.bin", "") == BlockedIO("fsync", "/data/x.bin", 9, "")
    assert thread_blocked_io(9, "S", ("write", 5), "/data/x.bin", "rwsem_down_write_slowpath") is not None
    assert thread_blocked_io(9, "S", ("openat", None), None, "nfs_lookup_revalidate") is not None
    assert thread_blocked_io(9, "S", None, None, "nfs_wait_bit_killable") == BlockedIO(
        "", "", 9, "nfs_wait_bit_killable"
    )  # a page fault on a file of an NFS mount: no call
    # Not file I/O: a socket, a pipe, a terminal, a named pipe, a futex, a running or stopped thread.
    assert thread_blocked_io(9, "S", ("read", 5), "socket:[77]", "sk_wait_data") is None
    assert thread_blocked_io(9, "S", ("write", 5), "pipe:[7]", "pipe_write") is None
    assert thread_blocked_io(9, "D", ("read", 0), "/dev/pts/0", "n_tty_read") is None
    assert thread_blocked_io(9, "S", ("read", 3), "/tmp/fifo", "pipe_read") is None
    assert thread_blocked_io(9, "S", ("close", 5), None, "futex_do_wait") is None
    assert thread_blocked_io(9, "S", None, None, "do_epoll_wait") is None
    assert thread_blocked_io(9, "R", close, "/mnt/ckpt/model.pt", "0") is None
    assert thread_blocked_io(9, "T", close, "/mnt/ckpt/model.pt", fuse) is None
    assert BlockedIO("close", "/mnt/ckpt/model.pt", 9, "").describe() == "close() on /mnt/ckpt/model.pt"
    assert BlockedIO("close", "", 9, fuse).describe() == "close() (request_wait_answer)"
    assert BlockedIO("", "", 9, "nfs_wait_bit_killable").describe() == "a filesystem wait (nfs_wait_bit_killable)"


def test_a_descriptor_closed_between_a_looks_two_reads_keeps_its_file_for_the_next_look() -> None:
    # The race the FUSE save below met 1 run in 4 under load: a look reads the threads (the saver is
    # between its last write and its close), then its descriptors (the close has dropped fd 5).
    model, log = "/mnt/ckpt/model.pt", "/tmp/run.log"
    look1 = {5: model, 7: log}  # the save writing
    kept = files_to_keep(look1, look1, {7: log}, set())  # look 2: fd 5 gone, no thread seen in a wait
    assert kept == {5: model}
    known = {**kept, 7: log}  # look 3 reads the threads with it: the close waits on fd 5
    blocked = thread_blocked_io(9, "S", ("close", 5), known.get(5), "request_wait_answer")
    assert blocked == BlockedIO("close", model, 9, "request_wait_answer")
    # Kept while a thread waits on it, however many looks the flush takes.
    for _ in range(3):
        kept = files_to_keep({7: log}, {**kept, 7: log}, {7: log}, {blocked.path})
        assert kept == {5: model}
    # Forgotten one look after its wait ends; a descriptor number taken again names the new file.
    assert files_to_keep({7: log}, {**kept, 7: log}, {7: log}, set()) == {}
    assert files_to_keep({7: log}, {**kept, 7: log}, {5: "/data/b.bin", 7: log}, {model}) == {}
    # A file closed two looks ago and never waited on is not kept.
    assert files_to_keep({7: log}, {5: model, 7: log}, {7: log}, set()) == {}


def test_a_process_asleep_has_no_thread_in_file_io_and_one_gone_is_unread() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        assert read_blocked_io(proc.pid) == ()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert read_blocked_io(proc.pid) is None


SAVER = textwrap.dedent(
    """
    import sys, torch
    print("ready", flush=True)
    torch.save({"w": torch.ones(1 << 19)}, sys.argv[1])  # 2 MiB: a few slow writes, then the close
    print("saved", flush=True)
    """
)


CLOSER = textwrap.dedent(
    """
    import sys, time
    print("ready", flush=True)
    for n in range(int(sys.argv[2])):
        with open(f"{sys.argv[1]}/part-{n}.bin", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()  # the write now: what is left to the close is its flush's wait
            time.sleep(0.05)  # asleep in no file I/O, the file open
        # the with's close(): the filesystem's flush waits flush_s
    print("closed", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_every_look_at_a_close_waiting_on_a_fuse_mount_names_its_file_however_the_look_meets_it(
    tmp_path: Path,
) -> None:
    # Looks as fast as they come, 8 closes: a close() that begins between a look's read of the threads
    # and its read of the descriptors (seen 1 run in 4 of the save below, under load) still has its
    # file named at the next look.
    why = fuse_missing()
    if why is not None:
        pytest.skip(f"a FUSE mount cannot be made here: {why}")
    mount, release = tmp_path / "mnt", tmp_path / "never"
    mount.mkdir()
    closes, looks, unnamed = 8, 0, []
    with slow_mount(mount, release, write_s=0.0, flush_s=0.3):
        closer = subprocess.Popen([sys.executable, "-c", CLOSER, str(mount), str(closes)], stdout=subprocess.PIPE)
        try:
            assert closer.stdout is not None and closer.stdout.readline().strip() == b"ready"
            seen: set[str] = set()
            end = time.monotonic() + 60  # a hang guard: the closes take about 8 x 0.35 s
            while closer.poll() is None and time.monotonic() < end:
                s = sample_process(closer.pid)
                if s is None or s.stopped or not s.blocked_io:
                    continue
                looks += 1
                b = s.blocked_io[0]
                if b.call == "close":
                    seen.add(b.path)
                    if not b.path.startswith(f"{mount}/part-"):
                        unnamed.append(b)
            assert closer.wait(timeout=30) == 0 and closer.stdout.readline().strip() == b"closed"
        finally:
            if closer.poll() is None:
                closer.kill()
                closer.wait(timeout=20)
    assert unnamed == [], (len(unnamed), looks)
    assert len(seen) >= closes - 1, sorted(seen)  # every close seen waiting (the last may end unseen)


@pytest.mark.timeout(90)
def test_a_save_waiting_in_close_on_a_slow_fuse_mount_is_busy_naming_close_and_its_file(tmp_path: Path) -> None:
    why = fuse_missing()
    if why is not None:
        pytest.skip(f"a FUSE mount cannot be made here: {why}")
    mount, release = tmp_path / "mnt", tmp_path / "release"
    mount.mkdir()
    target = mount / "model.pt"
    saver = None
    # Writes of 0.2 s each; the flush waits for the release file (20 s at most).
    with slow_mount(mount, release, write_s=0.2, flush_s=20):
        try:
            saver = subprocess.Popen([sys.executable, "-c", SAVER, str(target)], stdout=subprocess.PIPE)
            assert saver.stdout is not None and saver.stdout.readline().strip() == b"ready"
            prog, before = Progress(2.0), Progress(2.0)  # before: the same looks without the new evidence
            closing: float | None = None
            judged = []
            end = time.monotonic() + 40  # a hang guard
            while time.monotonic() < end:
                s = sample_process(saver.pid)
                assert s is not None and not s.stopped
                prog.observe(s)
                before.observe(dataclasses.replace(s, blocked_io=None))
                j = prog.judge(s.at)
                judged.append(j)
                if s.blocked_io and s.blocked_io[0].call == "close":
                    closing = s.at if closing is None else closing
                    if s.at - closing >= 3.5:  # past still_s: nothing else moves in the close
                        break
                time.sleep(0.1)
            assert closing is not None, judged[-3:]
            print(f"\nFUSE evidence: {j.state}: {j.evidence}\nwithout it: {before.judge(s.at)}")
            assert [x for x in judged if x.state == "stuck"] == []
            assert j.state == "moving" and j.evidence.startswith(f"blocked in close() on {target} for "), j
            assert before.judge(s.at).state == "stuck"  # the bug: killed mid-save
            release.touch()
            assert saver.stdout.readline().strip() == b"saved" and saver.wait(timeout=20) == 0
        finally:
            release.touch()
            if saver is not None and saver.poll() is None:
                saver.kill()
                saver.wait(timeout=20)
