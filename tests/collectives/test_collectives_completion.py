"""ncclguard.collectives.completion: waiting on a real torch Future completed from another thread,
and the GPU watcher's logic with events that block like ``torch.cuda.Event.synchronize``.

No GPU here: the watcher is driven by objects whose ``synchronize()`` blocks on a
``threading.Event``, which is the contract the watcher relies on. Speeds are not asserted
(benchmarks/completion_wakeup.py measures the wake-up latency).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from ncclguard.collectives import completion
from ncclguard.collectives.completion import DeadlinePassed, wait_future, watcher_for


class BlockingEvent:
    """Stands for ``torch.cuda.Event(blocking=True)``: ``synchronize()`` blocks until ``fire()``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        self._error = error

    def fire(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def _complete_later(fut: torch.futures.Future, after_s: float, error: BaseException | None = None) -> threading.Thread:
    def run() -> None:
        time.sleep(after_s)
        if error is None:
            fut.set_result(7)
        else:
            fut.set_exception(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_wait_future_returns_when_another_thread_completes_it():
    fut: torch.futures.Future = torch.futures.Future()
    thread = _complete_later(fut, 0.05)
    t0 = time.monotonic()
    wait_future(fut, time.monotonic() + 30)
    assert fut.done() and fut.value() == 7
    assert time.monotonic() - t0 < 10  # woken by the completion, long before the 30 s deadline (a hang guard)
    thread.join(30)


def test_wait_future_gives_up_at_the_deadline_and_a_late_completion_is_harmless():
    fut: torch.futures.Future = torch.futures.Future()
    t0 = time.monotonic()
    with pytest.raises(DeadlinePassed):
        wait_future(fut, t0 + 0.2)
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 10  # the deadline was waited; the upper bound is a hang guard
    fut.set_result(1)  # the callback of the abandoned wait runs and changes nothing
    assert fut.value() == 1


def test_wait_future_raises_the_error_the_future_was_completed_with():
    fut: torch.futures.Future = torch.futures.Future()
    thread = _complete_later(fut, 0.02, RuntimeError("NCCL error: unhandled system error"))
    with pytest.raises(RuntimeError, match="unhandled system error"):
        wait_future(fut, time.monotonic() + 30)  # a hang guard
    thread.join(30)


def test_an_already_completed_future_returns_at_once_even_past_its_deadline():
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    wait_future(fut, time.monotonic() - 1)  # done before the deadline was looked at: not a timeout


def test_the_check_ends_a_wait_whose_future_never_completes():
    fut: torch.futures.Future = torch.futures.Future()
    calls = []

    def check() -> bool:
        calls.append(time.monotonic())
        return len(calls) >= 3  # "the op failed" learned on the third look

    t0 = time.monotonic()
    wait_future(fut, t0 + 60, check=check)
    assert len(calls) == 3
    assert time.monotonic() - t0 < 20  # three periods of CHECK_PERIOD_S, not the 60 s deadline (a hang guard)
    assert not fut.done()


def test_watcher_completes_the_future_only_once_the_event_completed():
    event = BlockingEvent()
    fut = watcher_for("group-a", event)
    time.sleep(0.05)
    assert not fut.done()  # the watcher sleeps in synchronize()
    event.fire()
    wait_future(fut, time.monotonic() + 10)
    assert fut.done()


def test_watcher_passes_on_the_error_of_synchronize():
    event = BlockingEvent(error=RuntimeError("CUDA error: an illegal memory access was encountered"))
    fut = watcher_for("group-b", event)
    event.fire()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        wait_future(fut, time.monotonic() + 10)


def test_a_hung_group_holds_up_only_its_own_watcher():
    hung = BlockingEvent()
    watcher_for("group-hung", hung)  # never fires: a collective that never ends
    other = BlockingEvent()
    fut = watcher_for("group-ok", other)
    other.fire()
    wait_future(fut, time.monotonic() + 10)  # completes although group-hung's watcher is stuck
    later_event = BlockingEvent()
    later = watcher_for("group-hung", later_event)
    assert not later.done()  # queued behind the hung event, in order
    hung.fire()
    later_event.fire()
    wait_future(later, time.monotonic() + 10)


def test_events_of_one_group_complete_in_submission_order():
    events = [BlockingEvent() for _ in range(3)]
    futs = [watcher_for("group-order", e) for e in events]
    events[2].fire()
    time.sleep(0.05)
    assert not any(f.done() for f in futs)  # the first is still running on the stream
    for e in events[:2]:
        e.fire()
    for f in futs:
        wait_future(f, time.monotonic() + 10)


def test_an_idle_watcher_exits_and_a_new_one_starts_on_demand(monkeypatch):
    monkeypatch.setattr(completion, "_IDLE_EXIT_S", 0.05)
    event = BlockingEvent()
    fut = watcher_for("group-idle", event)
    # Taken while its event has not fired: a watcher done with its work may exit 0.05 s later, before
    # a loaded machine runs the next line.
    first = completion._watchers["group-idle"]
    event.fire()
    wait_future(fut, time.monotonic() + 30)  # a hang guard
    first._thread.join(30)  # a hang guard
    assert not first._thread.is_alive() and "group-idle" not in completion._watchers
    again = BlockingEvent()
    again.fire()
    wait_future(watcher_for("group-idle", again), time.monotonic() + 30)  # a hang guard


class _FakeClock:
    """The completion module's clock in a test: a sleep moves it by what was asked (each reading by
    1 us), so the looks a poll makes in a span are counted without the machine's speed in them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _FakeWork:
    """A Work whose is_completed() turns true at a set time (the polling logic needs nothing more)."""

    def __init__(self, done_at: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.done_at = done_at
        self.clock = clock
        self.waited = False
        self.asked = 0

    def is_completed(self) -> bool:
        self.asked += 1
        return self.clock() >= self.done_at

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.mark.parametrize("blocking_env", [None, "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"])
def test_poll_mode_asks_at_a_fixed_period_and_keeps_the_deadline(monkeypatch, blocking_env):
    if blocking_env:
        monkeypatch.setenv(blocking_env, "1")
        mode = "event"  # blocking-wait mode polls whatever the configuration says
    else:
        mode = "poll"
    # The poll runs on a clock that its own sleeps move: on the machine's clock, a loaded machine
    # that stalls the poller for 0.3 s leaves it a look or two in the span.
    clock = _FakeClock()
    monkeypatch.setattr(completion, "time", clock)
    work = _FakeWork(clock.monotonic() + 0.3, clock.monotonic)
    completion.wait_gpu_work(work, clock.monotonic() + 10, "g", mode, period_s=1e-3)
    assert work.waited  # wait() only after completion: it orders the caller's stream
    # ~300 looks at a 1 ms period: a spin would make a hundred thousand, a 30 ms period 10.
    assert 10 <= work.asked <= 1000
    never = _FakeWork(clock.monotonic() + 100, clock.monotonic)
    t0 = time.monotonic()
    with pytest.raises(DeadlinePassed):
        completion.wait_gpu_work(never, clock.monotonic() + 0.1, "g", mode, period_s=1e-3)
    assert time.monotonic() - t0 < 10 and not never.waited  # a hang guard: the deadline is on the test's clock
    assert 90 <= never.asked <= 110  # given up at the deadline: 0.1 s of 1 ms periods


def test_fine_timer_restores_the_threads_timer_slack():
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("timer slack is a Linux setting")
    prctl = ctypes.CDLL(None).prctl
    before = prctl(30, 0, 0, 0, 0)
    with completion.fine_timer(1000):
        assert prctl(30, 0, 0, 0, 0) == 1000
    assert prctl(30, 0, 0, 0, 0) == before
