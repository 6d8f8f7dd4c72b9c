"""sigalrm_timeout in this process (pytest runs tests in the main thread).

The other side, a blocked gloo collective that SIGALRM cannot interrupt, is in
tests/watching/test_watchdog_multirank.py (it needs ranks).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from ncclguard import NcclGuardError, sigalrm_timeout
from ncclguard.errors import CollectiveTimeout, DeadlineExceeded

# How late past its deadline an interruption may come here: a hang guard, not the 50 ms.
# benchmarks/investigations/sigalrm_lateness.py measures the lateness (at most 24.5 and 26 ms over 40 busy loops
# at load averages 5.8 and 7.7 on 2 cores, results/sigalrm_lateness.json); 0.15 s is over 5x that and keeps
# every nested deadline below apart (0.1 s, 0.2 s, 0.3 s, 0.6 s).
LATE_S = 0.15


@pytest.fixture(autouse=True)
def _keep_alarm_state():
    """Each test leaves SIGALRM's handler and timer as it found them (pytest-timeout uses them)."""
    handler = signal.getsignal(signal.SIGALRM)
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    yield
    signal.signal(signal.SIGALRM, handler)
    if remaining > 0:
        signal.setitimer(signal.ITIMER_REAL, max(remaining - (time.monotonic() - start), 1e-3), interval)
    else:
        signal.setitimer(signal.ITIMER_REAL, 0)


def spin(seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_busy_python_loop_is_interrupted_after_its_deadline():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        with sigalrm_timeout(0.2):
            spin()
    late = time.monotonic() - start - 0.2
    assert 0 <= late < LATE_S
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, NcclGuardError)
    assert not isinstance(err, CollectiveTimeout)  # the guarded code is not a collective
    assert str(err) == "Python code ran past its 0.2 s deadline"
    assert err.seconds == 0.2
    assert 0.2 <= err.elapsed_s < 0.2 + LATE_S


def test_sleep_is_interrupted_after_its_deadline_with_the_given_message():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="^evaluation took too long$"):
        with sigalrm_timeout(0.15, "evaluation took too long"):
            time.sleep(10)
    assert 0 <= time.monotonic() - start - 0.15 < LATE_S


def test_no_exception_when_the_block_finishes_in_time():
    with sigalrm_timeout(0.5):
        time.sleep(0.05)
    time.sleep(0.6)  # past the deadline: nothing may fire after the guard is gone


def test_inner_deadline_wins_and_outer_resumes_with_its_remaining_time():
    # Wider than the others: an outer deadline restarted after the inner one would fire at 2.5 s,
    # one that resumes with its remaining time at 2.0 s; 0.4 s of lateness still tells them apart.
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="outer"):
        with sigalrm_timeout(2.0, "outer"):
            with pytest.raises(DeadlineExceeded, match="inner"):
                with sigalrm_timeout(0.5, "inner"):
                    spin()
            inner_at = time.monotonic() - start
            spin()
    outer_at = time.monotonic() - start
    assert 0.5 <= inner_at < 0.5 + 0.4
    assert 2.0 <= outer_at < 2.0 + 0.4


def test_outer_deadline_fires_inside_a_longer_inner_one_exactly_once():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="outer"):
        with sigalrm_timeout(0.2, "outer"):
            with sigalrm_timeout(5.0, "inner"):
                spin()
    assert 0.2 <= time.monotonic() - start < 0.2 + LATE_S
    # The expired outer deadline is not re-armed while the stack unwinds: no second exception.
    time.sleep(0.2)


def test_inner_guard_that_completes_leaves_the_outer_deadline_unchanged():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="outer"):
        with sigalrm_timeout(0.4, "outer"):
            with sigalrm_timeout(0.1, "inner"):
                time.sleep(0.02)
            spin()
    assert 0.4 <= time.monotonic() - start < 0.4 + LATE_S


def test_previous_handler_and_timer_are_restored():
    fired = []
    handler = lambda signum, frame: fired.append(time.monotonic())  # noqa: E731
    signal.signal(signal.SIGALRM, handler)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    with sigalrm_timeout(2.0):
        time.sleep(0.25)
    assert signal.getsignal(signal.SIGALRM) is handler
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    # The rest of the old timer (0.25 s), not a new one (0.5 s, or the guard's 2 s); 0.1 s leaves
    # room for a time slice between the two readings on a loaded machine.
    assert abs(remaining - (0.5 - (time.monotonic() - start))) < 0.1
    assert interval == 0.0
    time.sleep(0.6)
    assert len(fired) == 1
    assert 0.5 <= fired[0] - start < 0.5 + LATE_S


def test_previous_timer_that_comes_due_inside_the_guard_still_calls_its_handler_on_time():
    fired = []
    signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    with pytest.raises(DeadlineExceeded):
        with sigalrm_timeout(0.3):
            spin()
    assert 0.3 <= time.monotonic() - start < 0.3 + LATE_S
    assert len(fired) == 1 and 0.1 <= fired[0] - start < 0.1 + LATE_S
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_without_a_previous_timer_the_timer_is_off_and_the_default_handler_back():
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    with sigalrm_timeout(1.0):
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_refused_outside_the_main_thread():
    seen = []

    def body():
        try:
            with sigalrm_timeout(1.0):
                pass
        except RuntimeError as exc:
            seen.append(str(exc))

    t = threading.Thread(target=body)
    t.start()
    t.join(30)  # a hang guard: a loaded machine may start the thread seconds late
    assert len(seen) == 1 and "only in the main thread" in seen[0]


def test_refused_where_the_platform_has_no_setitimer(monkeypatch):
    # No platform here lacks SIGALRM; deleting the attribute is the one way to reach that branch.
    monkeypatch.delattr(signal, "setitimer")
    with pytest.raises(RuntimeError, match="SIGALRM and setitimer"):
        with sigalrm_timeout(1.0):
            pass


@pytest.mark.parametrize(
    "bad, exc", [(0, ValueError), (-1.5, ValueError), (float("nan"), ValueError), ("1", TypeError)]
)
def test_bad_seconds_are_refused(bad, exc):
    with pytest.raises(exc, match="seconds"):
        with sigalrm_timeout(bad):
            pass


def test_a_deadline_whose_signal_lands_on_another_thread_still_ends_a_sleep_in_the_main_thread():
    """SIGALRM is process-directed: when another thread's C handler takes it, the main thread's
    sleep is not interrupted (seen once in a guarded evaluation: a 30 s sleep past a 1 s
    deadline). The guard sends the signal again, to the main thread, once the deadline is overdue."""
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    sent = []
    # A signal sent after the guard is gone (a thread a loaded machine ran late) lands here, not in
    # pytest-timeout's handler; the fixture puts that one back.
    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    start = time.monotonic()

    def astray() -> None:
        time.sleep(max(start + 0.35 - time.monotonic(), 0.0))
        signal.pthread_kill(other.ident, signal.SIGALRM)  # at the deadline, its signal lands on another thread
        sent.append(time.monotonic())

    sender = threading.Thread(target=astray, daemon=True)
    with pytest.raises(DeadlineExceeded, match="ran past its 0.35 s deadline"):
        with sigalrm_timeout(0.35):
            # The guard's own timer never rings: disarmed here, in order, rather than by another
            # thread that a loaded machine may run after the timer rang.
            signal.setitimer(signal.ITIMER_REAL, 0)
            sender.start()
            time.sleep(60)
    elapsed = time.monotonic() - start
    sender.join(30)  # a hang guard; the other thread is still there to take the signal
    idle.set()
    assert sent, "the signal was not sent to the other thread"
    assert 0.35 <= elapsed < 20, elapsed  # a hang guard: without the resend, the whole 60 s sleep
