"""How a job learns that its launcher is gone (ncclguard/supervise/parent.py, ncclguard/supervise/reaper.py).

Pure rules first (when is the launcher gone, whose environment holds its token), then small process
trees of this test's own (no torchrun): a "launcher" (a Python process of the test) that starts a
supervisor running tests/workers/launcher_death_worker.py, then is SIGKILLed; and the orphan guard
started as ``ncclguard run`` starts it, told ``done`` or left without. The whole job under a real
launcher is tests/env/test_launcher_death_multirank.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from harness import wait_for
from hypothesis import given
from hypothesis import strategies as st

from ncclguard.supervise.parent import LAUNCHER_VAR, launcher_pid, orphaned, set_death_signal
from ncclguard.supervise.reaper import Guard, holders, holds, reap

REPO = Path(__file__).parents[2]
WORKER = str(REPO / "tests" / "workers" / "launcher_death_worker.py")
GUARD_S = 60.0  # hang guard: a supervisor imports torch on a loaded 2-core machine


@given(
    parent=st.integers(1, 50),
    now=st.integers(1, 50),
    launcher=st.one_of(st.none(), st.integers(1, 50)),
    alive=st.booleans(),
)
def test_the_launcher_is_gone_when_the_parent_changed_or_died_before(parent, now, launcher, alive) -> None:
    gone = orphaned(parent, now, launcher, alive)
    if now != parent:
        assert gone  # reparented: the parent process ended
    elif launcher is None or launcher == parent:
        assert not gone  # the parent is the launcher (or nothing else is known), and it is still the parent
    else:
        assert gone is (not alive)  # never the launcher's child: gone when the launcher no longer exists


def test_the_launchers_pid_is_read_from_its_token() -> None:
    assert launcher_pid({LAUNCHER_VAR: "1234-9f3a"}) == 1234
    assert launcher_pid({LAUNCHER_VAR: "x-1"}) is None and launcher_pid({}) is None
    assert holds(b"A=1\0NCCLGUARD_LAUNCHER=12-ab\0B=2", "12-ab")
    assert not holds(b"NCCLGUARD_LAUNCHER=12-abc\0", "12-ab") and not holds(b"", "12-ab") and not holds(b"x", "")


def test_holders_are_read_from_proc(tmp_path: Path) -> None:
    for pid, env in ((10, b"NCCLGUARD_LAUNCHER=t\0"), (11, b"X=1\0"), (12, b"NCCLGUARD_LAUNCHER=t\0")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "environ").write_bytes(env)
    (tmp_path / "13").mkdir()  # gone meanwhile: no environ
    (tmp_path / "self").mkdir()
    assert holders("t", tmp_path) == [10, 12] and holders("t", tmp_path, skip=[12]) == [10]


def test_the_death_signal_is_set_in_the_kernel() -> None:
    code = (
        "import ctypes, signal\n"
        "from ncclguard.supervise.parent import set_death_signal\n"
        "assert set_death_signal(int(signal.SIGHUP))\n"
        "got = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "print(got.value)\n"
    )
    if not sys.platform.startswith("linux"):
        assert not set_death_signal(int(signal.SIGHUP))
        return
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD_S, check=True)
    assert done.stdout.strip() == str(int(signal.SIGHUP))
    assert ctypes.sizeof(ctypes.c_int) == 4


# A "launcher": starts CHILD from a thread that ends once the child runs (PR_SET_PDEATHSIG fires then,
# while this process lives), then waits to be killed.
LAUNCHER = """
import os, subprocess, sys, threading, time
out = sys.argv[1]
def start():
    subprocess.Popen([sys.executable, *sys.argv[2:], out])
    while not os.path.exists(os.path.join(out, "running-?")):
        time.sleep(0.05)
thread = threading.Thread(target=start)
thread.start()
thread.join()
time.sleep(3600)
"""
# The poll alone (no prctl): the child says when ParentWatch tells it the launcher is gone.
POLLED = """
import os, signal, sys, time
from pathlib import Path
from ncclguard.supervise.parent import ORPHAN_SIGNAL, ParentWatch
out = Path(sys.argv[1])
watch = ParentWatch(prctl=False, poll_s=0.05)
def told(signum, frame):
    if watch.gone():
        (out / "gone").write_text(str(os.getppid()))
        os._exit(0)
signal.signal(ORPHAN_SIGNAL, told)
watch.arm()
(out / "running-?").write_text(str(os.getpid()))
time.sleep(3600)
"""


def _launch(child: list[str]) -> tuple[subprocess.Popen, Path, list[psutil.Process], tempfile._TemporaryFileWrapper]:
    out = Path(tempfile.mkdtemp(prefix="ncclguard-parent-"))
    log = tempfile.TemporaryFile("w+")
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(out), *child],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_for(lambda: (out / "running-?").exists() or launcher.poll() is not None, GUARD_S, "the child running")
    assert launcher.poll() is None
    return launcher, out, psutil.Process(launcher.pid).children(recursive=True), log


def _gone(procs: list[psutil.Process]) -> bool:
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _end(launcher: subprocess.Popen, procs: list[psutil.Process]) -> None:
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _read(log: tempfile._TemporaryFileWrapper) -> str:
    log.seek(0)
    return log.read()


def test_a_supervisor_ignores_its_starting_thread_and_ends_its_rank_with_the_launcher() -> None:
    supervisor = ["-m", "ncclguard.supervise", "--restarts", "2", "--", sys.executable, WORKER]
    launcher, _, procs, log = _launch(supervisor)
    try:
        assert len(procs) == 2  # the supervisor, its rank
        # The thread that started the supervisor ended: the signal came while the launcher lives: ignored.
        wait_for(lambda: "lives: ignored" in _read(log), GUARD_S, "the death signal ignored")
        assert not _gone(procs)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        wait_for(lambda: _gone(procs), 30.0, "the supervisor and its rank gone", every_s=0.05)
    finally:
        _end(launcher, procs)
    text = _read(log)
    assert f"the launcher (pid {launcher.pid}) is gone: stopping the rank (SIGTERM, SIGKILL after 8 s)" in text, text
    assert "restart 1 of 2" not in text


def test_the_poll_alone_sees_the_launcher_go() -> None:
    launcher, out, procs, log = _launch(["-c", POLLED])
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        wait_for(lambda: (out / "gone").exists(), 30.0, "the poll telling the launcher is gone", every_s=0.05)
        assert int((out / "gone").read_text()) != launcher.pid, _read(log)
    finally:
        _end(launcher, procs)


def _holder(token: str, ignore_term: bool, session: bool) -> subprocess.Popen:
    code = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
    code += "print('up', flush=True)\ntime.sleep(3600)\n"
    env = {**os.environ, LAUNCHER_VAR: token}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, start_new_session=session
    )
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # its handler is in place
    return proc


def test_reap_ends_what_holds_the_token_sigkill_after_the_grace() -> None:
    token = f"{os.getpid()}-reap{time.monotonic_ns()}"
    mine = [_holder(token, ignore_term=False, session=True), _holder(token, ignore_term=True, session=False)]
    other = _holder(f"{token}x", ignore_term=False, session=True)
    try:
        found = reap(token, grace_s=1.0)
        assert sorted(found) == sorted(p.pid for p in mine)
        for p in mine:
            p.wait(timeout=GUARD_S)
        assert [p.returncode for p in mine] == [-signal.SIGTERM, -signal.SIGKILL]
        assert other.poll() is None  # another launcher's process is not touched
    finally:
        for p in [*mine, other]:
            p.kill()
            p.wait()


@pytest.mark.parametrize("launcher_ends", ["done", "killed"])
def test_the_guard_reaps_only_when_the_launcher_died(launcher_ends: str) -> None:
    token = f"{os.getpid()}-guard{time.monotonic_ns()}"
    job = _holder(token, ignore_term=False, session=True)
    try:
        guard = Guard(token, grace_s=2.0)
        pids = [p.pid for p in psutil.process_iter(["cmdline"]) if token in (p.info["cmdline"] or [])]
        assert len(pids) == 1  # the guard, detached (its starter exited)
        (watch,) = [psutil.Process(pid) for pid in pids]
        assert watch.pid not in [c.pid for c in psutil.Process().children()]
        if launcher_ends == "done":
            guard.done()
            wait_for(lambda: _gone([watch]), GUARD_S, "the guard gone")
            assert job.poll() is None  # the launcher returned: what is left is left alone
        else:
            guard.pipe.close()  # the launcher's end of the pipe closes as when the launcher dies
            job.wait(timeout=GUARD_S)
            assert job.returncode == -signal.SIGTERM
            wait_for(lambda: _gone([watch]), GUARD_S, "the guard gone")
    finally:
        job.kill()
        job.wait()


def test_a_guard_whose_starter_does_not_exit_in_time_is_given_up(monkeypatch) -> None:
    """The launcher's wait for the guard's starter is bounded (``STARTER_WAIT_S``): past it the
    starter is killed and the launcher is told (an OSError: ``ncclguard run`` goes on without a guard)."""
    from ncclguard.supervise import reaper

    monkeypatch.setattr(reaper, "STARTER_WAIT_S", 0.001)  # shorter than any interpreter's start
    token = f"{os.getpid()}-slow{time.monotonic_ns()}"
    start = time.monotonic()
    with pytest.raises(OSError, match="had not exited within 0.001 s"):
        Guard(token, grace_s=2.0)
    assert time.monotonic() - start < 5.0
    # Whatever it started is gone: the starter killed, or a guard it forked that found nothing to reap.
    wait_for(
        lambda: not [p for p in psutil.process_iter(["cmdline"]) if token in (p.info["cmdline"] or [])],
        GUARD_S,
        "the guard's processes gone",
    )
