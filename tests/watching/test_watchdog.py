"""WatchdogConfig's invariants and the Watchdog's life cycle in this process (no process group:
a world of one, incidents handled locally). The multi-rank behaviour is in
tests/watching/test_watchdog_multirank.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import wait_for
from pydantic import ValidationError

from ncclguard import WatchdogConfig, current_watchdog, start_watchdog
from ncclguard.recording.instrument import is_instrumented
from ncclguard.testing.launch import free_port
from ncclguard.watching.base.settings import LADDERS
from ncclguard.watching.base.watchdog_store import Keys
from ncclguard.watching.watchdog import ACTIONS, EXIT_CODE, Watchdog


def test_defaults_and_derived_values():
    cfg = WatchdogConfig()
    assert (cfg.heartbeat_s, cfg.hang_timeout_s, cfg.action, cfg.exit_code) == (5.0, 300.0, "report", EXIT_CODE)
    assert (cfg.peer_timeout, cfg.merge_wait, cfg.store_timeout) == (30.0, 10.0, 5.0)
    assert cfg.ladder == ("report",)
    quick = WatchdogConfig(heartbeat_s=0.5, hang_timeout_s=2, action="exit")
    assert (quick.peer_timeout, quick.merge_wait, quick.store_timeout) == (3.0, 1.0, 0.5)
    assert quick.ladder == LADDERS["exit"] == ("report", "raise", "abort", "exit")
    assert ACTIONS == ("report", "raise", "abort", "fence", "exit")
    fence = WatchdogConfig(heartbeat_s=0.5, hang_timeout_s=2, action="fence", escalate_after_s=3)
    assert (fence.ladder, fence.fence_after) == (("report", "abort", "fence"), 3.0)  # default: escalate_after_s


@pytest.mark.parametrize(
    "fields, phrase",
    [
        ({"heartbeat_s": 5, "hang_timeout_s": 5}, "hang_timeout_s (5.0) must be > heartbeat_s (5.0)"),
        (
            {"heartbeat_s": 1, "hang_timeout_s": 10, "peer_timeout_s": 1.5},
            "peer_timeout_s (1.5) must be >= 2 * heartbeat_s (1.0)",
        ),
        ({"heartbeat_s": 0}, "greater than 0"),
        ({"escalate_after_s": -1}, "greater than 0"),
        ({"action": "kill"}, "'report', 'raise', 'abort', 'fence' or 'exit'"),
        ({"fence_after_s": 0}, "greater than 0"),
        (
            {"action": "fence", "heartbeat_s": 1, "hang_timeout_s": 5, "fence_after_s": 1.5},
            "fence_after_s (1.5) must be >= merge_wait (2.0)",
        ),
        ({"exit_code": 0}, "greater than or equal to 1"),
        ({"exit_code": 256}, "less than or equal to 255"),
        ({"raise_signal": "SIGALRM"}, "other than SIGALRM"),
        ({"raise_signal": "SIGNOPE"}, "catchable signal"),
        ({"store_addr": "localhost"}, "'host:port'"),
        ({"session": "a/b"}, "session"),
        ({"heartbeat": 1}, "heartbeat"),
    ],
)
def test_bad_settings_say_what_is_wrong(fields, phrase):
    with pytest.raises(ValidationError) as info:
        WatchdogConfig(**fields)
    assert phrase in str(info.value)


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_ACTION", "exit")
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_HEARTBEAT_S", "0.5")
    monkeypatch.setenv("NCCLGUARD_WATCHDOG_HANG_TIMEOUT_S", "2")
    cfg = WatchdogConfig()
    assert (cfg.action, cfg.heartbeat_s, cfg.hang_timeout_s, cfg.peer_timeout) == ("exit", 0.5, 2.0, 3.0)


def test_keywords_override_a_config():
    base = WatchdogConfig(heartbeat_s=1, hang_timeout_s=10, action="raise")
    wd = Watchdog(base, hang_timeout_s=20)
    assert (wd.config.heartbeat_s, wd.config.hang_timeout_s, wd.config.action) == (1.0, 20.0, "raise")
    with pytest.raises(TypeError, match="WatchdogConfig"):
        Watchdog({"heartbeat_s": 1})


def test_one_watchdog_per_process_and_stop_restores_everything(tmp_path):
    assert not dist.is_initialized()
    before = signal.getsignal(signal.SIGUSR2)
    wd = start_watchdog(heartbeat_s=0.1, hang_timeout_s=1, action="raise", incident_dir=tmp_path)
    try:
        assert current_watchdog() is wd
        assert is_instrumented("all_reduce")
        assert signal.getsignal(signal.SIGUSR2) == wd._on_signal
        with pytest.raises(RuntimeError, match="already runs in this process"):
            Watchdog(heartbeat_s=0.1, hang_timeout_s=1).start()
    finally:
        wd.stop()
    assert current_watchdog() is None
    assert not is_instrumented("all_reduce")
    assert signal.getsignal(signal.SIGUSR2) == before
    # stop() waits 0.3 s here (two store timeouts and a beat), which a thread starved on a loaded machine
    # can outlast: the stopped threads are waited for to end, within a hang guard (30 s).
    for t in [t for t in threading.enumerate() if t.name == "ncclguard-watchdog"]:
        t.join(30)
    assert not any(t.name == "ncclguard-watchdog" for t in threading.enumerate())
    assert wd.incidents == []


def test_raise_needs_the_main_thread_to_install_its_handler(tmp_path):
    seen = []

    def body():
        try:
            Watchdog(heartbeat_s=0.1, hang_timeout_s=1, action="raise", incident_dir=tmp_path).start()
        except RuntimeError as exc:
            seen.append(str(exc))

    t = threading.Thread(target=body)
    t.start()
    t.join(60)  # a hang guard (a loaded machine may start a thread, and import, seconds late)
    assert len(seen) == 1 and "start the watchdog from the main thread" in seen[0]
    assert current_watchdog() is None
    # action report needs no handler: any thread may start it.
    started = []
    t = threading.Thread(
        target=lambda: started.append(Watchdog(heartbeat_s=0.1, hang_timeout_s=1, incident_dir=tmp_path).start())
    )
    t.start()
    t.join(60)  # a hang guard, as above
    started[0].stop()
    assert current_watchdog() is None


def test_exit_waits_for_an_incidents_picture_instead_of_dying_of_sigabrt(tmp_path):
    """A job whose last line comes while its watchdog still draws a reported incident's timeline.png
    (seen: the pytest process of tests/recovery/test_commit.py aborted at exit 1 run in 5, status 134,
    gdb showing the drawing thread in matplotlib's ft2font as it was ended). Worker:
    tests/workers/exit_drawing_worker.py, once without the exit wait and once with it."""
    worker = str(Path(__file__).parents[1] / "workers" / "exit_drawing_worker.py")
    runs = {}
    for mode in ("off", "on"):
        # 120 s: hang guard (each run takes 2-9 s here: matplotlib's import, a 2 s delay, the drawing)
        runs[mode] = subprocess.run(
            [sys.executable, worker, mode, str(tmp_path / mode)], capture_output=True, text=True, timeout=120
        )
    off, on = runs["off"], runs["on"]
    # Without the wait, finalization begins with the drawing under way (its thread is then ended inside
    # the interpreter's teardown, or inside matplotlib: status 134).
    assert "settled" in off.stdout and "drawings under way at finalization: 1" in off.stdout, off
    assert off.returncode in (0, -signal.SIGABRT), off
    # With it, exit waits for the drawing: the picture is on disk and nothing aborts.
    assert "settled" in on.stdout and "drawings under way at finalization: 0" in on.stdout, on
    assert on.returncode == 0 and "terminate called" not in on.stderr, on
    assert [p.name for p in (tmp_path / "on").glob("*/timeline.png")] == ["timeline.png"]


def test_a_store_that_answers_late_is_joined_and_one_that_never_answers_leaves_the_rank_alone(
    tmp_path, monkeypatch, caplog
):
    # Rank 0 of 2 (no process group: the launcher's environment). On a loaded CI host rank 0's
    # watchdog once missed its first connect's 0.3 s bound to the store its own process served, and
    # handled its incidents alone for the whole job: the other ranks' merged report lacked its statement.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    port = free_port()
    caplog.set_level(logging.INFO, logger="ncclguard")
    wd = start_watchdog(
        heartbeat_s=0.1, hang_timeout_s=5, incident_dir=tmp_path, store_addr=f"127.0.0.1:{port}", instrument=False
    )
    try:
        wait_for(lambda: "trying on for 60 s" in caplog.text, 60, "the warning of a store that did not answer")
        assert wd.watch.desk.store is None
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        beat = Keys.from_env("main").heartbeat(0)
        wait_for(lambda: server.check([beat]), 60, "rank 0's first heartbeat once the store is up")
        assert "could not connect" not in caplog.text
    finally:
        wd.stop()
    # A store that never answers within startup_grace_s: said once, and the watchdog goes on alone.
    caplog.clear()
    port = free_port()
    wd = start_watchdog(
        heartbeat_s=0.1,
        hang_timeout_s=5,
        incident_dir=tmp_path,
        store_addr=f"127.0.0.1:{port}",
        startup_grace_s=1.0,
        instrument=False,
    )
    try:
        wait_for(lambda: "could not connect to the store" in caplog.text, 60, "the give-up line")
        assert wd.watch.desk.store is None and wd.watch.desk.connecting is None and wd._thread.is_alive()
        assert caplog.text.count("could not connect to the store") == 1
    finally:
        wd.stop()


def test_a_process_that_ends_while_its_watchdog_still_tries_to_reach_the_store_exits_cleanly(tmp_path):
    # Each try of the first connect is a c10d call on a thread of its own; finalizing the interpreter
    # with a thread inside torch aborts it (docs/run.md). The tries are counted as calls under way,
    # which exit waits for, and a try's bound is below that wait.
    port = free_port()
    code = (
        "import atexit, threading, time, ncclguard\n"
        "def last():\n"  # registered first, so it runs after the library's exit hooks
        "    tries = [t for t in threading.enumerate() if t.name == 'ncclguard-store-connect']\n"
        "    [t.join(2.0) for t in tries]\n"
        "    print('tries at finalization:', sum(t.is_alive() for t in tries), flush=True)\n"
        "atexit.register(last)\n"
        f"ncclguard.start_watchdog(heartbeat_s=0.1, hang_timeout_s=5, incident_dir={str(tmp_path)!r}, "
        f"store_addr='127.0.0.1:{port}', instrument=False)\n"
        "time.sleep(1.0)\n"
        "print('leaving', flush=True)\n"
    )
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    # 120 s: hang guard (the run takes 3-10 s: the import, 1 s of tries, the exit's wait for the try under way)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0 and "leaving" in run.stdout, run
    # The try under way at exit (a refused connect is tried again for the try's whole 3 s bound) was
    # waited for: no thread was left inside torch. Without the wait, one was (checked by hand).
    assert "tries at finalization: 0" in run.stdout, run
    assert "trying on for 60 s" in run.stderr and "terminate called" not in run.stderr, run
