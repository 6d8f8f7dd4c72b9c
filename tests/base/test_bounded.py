"""ncclguard.store.bounded: a store call returns by its deadline even when the store's host is cut off."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import wait_for

from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.store.bounded import bounded_store_call, helper_for


class FrozenStore:
    """A store whose host stopped answering: each call blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def add(self, key: str, n: int) -> int:
        self.calls += 1
        self.release.wait(30)
        return n


def test_a_call_that_answers_returns_its_value_and_its_errors():
    store = object()
    # 30 s: hang guards; the calls answer at once, but a loaded machine may run the helper seconds late.
    assert bounded_store_call(store, lambda: 41 + 1, Deadline.within(30.0)) == 42
    with pytest.raises(KeyError, match="nope"):
        bounded_store_call(store, lambda: {}["nope"], Deadline.within(30.0))


def test_a_frozen_store_is_given_up_at_the_deadline_then_refused_at_once():
    store = FrozenStore()
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="did not answer within 0.3"):
        bounded_store_call(store, lambda: store.add("k", 1), Deadline.within(0.3), "round 'x'")
    # After the deadline; a hang guard above it, well below the 30 s the frozen call blocks.
    assert 0.3 <= time.monotonic() - t0 < 10.0
    # While the first call is stuck, the next is refused without another blocked thread.
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="earlier call to the store has not returned"):
        bounded_store_call(store, lambda: store.add("k", 1), Deadline.within(30.0))
    # At once, not the 30 s it was given: a hang guard a loaded machine's scheduling cannot reach.
    assert time.monotonic() - t0 < 10.0 and store.calls == 1
    # Once the stuck call returns, the store is used again.
    store.release.set()
    # Until the stuck call has returned: polled, not a sleep a loaded machine may outlast (hang guard 30 s).
    helper = helper_for(store)
    wait_for(lambda: not helper.busy(), 30, "return of the released call")
    assert bounded_store_call(store, lambda: store.add("k", 7), Deadline.within(30.0)) == 7


def test_exit_waits_for_a_store_call_under_way_instead_of_dying_of_sigabrt():
    """A job that ends while a helper is inside a store call (CI: a two-rank job ended 0.3 s after its
    start, the watchdog's first connect still under way, and its rank died of SIGABRT)."""
    worker = str(Path(__file__).parents[1] / "workers" / "exit_mid_call_worker.py")
    runs = {}
    for mode in ("off", "on"):
        # 60 s: hang guard (each run takes 4-11 s here: a 3 s call, a 6 s teardown)
        runs[mode] = subprocess.run([sys.executable, worker, mode], capture_output=True, text=True, timeout=60)
    off, on = runs["off"], runs["on"]
    # Without the wait, finalization begins with the call under way (and the process then dies of SIGABRT
    # when the call comes back during it: each time on a quiet machine, not always on a loaded one).
    assert "given up, the call still under way" in off.stdout and "under way at finalization: 1" in off.stdout, off
    assert off.returncode in (0, -signal.SIGABRT), off
    # With it, exit waits for the call: none is under way when finalization begins, and nothing aborts.
    assert "given up, the call still under way" in on.stdout and "under way at finalization: 0" in on.stdout, on
    assert on.returncode == 0 and "terminate called" not in on.stderr, on


def test_exit_stops_a_poller_before_it_waits_so_no_call_starts_into_finalization():
    """A poller (the left-behind fence, the verdict) that could start a store call after the exit's wait
    had seen none under way would leave it running into finalization (the SIGABRT above)."""
    worker = str(Path(__file__).parents[1] / "workers" / "exit_mid_call_worker.py")
    # 60 s: hang guard (about 4 s here: the last call's 3 s wait). Without the stop, the wait never ends.
    run = subprocess.run([sys.executable, worker, "poller"], capture_output=True, text=True, timeout=60)
    assert "the poller polls" in run.stdout, run
    stopped = re.search(r"poller stopped at exit after (\d+) calls", run.stdout)
    assert stopped and int(stopped.group(1)) >= 1, run
    assert "under way at finalization: 0" in run.stdout, run
    assert run.returncode == 0 and "terminate called" not in run.stderr, run


def test_exit_waits_for_a_call_under_way_until_it_returns_and_leaves_one_past_its_wait():
    from ncclguard.store.bounded import drain_at_exit, in_torch_call

    release, done, started = threading.Event(), threading.Event(), threading.Event()

    def call() -> None:
        in_torch_call(lambda: (started.set(), release.wait(30)), done)  # 30 s: hang guard
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert started.wait(30)
    assert drain_at_exit(0.0) == 1  # older than the wait: left at once (a call to a host that is gone)
    threading.Timer(0.3, release.set).start()
    assert drain_at_exit(30.0) == 0 and done.is_set()  # a young one is waited for until it returns
