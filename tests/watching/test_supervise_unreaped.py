"""A rank that SIGKILL does not end (ncclguard/supervise/loop.py, ``kill_wait_s``): the supervisor
waits a bounded time for it, then posts its death as it would have, and restarts the rank or exits.

Two ways to make such a process:

- for real: a process in a frozen cgroup v1 freezer (``freezer.state`` ``FROZEN``) sits in
  uninterruptible sleep (``D``); SIGKILL stays pending and ``waitpid`` does not return until it is
  thawed (checked here on Linux 6.18; a cgroup v2 ``cgroup.freeze`` does not do it: a frozen task dies
  on SIGKILL at once). Needs root and the v1 freezer hierarchy; skipped where either is missing;
- a stand-in for ``Popen`` whose ``wait`` never returns the process (and fails on a wait without a
  bound), run through the supervisor's own loop with its store and death notices real: everywhere.

Also here: the judge refusing asks that are not about its process, said once per ask."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist

from ncclguard.store.asks import JudgeAsk, post_ask, read_ask
from ncclguard.store.codec import encode
from ncclguard.store.deaths import STUCK_RC, read_deaths
from ncclguard.supervise import loop
from ncclguard.supervise.judge import POLL_S, Ended, StuckWatch
from ncclguard.supervise.parent import ParentWatch

KILL_WAIT_S = 0.5  # the supervisor's bound in these tests (10 s by default)
GUARD_S = 30.0  # a hang guard for a supervisor's process (it imports torch: seconds on a loaded machine)
FREEZER = Path("/sys/fs/cgroup/freezer")

# Life 0 sleeps until killed; life 1 exits 0 at once.
RANK = """
import os, sys, time
from pathlib import Path
out, life = Path(sys.argv[1]), int(os.environ["NCCLGUARD_RESTART_COUNT"])
(out / f"pid{life}").write_text(str(os.getpid()))
while life == 0:
    time.sleep(0.05)
"""
# A supervisor with a short kill wait and stop grace: argv[1] restarts, argv[2] the kill wait, then the command.
SUPERVISOR = """
import sys
from ncclguard.supervise.loop import Supervisor
sys.exit(Supervisor(sys.argv[3:], int(sys.argv[1]), kill_wait_s=float(sys.argv[2]), stop_grace_s=0.3).run())
"""


def _wait_for(what: str, fn: Any, timeout_s: float = GUARD_S) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout_s} s")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


@pytest.fixture
def job(monkeypatch) -> dist.TCPStore:
    """A job's store; this process's environment names it, launch rank 1, no torchrun restart count."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for name, value in (("RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(server.port))):
        monkeypatch.setenv(name, value)
    return server


# ---------------------------------------------------------------------------------------------
# The stand-in: the supervisor's loop, its store and its notices real, its rank's process not.


class _Unreapable:
    """A ``Popen`` of a process in uninterruptible sleep: it takes signals, and never ends."""

    def __init__(self, pid: int) -> None:
        self.pid, self.stdin = pid, None
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        assert timeout is not None, "an unbounded wait on a process that may never end"
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("rank", timeout)

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)


class _Exits(_Unreapable):
    """A ``Popen`` of a process that ends with ``rc`` at the first wait."""

    def __init__(self, pid: int, rc: int) -> None:
        super().__init__(pid)
        self.rc = rc

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self.rc
        return self.rc


class _Judge:
    """A StuckWatch that ends ``target`` as stuck at its first look (the real one's SIGKILL is the
    stand-in's ``kill``), posting its death as the real one does for a ``stuck`` ask with ``heal``."""

    def __init__(self, target: _Unreapable) -> None:
        self.target = target
        self.ended_at: float | None = None

    def follow(self, proc: Any) -> None:
        pass

    def look(self, proc: Any, can_restart: bool) -> Ended | None:
        if proc is not self.target or self.ended_at is not None:
            return None
        proc.kill()
        self.ended_at = time.monotonic()
        return Ended(proc.pid, "peers", "a test's ask", can_restart, post=True)


def _supervisor(monkeypatch, lives: list[_Unreapable], restarts: int, judge: _Judge | None) -> loop.Supervisor:
    sup = loop.Supervisor(["rank"], restarts, kill_wait_s=KILL_WAIT_S, stop_grace_s=0.2)
    sup.parent = ParentWatch(prctl=False)  # no death signal set on the test's own process
    monkeypatch.setattr(sup, "_start", lambda restart: lives[restart])
    if judge is not None:
        monkeypatch.setattr(loop, "StuckWatch", lambda origin, store, say: judge)
    return sup


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_stuck_rank_that_sigkill_does_not_end_has_its_death_posted_within_the_bound(
    job, monkeypatch, capfd, restarts
):
    """Ended as stuck, never reaped: KILL_WAIT_S after the SIGKILL its death is posted as the reaped
    case posts it (a kill with a restart to come, else STUCK_RC); then it is restarted beside the
    old process, or the supervisor exits 0 (the survivors go on)."""
    stuck = _Unreapable(4_000_001)  # no such pid: /proc says "?"
    lives = [stuck, _Exits(4_000_002, 0)]
    judge = _Judge(stuck)
    sup = _supervisor(monkeypatch, lives, restarts, judge)
    rc = sup.run()
    took = time.monotonic() - judge.ended_at  # type: ignore[operator]
    err = capfd.readouterr().err
    assert rc == 0, err
    assert stuck.signals == [signal.SIGKILL]
    # The bound, then the post and the rest; the upper one is a hang guard.
    assert KILL_WAIT_S <= took < KILL_WAIT_S + 15.0, took
    assert sup.unreaped == [stuck.pid]
    _, notices = read_deaths(job, 0)
    assert [(n.origin, n.pid, n.returncode, n.life) for n in notices] == [
        (1, stuck.pid, -9 if restarts else STUCK_RC, 0)
    ]
    assert f"the rank (pid {stuck.pid}) was sent SIGKILL {KILL_WAIT_S:g} s ago and is not reaped (state ?" in err
    if restarts:
        assert sup.lives == [-9, 0] and f"(pid {stuck.pid}) was not reaped; restart 1 of 1" in err
    else:
        assert sup.lives == [-9] and "exiting 0, no restart" in err


def test_a_stopped_rank_that_sigkill_does_not_end_leaves_the_supervisor_exiting_137(job, monkeypatch, capfd):
    """Told to stop: SIGTERM, SIGKILL after the grace, and KILL_WAIT_S later the supervisor exits
    128 + SIGKILL, as for a rank the SIGKILL ended; no death notice (a stop posts none), no restart."""
    deaf = _Unreapable(4_000_003)
    sup = _supervisor(monkeypatch, [deaf], 1, None)
    stop = threading.Timer(0.1, sup._stop, (int(signal.SIGTERM), int(signal.SIGTERM)))
    stop.start()
    start = time.monotonic()
    rc = sup.run()
    took = time.monotonic() - start
    stop.join(5)
    err = capfd.readouterr().err
    assert rc == 128 + signal.SIGKILL, err
    assert deaf.signals == [signal.SIGTERM, signal.SIGKILL]
    assert 0.1 + 0.2 + KILL_WAIT_S <= took < 0.1 + 0.2 + KILL_WAIT_S + 15.0, took  # the upper bound: a hang guard
    assert read_deaths(job, 0) == (0, [])
    assert f"(pid {deaf.pid}) was not reaped after signal 15: told to stop, it stays down" in err


def test_a_warm_spare_that_sigkill_does_not_end_is_let_go_within_the_bound(capfd):
    spare = loop._Spare.__new__(loop._Spare)
    proc = _Unreapable(4_000_004)
    spare.proc = proc  # type: ignore[assignment]
    start = time.monotonic()
    spare.discard(KILL_WAIT_S)
    assert time.monotonic() - start < 2.0 + KILL_WAIT_S + 1.0
    assert proc.signals == [signal.SIGKILL]
    assert "the warm spare (pid 4000004) was sent SIGKILL 0.5 s ago and is not reaped" in capfd.readouterr().err


def test_the_kill_wait_is_a_number_of_seconds_above_0():
    for bad in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="kill wait"):
            loop.Supervisor(["rank"], 0, kill_wait_s=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# For real: a process in a frozen cgroup v1 freezer.


@pytest.fixture
def freezer(tmp_path) -> Iterator[Path]:
    """A cgroup v1 freezer of this test's own, thawed and removed at the end (its processes let die)."""
    group = FREEZER / f"ncclguard-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
        (group / "freezer.state").write_text("THAWED")
    except OSError as exc:
        pytest.skip(f"no cgroup v1 freezer to write here ({exc}): root and {FREEZER} are needed")
    try:
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        _wait_for("the frozen processes gone", lambda: not (group / "cgroup.procs").read_text().split(), 10.0)
        group.rmdir()


def _freeze(group: Path, pid: int) -> None:
    (group / "cgroup.procs").write_text(str(pid))
    (group / "freezer.state").write_text("FROZEN")
    _wait_for("a frozen cgroup", lambda: (group / "freezer.state").read_text().strip() == "FROZEN", 10.0)


def _supervise(job: dist.TCPStore, out: Path, restarts: int) -> subprocess.Popen[str]:
    """The supervisor of launch rank 1, its standard error (and its rank's) to ``out/err``: a pipe would
    not end while the frozen process, which holds it too, lives."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    env.update(RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port))
    argv = [sys.executable, "-c", SUPERVISOR, str(restarts), str(KILL_WAIT_S), sys.executable, "-c", RANK, str(out)]
    with (out / "err").open("w") as err:
        return subprocess.Popen(argv, env=env, stderr=err, text=True)


def _end(sup: subprocess.Popen[str], out: Path) -> str:
    """Ends the supervisor and what it started (after a failure half-way); its standard error."""
    if sup.poll() is None:
        for proc in [*psutil.Process(sup.pid).children(recursive=True), psutil.Process(sup.pid)]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        sup.wait(timeout=GUARD_S)
    return (out / "err").read_text()


def test_a_frozen_rank_ended_as_stuck_is_posted_dead_and_restarted_beside_it(job, freezer, tmp_path):
    """A real process SIGKILL does not end: its supervisor posts its death as a kill KILL_WAIT_S after
    the SIGKILL, while it is still there in ``D``, then restarts the rank (life 1 exits 0) and exits 0."""
    sup = _supervise(job, tmp_path, restarts=1)
    try:
        pid0 = int(_wait_for("life 0", lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid0").read_text()))
        _freeze(freezer, pid0)
        asked = time.monotonic()
        post_ask(job, JudgeAsk(origin=1, pid=pid0, judged="stuck", heal=True, still_s=2.0, asker=0, at=time.time()))
        _, notices = _wait_for("a death notice", lambda: read_deaths(job, 0)[0] and read_deaths(job, 0))
        took = time.monotonic() - asked
        state_at_post = _state(pid0)
        rc = sup.wait(timeout=GUARD_S)
        state_at_exit = _state(pid0)
    finally:
        err = _end(sup, tmp_path)
    assert rc == 0, err
    assert [(n.origin, n.pid, n.returncode, n.life) for n in notices] == [(1, pid0, -9, 0)]
    # The next poll reads the ask (POLL_S), SIGKILL, the bound, the post.
    assert KILL_WAIT_S <= took < POLL_S + KILL_WAIT_S + 3.0, took
    assert state_at_post == "D" and state_at_exit == "D", (state_at_post, state_at_exit)
    assert f"the rank (pid {pid0}) was sent SIGKILL {KILL_WAIT_S:g} s ago and is not reaped (state D" in err
    assert f"(pid {pid0}) was not reaped; restart 1 of 1" in err
    assert (tmp_path / "pid1").exists()


def test_a_frozen_rank_told_to_stop_leaves_its_supervisor_exiting_137(job, freezer, tmp_path):
    sup = _supervise(job, tmp_path, restarts=1)
    try:
        pid0 = int(_wait_for("life 0", lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid0").read_text()))
        _freeze(freezer, pid0)
        start = time.monotonic()
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(timeout=GUARD_S)
        took = time.monotonic() - start
        state = _state(pid0)
    finally:
        err = _end(sup, tmp_path)
    assert rc == 128 + signal.SIGKILL, err
    # The upper bound is a hang guard: a loaded CI run here took 3.9 s (0.8 s of bounds, the rest the
    # supervisor's start and exit); 15 s is over 3x that.
    assert 0.3 + KILL_WAIT_S <= took < 0.3 + KILL_WAIT_S + 15.0, took
    assert state == "D"
    assert "did not end within 0.3 s of the stop; SIGKILL" in err
    assert f"(pid {pid0}) was not reaped after signal 15: told to stop, it stays down" in err
    assert read_deaths(job, 0) == (0, []) and not (tmp_path / "pid1").exists()


# ---------------------------------------------------------------------------------------------
# The judge: asks that are not about its process are refused, said once each, never acted on.


def test_asks_not_about_the_supervisors_process_are_refused_and_said_once_each(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.HashStore()
    said: list[str] = []
    watch = StuckWatch(1, lambda: store, said.append)
    earlier = subprocess.Popen([sys.executable, "-c", "pass"])
    earlier.wait(timeout=GUARD_S)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch.follow(earlier)
        watch.follow(rank)  # restarted: ``earlier`` was its first life

        for origin, pid, at in ((5, rank.pid, 1.0), (1, earlier.pid, 2.0), (1, 4_000_005, 3.0)):
            ask = JudgeAsk(origin=origin, pid=pid, judged="stuck", heal=True, still_s=2.0, asker=0, at=at)
            store.set("ncclguard/ask/0/1", encode(ask))  # under launch rank 1's key, whatever it names
            assert [watch.look(rank, True) for _ in range(3)] == [None, None, None]  # three polls, one line
        bad = {**ask.model_dump(), "pid": rank.pid, "still_s": 1e9, "at": 4.0}  # a window out of bounds
        store.set("ncclguard/ask/0/1", json.dumps(bad))
        assert read_ask(store, 1) is None and watch.look(rank, True) is None  # not an ask: read as none
        assert rank.poll() is None  # never acted on
    finally:
        rank.kill()
        rank.wait(timeout=GUARD_S)
    assert said == [
        "an ask about launch rank 1 names launch rank 5, not this supervisor's: refused, nothing done",
        f"an ask about launch rank 1 names pid {earlier.pid}, an earlier process of this rank (it runs as pid "
        f"{rank.pid} now): refused, nothing done",
        f"an ask about launch rank 1 names pid 4000005, neither this supervisor's rank (pid {rank.pid}) nor a "
        "process it started: refused, nothing done",
    ]
