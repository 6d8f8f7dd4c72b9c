"""The learned bounds (ncclguard/watching/base/learner.py) and the progress judgment
(ncclguard/watching/sensors/progress.py): pure logic, no process."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys

import pytest
from harness import wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.recovery._verdict.levers import STUCK_AFTER_VAR, judge_after
from ncclguard.watching.base.learner import FLOOR_S, SAFETY, WARMUP, LearnedState, Learner, parse_state
from ncclguard.watching.sensors.progress import Progress, Sample, own_sample, sample_process

intervals = st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(intervals)
def test_the_bound_is_the_default_before_the_warm_up_then_the_longest_times_the_factor_within_floor_and_cap(xs):
    learner = Learner(30.0, floor_s=FLOOR_S, cap_s=150.0)
    for i, x in enumerate(xs):
        learner.observe("step", x)
        if i + 1 < WARMUP:
            assert learner.bound() == 30.0
        else:
            assert learner.bound() == min(150.0, max(FLOOR_S, SAFETY * max(xs[: i + 1])))
    assert FLOOR_S <= learner.bound() <= 150.0 or learner.bound() == 30.0


@settings(max_examples=100, deadline=None)
@given(intervals, intervals)
def test_the_bound_never_shrinks_and_a_persisted_state_round_trips(first, then):
    learner = Learner(30.0, cap_s=150.0)
    bounds = []
    for x in [*first, *then]:
        learner.observe("step", x)
        if learner.learned("step"):
            bounds.append(learner.bound())
    assert bounds == sorted(bounds)
    again = Learner(30.0, cap_s=150.0)
    again.adopt(parse_state(learner.state.model_dump_json(), "test"))
    assert again.bound() == learner.bound() and again.state == learner.state


def test_a_change_is_said_with_its_clamp_and_bad_values_are_refused_or_ignored(caplog):
    learner = Learner(30.0, cap_s=100.0)
    changes = [c for c in (learner.observe("step", 0.1) for _ in range(WARMUP)) if c is not None]
    assert len(changes) == 1 and (changes[0].old_s, changes[0].new_s) == (30.0, FLOOR_S)
    assert "clamped up to the floor" in changes[0].why and "after 10 intervals" in changes[0].why
    big = learner.observe("step", 1000.0)
    assert big is not None and big.new_s == 100.0 and "clamped down to the cap 100 s" in big.why
    assert learner.observe("step", math.nan) is None and learner.observe("step", -1.0) is None
    assert learner.observe("eval", 5.0) is None and learner.bound("eval") == 30.0  # its own warm-up
    with pytest.raises(ValueError, match="floor_s"):
        Learner(30.0, floor_s=200.0, cap_s=100.0)
    with pytest.raises(ValueError, match="safety"):
        Learner(30.0, safety=0.5)
    with pytest.raises(ValueError, match="default_s"):
        Learner(math.inf)
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert parse_state(b"{not json", "the store") is None
        assert parse_state('{"counts": {"step": -3}}', "the store") is None
        assert parse_state('{"counts": {}, "longest_s": {}, "extra": 1}', "the store") is None
        assert parse_state(b"x" * 20000, "the store") is None
    assert caplog.text.count("ignored") == 4
    assert parse_state(None, "the store") is None
    assert parse_state(LearnedState(counts={"step": 3}).model_dump_json(), "x") == LearnedState(counts={"step": 3})


def test_the_users_judge_bound_wins_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.delenv(STUCK_AFTER_VAR, raising=False)
    assert judge_after() is None
    monkeypatch.setenv(STUCK_AFTER_VAR, "45")
    assert judge_after() == 45.0
    monkeypatch.setenv(STUCK_AFTER_VAR, "off")
    assert judge_after() == 0.0
    for bad in ("-1", "0", "soon", "inf"):
        monkeypatch.setenv(STUCK_AFTER_VAR, bad)
        with pytest.raises(ValueError, match=f"{STUCK_AFTER_VAR} must be a positive number of seconds or 'off'"):
            judge_after()


def beats(prog: Progress, times: range, **fields) -> None:
    for t in times:
        prog.observe(Sample(float(t), "heartbeat", **{k: f(t) for k, f in fields.items()}))


def test_asleep_is_stuck_busy_and_saving_are_moving_and_too_few_samples_are_unknown():
    asleep = Progress(10.0)
    beats(asleep, range(0, 31, 5), ops=lambda t: 17, site=lambda t: "a.py:9", cpu_s=lambda t: 1.0 + t * 1e-4)
    j = asleep.judge(30.0)
    assert j.state == "stuck" and j.still_s == 30.0 and "cpu" in j.evidence and "ops" in j.evidence
    busy = Progress(10.0)
    beats(busy, range(0, 31, 5), ops=lambda t: 17, site=lambda t: "a.py:9", cpu_s=lambda t: t * 0.9)
    assert busy.judge(30.0).state == "moving" and "main-thread cpu" in busy.judge(30.0).evidence
    saving = Progress(10.0)
    beats(saving, range(0, 31, 5), ops=lambda t: 17, cpu_s=lambda t: 1.0, io_bytes=lambda t: t * (1 << 20))
    assert saving.judge(30.0).state == "moving" and "io +" in saving.judge(30.0).evidence
    collectives = Progress(10.0)  # an evaluation on a side group: its ops move
    beats(collectives, range(0, 31, 5), ops=lambda t: t, cpu_s=lambda t: 1.0)
    assert collectives.judge(30.0).state == "moving"
    new_code = Progress(10.0)  # a new call site at each look
    beats(new_code, range(0, 31, 5), site=lambda t: f"a.py:{t}", cpu_s=lambda t: 1.0)
    assert new_code.judge(30.0).state == "moving"
    cycling = Progress(10.0)  # a sleep loop's two lines seen in turn: not movement by the stack
    beats(cycling, range(0, 31, 5), site=lambda t: f"a.py:{t % 2}", cpu_s=lambda t: 1.0)
    assert cycling.judge(30.0).state == "stuck"
    early = Progress(10.0)
    beats(early, range(0, 6, 5), cpu_s=lambda t: 1.0)
    assert early.judge(6.0).state == "unknown"
    stale = Progress(10.0)
    beats(stale, range(0, 11, 5), cpu_s=lambda t: 1.0)
    assert stale.judge(40.0).state == "unknown"  # its samples stopped: no evidence covers the window
    blind = Progress(10.0)
    beats(blind, range(0, 31, 5), site=lambda t: "a.py:9")
    assert blind.judge(30.0).state == "unknown"  # a stack alone never says stuck
    assert Progress(10.0).judge(0.0).state == "unknown"


def _until_status(pid: int, stopped: bool) -> None:
    """Waits until the kernel says process ``pid`` is stopped (or not): a signal takes effect once the
    process runs, which a loaded machine may delay past any fixed sleep."""
    import psutil

    is_stopped = lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED  # noqa: E731
    wait_for(lambda: is_stopped() == stopped, 30, f"process {pid} {'stopped' if stopped else 'resumed'}")


def test_a_stopped_process_is_stuck_from_proc_and_a_gone_one_too():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        _until_status(proc.pid, stopped=True)
        s = sample_process(proc.pid, now=0.0)
        assert s is not None and s.stopped and s.cpu_s is not None
        prog = Progress(10.0)
        for t in range(12):
            prog.observe(sample_process(proc.pid, now=float(t)) or s)
        j = prog.judge(11.0)
        assert j.state == "stuck" and "stopped" in j.evidence
        os.kill(proc.pid, signal.SIGCONT)
        _until_status(proc.pid, stopped=False)
        s2 = sample_process(proc.pid, now=12.0)
        assert s2 is not None and not s2.stopped
    finally:
        proc.kill()
        proc.wait()
    gone = sample_process(proc.pid, now=13.0)
    assert gone is not None and gone.stopped
    cpu, io = own_sample()
    assert cpu is not None and cpu > 0 and io is not None
