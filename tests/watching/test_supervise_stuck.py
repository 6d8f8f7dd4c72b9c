"""The supervisor acts on the waiting ranks' asks about its rank (ncclguard/supervise/judge.py): a real
supervisor process (``python -m ncclguard.supervise``), a real TCPStore, a rank's process that stops
itself (SIGSTOP) or computes. No process group: the asks are written here as a peer's verdict writes
them (ncclguard/recovery/_verdict/levers.py ``ask_supervisor``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

from ncclguard.store.asks import JudgeAnswer, JudgeAsk, post_ask, read_answer, read_ask
from ncclguard.store.deaths import STUCK_RC, read_deaths

# Life 0 stops itself at once. Life 1 computes (its CPU time moves) until told to stop, then stops itself.
RANK = """
import os, signal, sys, time
from pathlib import Path
out, life = Path(sys.argv[1]), int(os.environ["NCCLGUARD_RESTART_COUNT"])
(out / f"pid{life}").write_text(str(os.getpid()))
while life == 1 and not (out / "stop").exists():
    sum(i * i for i in range(20000))
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _wait_for(what, fn, timeout_s: float = 60.0):
    """Polls ``fn`` until it returns something truthy (a bound for a loaded machine, not a speed target)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s} s")


def _end_tree(sup: subprocess.Popen) -> None:
    """Ends the supervisor and every process it started: a test that failed half-way must leave no
    rank behind (a life-1 rank computes until told to stop: it loaded the machine for the tests after)."""
    try:
        kids = psutil.Process(sup.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for proc in [*kids, psutil.Process(sup.pid)] if sup.poll() is None else kids:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _supervised(out, restarts: int = 1) -> tuple[dist.TCPStore, subprocess.Popen]:
    """A job's store and the supervisor of launch rank 1 (``RANK``), its lives writing to ``out``."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    env.update(RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
    argv = [sys.executable, "-m", "ncclguard.supervise", "--restarts", str(restarts), "--", sys.executable, "-c", RANK]
    return server, subprocess.Popen([*argv, str(out)], env=env, stderr=subprocess.PIPE, text=True)


def _ask(store: dist.Store, pid: int, heal: bool, judged: str = "unknown", asker: int = 0) -> None:
    post_ask(store, JudgeAsk(origin=1, pid=pid, judged=judged, heal=heal, still_s=2.0, asker=asker, at=time.time()))


def _answer(store: dist.Store, pid: int) -> JudgeAnswer | None:
    ans = read_answer(store, 1)
    return ans if ans is not None and ans.pid == pid else None


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    """A supervisor of launch rank 1 with 2 restarts, driven through its three cases (see the test)."""
    out = tmp_path_factory.mktemp("stuck")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    env.update(RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
    argv = [sys.executable, "-m", "ncclguard.supervise", "--restarts", "2", "--", sys.executable, "-c", RANK, str(out)]
    sup = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    seen: dict[str, object] = {}
    try:
        pid0 = int(_wait_for("first life", lambda: (out / "pid0").exists() and (out / "pid0").read_text()))
        _wait_for("a stopped process", lambda: psutil.Process(pid0).status() == psutil.STATUS_STOPPED)
        # Asks it must not act on: a value that is not an ask, and an ask about a process it did not start.
        server.set("ncclguard/ask/0/1", "{not json")
        seen["garbage_read"] = read_ask(server, 1)
        _ask(server, os.getpid(), heal=True)
        time.sleep(3.0)  # past the 2 s window: a wrong ask would have ended it by now
        seen["alive_after_foreign_ask"] = psutil.Process(pid0).status() == psutil.STATUS_STOPPED
        # 1. Stopped, heal on, restarts left: ended and restarted.
        _ask(server, pid0, heal=True)
        seen["first"] = _wait_for("an answer about life 0", lambda: _answer(server, pid0))
        pid1 = int(_wait_for("second life", lambda: (out / "pid1").exists() and (out / "pid1").read_text()))
        # 2. Computing: left alone, answered as moving.
        _ask(server, pid1, heal=True)
        seen["busy"] = _wait_for("an answer about life 1", lambda: _answer(server, pid1))
        seen["busy_alive"] = psutil.Process(pid1).status() != psutil.STATUS_STOPPED
        # 3. Then stopped, heal off (a restart is still left): ended, posted as stuck, no restart, exit 0.
        (out / "stop").write_text("")
        _wait_for("life 1 stopped", lambda: psutil.Process(pid1).status() == psutil.STATUS_STOPPED)
        time.sleep(3.0)  # past the 2 s window: the ask answered "moving" is settled, never acted on later
        seen["old_ask_settled"] = psutil.Process(pid1).status() == psutil.STATUS_STOPPED
        _ask(server, pid1, heal=False)
        seen["rc"] = sup.wait(timeout=60)
        seen["last"] = _answer(server, pid1)
        seen["lives"] = sorted(p.name for p in out.glob("pid*"))
        _, seen["notices"] = read_deaths(server, 0)
    finally:
        _end_tree(sup)
        seen["err"] = sup.communicate(timeout=30)[1]
    return pid0, pid1, seen


def test_the_supervisor_ends_its_stuck_rank_restarts_it_to_heal_leaves_a_busy_one_and_exits_0_without_heal(supervised):
    pid0, pid1, seen = supervised
    err = seen["err"]
    assert seen["garbage_read"] is None and seen["alive_after_foreign_ask"] is True, err
    assert (
        f"names pid {os.getpid()}, neither this supervisor's rank (pid {pid0}) nor a process it started: refused" in err
    )
    first = seen["first"]
    assert (first.state, first.restarted) == ("stuck", True), first
    assert "stopped" in first.evidence
    busy = seen["busy"]
    assert busy.state == "moving" and "cpu" in busy.evidence and seen["busy_alive"], busy
    assert seen["old_ask_settled"] is True
    last = seen["last"]
    assert (last.state, last.restarted) == ("stuck", False), last
    assert seen["rc"] == 0, err
    assert seen["lives"] == ["pid0", "pid1"]  # no third life: heal was off
    # Life 0's death as a kill (its restart rejoins: the rebuild waits for it); life 1's as stuck (the
    # rebuild settles without it).
    assert [(n.origin, n.pid, n.returncode, n.life) for n in seen["notices"]] == [
        (1, pid0, -9, 0),
        (1, pid1, STUCK_RC, 1),
    ]
    assert f"launch rank 1 (pid {pid0}, at ?) is stuck: the process is stopped" in err
    assert f"launch rank 1 (pid {pid1}) is behind but moving" in err
    assert "exiting 0, no restart" in err and "restart 1 of 2" in err
    for pid in (pid0, pid1):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_rank_its_peers_judged_stuck_is_ended_after_a_grace_and_never_restarted(tmp_path):
    """The peers judged it stuck, posted its death and went on (an ask ``judged="stuck"`` without
    ``heal``): a rank that cannot exit by itself (stopped) is ended once the grace is over, with no
    restart even though a restart is left, and no second notice."""
    server, sup = _supervised(tmp_path)
    try:
        pid0 = int(_wait_for("first life", lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid0").read_text()))
        _wait_for("a stopped process", lambda: psutil.Process(pid0).status() == psutil.STATUS_STOPPED)
        _ask(server, pid0, heal=False, judged="stuck")
        rc = sup.wait(timeout=60)
    finally:
        _end_tree(sup)
        err = sup.communicate(timeout=30)[1]
    assert rc == 0, err
    ans = _answer(server, pid0)
    assert ans is not None and (ans.state, ans.restarted) == ("stuck", False)
    assert "its peers judged it stuck (asked by launch rank 0)" in ans.evidence
    assert "its peers went on without it: exiting 0, no restart" in err
    assert sorted(p.name for p in tmp_path.glob("pid*")) == ["pid0"]
    assert read_deaths(server, 0) == (0, [])  # the peers post it (STUCK_RC); the supervisor adds nothing


def test_with_heal_a_rank_judged_stuck_is_ended_at_once_and_restarted_then_posted_stuck_with_no_restart_left(tmp_path):
    """The engine heals (an ask ``judged="stuck"`` with ``heal``: the askers posted nothing). With a
    restart left the supervisor ends the rank at once, posts its death as a kill (the rebuild waits for
    the restart) and restarts it; the new process, asked about while it computes, is left alone (the
    supervisor's own samples veto the kill); once stopped and judged stuck again it has no restart
    left: it is ended, posted as stuck (the rebuild settles without it) and the supervisor exits 0."""
    server, sup = _supervised(tmp_path)
    try:
        pid0 = int(_wait_for("first life", lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid0").read_text()))
        _wait_for("a stopped process", lambda: psutil.Process(pid0).status() == psutil.STATUS_STOPPED)
        _ask(server, pid0, heal=True, judged="stuck")
        pid1 = int(_wait_for("a restart", lambda: (tmp_path / "pid1").exists() and (tmp_path / "pid1").read_text()))
        first = _answer(server, pid0)
        n, notices = read_deaths(server, 0)
        # Computing, asked to end it as stuck: the supervisor's own samples see it moving and veto the kill.
        time.sleep(3.0)  # its samples of the new process cover the 2 s window
        _ask(server, pid1, heal=True, judged="stuck")
        vetoed = _wait_for("an answer about life 1", lambda: _answer(server, pid1))
        vetoed_alive = psutil.Process(pid1).status() != psutil.STATUS_STOPPED
        (tmp_path / "stop").write_text("")
        _wait_for("a stopped restart", lambda: psutil.Process(pid1).status() == psutil.STATUS_STOPPED)
        _ask(server, pid1, heal=True, judged="stuck", asker=1)
        rc = sup.wait(timeout=60)
    finally:
        _end_tree(sup)
        err = sup.communicate(timeout=30)[1]
    assert rc == 0, err
    # The first: ended at once (no grace), restarted, its death posted as a kill by the supervisor.
    assert first is not None and (first.state, first.restarted) == ("stuck", True), first
    assert "its peers agreed it is stuck (asked by launch rank 0)" in first.evidence
    assert n == 1 and [(d.origin, d.pid, d.returncode, d.life) for d in notices] == [(1, pid0, -9, 0)], notices
    assert (vetoed.state, vetoed.restarted) == ("moving", False) and "cpu" in vetoed.evidence, vetoed
    assert vetoed_alive and "but this supervisor sees it moving" in err, err
    # The second: no restart left, posted as stuck, exit 0.
    second = _answer(server, pid1)
    assert second is not None and (second.state, second.restarted) == ("stuck", False), second
    assert "it judged itself stuck (asked by launch rank 1)" in second.evidence
    _, notices = read_deaths(server, 0)
    assert [(d.origin, d.pid, d.returncode, d.life) for d in notices] == [(1, pid0, -9, 0), (1, pid1, STUCK_RC, 1)]
    assert "restart 1 of 1" in err and "has no restart left: exiting 0, no restart" in err, err
    for pid in (pid0, pid1):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_lone_waiting_ranks_confirm_ask_ends_the_rank_only_when_the_supervisor_sees_it_stuck_too(tmp_path):
    """The only waiting rank judged its peer stuck (no other rank waits to agree): one view, so it asks
    ``judged="confirm"`` (ncclguard/watching/judge/rules.py ``rule_peer``). The supervisor's own look
    is the second view: a stopped process is ended (restarted to heal, its death posted as a kill); a
    computing one is answered moving and left alone; stopped later, with no restart left, it is ended
    and posted as stuck."""
    server, sup = _supervised(tmp_path)
    try:
        pid0 = int(_wait_for("first life", lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid0").read_text()))
        _wait_for("a stopped process", lambda: psutil.Process(pid0).status() == psutil.STATUS_STOPPED)
        time.sleep(3.0)  # its samples cover the 2 s window
        _ask(server, pid0, heal=True, judged="confirm")
        pid1 = int(_wait_for("a restart", lambda: (tmp_path / "pid1").exists() and (tmp_path / "pid1").read_text()))
        first = _answer(server, pid0)
        time.sleep(3.0)  # its samples of the new process cover the 2 s window
        _ask(server, pid1, heal=True, judged="confirm")
        busy = _wait_for("an answer about life 1", lambda: _answer(server, pid1))
        busy_alive = psutil.Process(pid1).status() != psutil.STATUS_STOPPED
        (tmp_path / "stop").write_text("")
        _wait_for("a stopped restart", lambda: psutil.Process(pid1).status() == psutil.STATUS_STOPPED)
        time.sleep(3.0)
        _ask(server, pid1, heal=True, judged="confirm")
        rc = sup.wait(timeout=60)
    finally:
        _end_tree(sup)
        err = sup.communicate(timeout=30)[1]
    assert rc == 0, err
    assert first is not None and (first.state, first.restarted) == ("stuck", True) and "stopped" in first.evidence
    assert (busy.state, busy.restarted) == ("moving", False) and "cpu" in busy.evidence and busy_alive, busy
    assert f"launch rank 1 (pid {pid1}) is behind but moving" in err, err
    last = _answer(server, pid1)
    assert last is not None and (last.state, last.restarted) == ("stuck", False) and "stopped" in last.evidence
    _, notices = read_deaths(server, 0)
    assert [(d.origin, d.pid, d.returncode, d.life) for d in notices] == [(1, pid0, -9, 0), (1, pid1, STUCK_RC, 1)]
