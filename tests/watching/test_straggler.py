"""Straggler detection's pure logic (ncclguard/watching/sensors/straggler.py): figures from records, the
assessment against peers, the run of windows that raises an incident, the settings and the heartbeat.

The lockstep model used here is the physics of a synchronous collective: every rank leaves the op
when the slowest arrives, so a step lasts ``max(compute) + transfer`` and each rank waits
``step - its compute``.
"""

from __future__ import annotations

import random
import threading
import time

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclguard.incidents.model import Heartbeat, IncidentKind, OpRecord, StragglerWindow
from ncclguard.recording.flight import recorder
from ncclguard.recording.steps import StepMarks, mark_step, steps
from ncclguard.store.codec import decode, encode
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import LIMITS
from ncclguard.watching.sensors.rank_state import WorldArrivals
from ncclguard.watching.sensors.straggler import (
    StragglerTracker,
    StragglerWatch,
    assess,
    delay_at,
    fresh_windows,
    from_arrivals,
    measure,
    run_delay,
)

MAIN = 1


def rec(op: str, start: float, end: float | None, phase: str = "train", thread: int = MAIN, **kw) -> OpRecord:
    kw.setdefault("numel", 1 << 20)
    return OpRecord(seq=1, op=op, group="0", start=start, end=end, phase=phase, thread=thread, **kw)


def lockstep(
    computes: list[float], transfer: float, length: float, n: int, end: float, delays: list[float] | None = None
) -> list[StragglerWindow]:
    """Each rank's window when ranks with per-step ``computes`` meet in one collective per step.

    ``delays``: per rank, the time per step it waited for a CPU on top of its compute (a loaded host):
    its wall-clock compute is ``compute + delay`` and its window tells the run delay."""
    if delays is not None:
        walls = [c + d for c, d in zip(computes, delays, strict=True)]
        count = length / (max(walls) + transfer)
        wins = lockstep(walls, transfer, length, n, end)
        return [w.model_copy(update={"run_delay_s": d * count}) for w, d in zip(wins, delays, strict=True)]
    step = max(computes) + transfer
    count = length / step
    return [
        StragglerWindow(
            n=n,
            end=end,
            length_s=length,
            compute_s=c * count,
            wait_s=(step - c) * count,
            ops=max(1, int(count)),
            op_wait_s=step - c,
            transfer_ops=max(1, int(count)),
            phase="train",
            op="all_reduce",
        )
        for c in computes
    ]


def defaults() -> StragglerTracker:
    cfg = WatchdogConfig()
    return StragglerTracker(
        0, cfg.straggler_threshold, cfg.straggler_min_share, cfg.straggler_windows, cfg.straggler_link_threshold
    )


# ----------------------------------------------------------------- measure


def test_measure_splits_compute_and_wait_and_names_phase_and_op() -> None:
    # 10 s window: per second 0.6 s of compute in "train" then a 0.4 s all_reduce.
    recs = [rec("all_reduce", t + 0.6, t + 1.0) for t in range(10)]
    w = measure(recs, 0.0, 10.0, thread=MAIN, n=3, phase_now="train", steps=10)
    assert w is not None
    assert (w.n, w.ops, w.steps, w.phase, w.op) == (3, 10, 10, "train", "all_reduce")
    assert w.length_s == pytest.approx(10.0)
    assert w.compute_s == pytest.approx(6.0)
    assert w.wait_s == pytest.approx(4.0)
    assert w.op_wait_s == pytest.approx(0.4) and w.transfer_ops == 10
    tiny = measure([rec("all_reduce", t + 0.6, t + 1.0, numel=1) for t in range(10)], 0.0, 10.0, thread=MAIN, n=0)
    assert tiny is not None and (tiny.ops, tiny.transfer_ops, tiny.op_wait_s) == (10, 0, 0.0)  # no link timing


def test_measure_ignores_async_ops_other_threads_and_ops_before_the_window() -> None:
    recs = [
        rec("broadcast", 1.0, 3.0),  # ended before the window
        rec("all_reduce", 5.0, 6.0, async_op=True),
        rec("all_gather", 6.0, 7.0, thread=2),
        rec("barrier", 8.0, 9.0, phase="eval"),
    ]
    w = measure(recs, 4.0, 10.0, thread=MAIN, n=0, phase_now="train")
    assert w is not None
    assert (w.ops, w.op, w.wait_s, w.compute_s) == (1, "barrier", pytest.approx(1.0), pytest.approx(5.0))
    assert w.phase == "eval"  # 4 s before the barrier (in its phase) against 1 s after it


def test_measure_counts_an_op_still_in_flight_and_clips_to_the_window() -> None:
    recs = [rec("all_reduce", 2.0, 6.0), rec("all_reduce", 9.0, None)]
    w = measure(recs, 4.0, 10.0, thread=MAIN, n=0)
    assert w is not None
    assert w.wait_s == pytest.approx(3.0)  # 4..6 and 9..10
    assert w.compute_s == pytest.approx(3.0)


def test_measure_covers_only_what_a_full_ring_kept() -> None:
    recs = [rec("all_reduce", t + 0.5, t + 1.0) for t in range(5, 10)]
    full = measure(recs, 0.0, 10.0, thread=MAIN, n=0, capacity=5)
    assert full is not None and full.length_s == pytest.approx(4.5)  # from the oldest record kept
    roomy = measure(recs, 0.0, 10.0, thread=MAIN, n=0, capacity=2000)
    assert roomy is not None and roomy.length_s == pytest.approx(10.0)
    assert measure([], 5.0, 5.0, thread=MAIN, n=0) is None


# ----------------------------------------------------------------- assess and the run of windows


def test_assess_names_the_rank_that_computes_more_and_waits_less() -> None:
    own, *peers = lockstep([1.3, 1.0, 1.0, 1.0], 0.2, 10.0, 0, 10.0)
    a = assess(own, dict(enumerate(peers, 1)), 1.15, 0.05)
    assert a is not None and a.compute_slow and not a.link_slow
    assert a.evidence.slowdown == pytest.approx(1.3, rel=1e-3)
    assert a.score == pytest.approx(1 / 1.3, rel=1e-3)
    healthy = assess(peers[0], {0: own, 2: peers[1], 3: peers[2]}, 1.15, 0.05)
    assert healthy is not None and not healthy.compute_slow and healthy.score == 1.0
    assert assess(own, {}, 1.15, 0.05) is None


def test_defaults_fire_on_a_20_percent_compute_slowdown_within_3_windows() -> None:
    tracker = defaults()
    found = []
    for n in range(3):
        own, *peers = lockstep([1.2, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1))
        found.append(tracker.feed(own, dict(enumerate(peers, 1))))
    hits = [d for d in found if d is not None]
    assert len(hits) == 1 and found.index(hits[0]) <= 2
    det = hits[0]
    assert det.kind is IncidentKind.STRAGGLER and det.signature == "straggler/compute/0/1"  # the first episode
    assert det.straggler is not None
    assert (det.straggler.rank, det.straggler.cause) == (0, "compute")
    assert det.straggler.slowdown == pytest.approx(1.2, rel=1e-3)
    assert "phase 'train'" in det.straggler.where and "all_reduce" in det.straggler.where
    assert [w.n for w in det.straggler.windows] == [0, 1]


@settings(max_examples=200, deadline=None)
@given(
    # 20% slower or more in every window, noise included: a rank's +-3% can take 6% off the ratio,
    # and at exactly the threshold the figures (sums of time stamps) land a rounding error either
    # side of it. Found by hypothesis: slow=1.2 with one peer and no noise, and slow=1.203 with -2.3%
    # and +2.3% in the middle window (1.148: no two windows in a row), failed alike before and after
    # the rules were split into named parts.
    slow=st.floats(1.2 * 1.03 / 0.97 * 1.001, 3.0),
    share=st.floats(0.3, 0.95),  # the healthy step's compute share
    peers=st.integers(1, 16),
    noise=st.lists(st.floats(-0.03, 0.03), min_size=17 * 3, max_size=17 * 3),
)
def test_defaults_fire_on_any_20_percent_straggler_and_name_it(slow, share, peers, noise) -> None:
    transfer = 1.0 / share - 1.0
    tracker = defaults()
    hits = []
    for n in range(3):
        computes = [(slow if r == 0 else 1.0) * (1 + noise[17 * n + r]) for r in range(peers + 1)]
        own, *rest = lockstep(computes, transfer, 30.0, n, 30.0 * (n + 1))
        if (d := tracker.feed(own, dict(enumerate(rest, 1)))) is not None:
            hits.append(d)
    assert len(hits) == 1 and hits[0].straggler is not None and hits[0].straggler.cause == "compute"


@settings(max_examples=200, deadline=None)
@given(
    me=st.integers(0, 16),
    share=st.floats(0.05, 0.95),
    peers=st.integers(1, 16),
    noise=st.lists(st.floats(-0.05, 0.05), min_size=17 * 10, max_size=17 * 10),
    tnoise=st.lists(st.floats(-0.05, 0.05), min_size=10, max_size=10),
)
def test_defaults_never_fire_on_ranks_within_5_percent_of_each_other(me, share, peers, noise, tnoise) -> None:
    me = me % (peers + 1)
    tracker = defaults()
    for n in range(10):
        computes = [1.0 + noise[17 * n + r] for r in range(peers + 1)]
        wins = lockstep(computes, (1.0 / share - 1.0) * (1 + tnoise[n]), 30.0, n, 30.0 * (n + 1))
        own = wins.pop(me)
        assert tracker.feed(own, dict(enumerate(wins))) is None


def test_a_slow_link_is_told_apart_from_a_compute_straggler() -> None:
    tracker = defaults()
    found = []
    for n in range(6):  # the transfer goes from 0.2 s to 0.5 s an op at window 3; compute stays equal
        own, *peers = lockstep([1.0, 1.0], 0.2 if n < 3 else 0.5, 10.0, n, 10.0 * (n + 1))
        found.append(tracker.feed(own, {1: peers[0]}))
    assert found[:4] == [None] * 4
    det = found[4]
    assert det is not None and det.straggler is not None and found[5] is None
    assert (det.signature, det.straggler.cause, det.straggler.ranks) == ("straggler/link/1", "link", [0, 1])
    assert det.straggler.slowdown == pytest.approx(2.5, rel=1e-3)
    assert "the transfer itself in all_reduce" in det.straggler.where


def test_a_loaded_machine_slowing_compute_and_transfer_alike_is_no_slow_link() -> None:
    tracker = defaults()
    for n in range(8):  # from window 3 everything takes 3x: the machine, not the link
        k = 1.0 if n < 3 else 3.0
        own, *peers = lockstep([1.0 * k, 1.0 * k], 0.2 * k, 10.0, n, 10.0 * (n + 1))
        assert tracker.feed(own, {1: peers[0]}) is None
    small = defaults()
    for n in range(8):  # the transfer 1.8x (under straggler_link_threshold, 2.0): no incident
        own, *peers = lockstep([1.0, 1.0], 0.2 if n < 3 else 0.36, 10.0, n, 10.0 * (n + 1))
        assert small.feed(own, {1: peers[0]}) is None


def test_a_slow_link_seen_through_a_load_burst_is_still_reported_once_the_burst_ends() -> None:
    tracker = defaults()
    found = []
    for n in range(8):  # the link slows at window 3; windows 3-5 also compute 1.3x (load on every rank)
        k = 1.3 if 3 <= n < 6 else 1.0
        own, *peers = lockstep([1.0 * k, 1.0 * k], 0.2 if n < 3 else 0.5, 10.0, n, 10.0 * (n + 1))
        found.append(tracker.feed(own, {1: peers[0]}))
    # The burst windows count neither as a link (compute moved) nor toward the healthy baseline,
    # so once compute holds again two slow windows in a row name the link.
    assert found[:7] == [None] * 7
    det = found[7]
    assert det is not None and det.straggler is not None
    assert (det.signature, det.straggler.cause) == ("straggler/link/1", "link")
    assert det.straggler.slowdown == pytest.approx(2.5, rel=1e-3)


def test_fresh_windows_drops_peers_whose_last_window_is_old() -> None:
    own = lockstep([1.0], 0.1, 10.0, 5, 100.0)[0]
    hb = {
        "rank": 1,
        "host": "h",
        "pid": 1,
        "beat": 1,
        "time": 0.0,
        "phase": "",
        "site": "",
        "last_seq": {},
        "last_completed": {},
        "inflight": [],
    }
    beats = {
        1: Heartbeat(**hb, window=own.model_copy(update={"end": 85.0})),
        2: Heartbeat(**{**hb, "rank": 2}, window=own.model_copy(update={"end": 70.0})),
        3: Heartbeat(**{**hb, "rank": 3}),
    }
    assert list(fresh_windows(beats, own)) == [1]


# ----------------------------------------------------------------- the watch, the heartbeat, the settings


def test_the_watch_puts_step_score_and_window_in_the_heartbeat_and_the_store_takes_it() -> None:
    marks = StepMarks()
    watch = StragglerWatch(0, 10.0, 1.15, 0.05, 2, marks=marks, thread=MAIN)
    watch.start = 0.0
    hb = Heartbeat(
        rank=0, host="h", pid=1, beat=1, time=0.0, phase="", site="", last_seq={}, last_completed={}, inflight=[]
    )
    early = watch.on_beat(hb, now=5.0)
    assert (early.step, early.window, early.straggler_score) == (None, None, None)
    for _ in range(7):
        marks.count += 1
    marks.step = 6
    later = watch.on_beat(hb, now=12.0)
    assert later.step == 6 and later.window is not None
    # The window ends on the clock's multiple of 10 s, not at the beat: [0, 10) is window 0.
    assert (later.window.n, later.window.steps, later.window.length_s) == (0, 7, 10.0)
    assert watch.check({}) is None and watch.check({}) is None  # no peers; assessed once
    blob = encode(later)
    assert len(blob) < LIMITS[Heartbeat]
    assert decode(Heartbeat, blob, "heartbeat", LIMITS[Heartbeat]) == later


def test_a_watch_turned_off_measures_nothing() -> None:
    watch = StragglerWatch(0, 1.0, 1.15, 0.05, 2, enabled=False, marks=StepMarks(), thread=MAIN)
    hb = Heartbeat(
        rank=0, host="h", pid=1, beat=1, time=0.0, phase="", site="", last_seq={}, last_completed={}, inflight=[]
    )
    assert watch.on_beat(hb, now=watch.start + 100).window is None


def test_settings_defaults_and_their_checks() -> None:
    cfg = WatchdogConfig()
    assert (cfg.straggler, cfg.straggler_window_s, cfg.straggler_threshold, cfg.straggler_windows) == (
        True,
        10.0,
        1.15,
        2,
    )
    assert WatchdogConfig(heartbeat_s=20, hang_timeout_s=300).straggler_window == 20.0  # unset: one beat at least
    with pytest.raises(pydantic.ValidationError, match=r"straggler_window_s \(2.0\) must be >= heartbeat_s \(5.0\)"):
        WatchdogConfig(straggler_window_s=2.0)
    with pytest.raises(pydantic.ValidationError, match="straggler_threshold"):
        WatchdogConfig(straggler_threshold=1.0)
    with pytest.raises(pydantic.ValidationError, match="straggler_windows"):
        WatchdogConfig(straggler_windows=0)
    with pytest.raises(pydantic.ValidationError, match="straggler_min_share"):
        WatchdogConfig(straggler_min_share=1.0)


def test_mark_step_counts_and_numbers_steps() -> None:
    before = steps.count
    first = mark_step()
    assert mark_step() == first + 1
    assert mark_step(100) == 100 and steps.step == 100
    assert steps.count == before + 3
    with pytest.raises(ValueError, match="step number is >= 0"):
        mark_step(-1)


def test_phase_names_drop_their_labels() -> None:
    from ncclguard.watching.sensors.straggler import phase_name

    assert phase_name("train step=3 > fwd layer=2") == "train > fwd"
    assert phase_name("") == ""
    recs = [rec("all_reduce", t + 0.5, t + 1.0, phase=f"train step={t}") for t in range(4)]
    w = measure(recs, 0.0, 4.0, thread=MAIN, n=0, phase_now="train step=4")
    assert w is not None and w.phase == "train"


def test_windows_without_completed_collectives_are_not_compared() -> None:
    # A hang: the peers sit in one op the whole window, the stalled rank computes; no finding.
    stalled = measure([rec("all_reduce", 0.5, 1.0)], 0.0, 10.0, thread=MAIN, n=0)
    waiting = measure([rec("all_reduce", 0.5, 1.0), rec("all_reduce", 1.0, None)], 0.0, 10.0, thread=MAIN, n=0)
    assert stalled is not None and waiting is not None and waiting.ops == 1 and waiting.wait_s == pytest.approx(9.5)
    assert assess(stalled, {1: waiting, 2: waiting}, 1.15, 0.05) is None
    own, *peers = lockstep([1.3, 1.0], 0.2, 10.0, 0, 10.0)
    assert assess(own, {1: peers[0].model_copy(update={"ops": 2})}, 1.15, 0.05) is None


# ----------------------------------------------------------------- CPU starvation (the run delay)


def test_run_delay_reads_a_threads_time_waiting_for_a_cpu() -> None:
    me = threading.get_native_id()
    first = run_delay(me)
    assert first is not None and first >= 0.0  # Linux, where the suite runs
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:  # some running, to be descheduled or not
        pass
    second = run_delay(me)
    assert second is not None and second >= first
    assert run_delay(None) is None
    assert run_delay(2**31 - 1) is None  # no such thread in this process


def test_measure_keeps_the_run_delay_within_the_window() -> None:
    recs = [rec("all_reduce", t + 0.6, t + 1.0) for t in range(10)]
    w = measure(recs, 0.0, 10.0, thread=MAIN, n=0, run_delay_s=2.5)
    assert w is not None and w.run_delay_s == pytest.approx(2.5)
    over = measure(recs, 0.0, 10.0, thread=MAIN, n=0, run_delay_s=12.0)
    assert over is not None and over.run_delay_s == pytest.approx(10.0)
    unknown = measure(recs, 0.0, 10.0, thread=MAIN, n=0)
    assert unknown is not None and unknown.run_delay_s is None


def test_the_watch_publishes_the_main_threads_run_delay() -> None:
    watch = StragglerWatch(0, 1.0, 1.15, 0.05, 2, marks=StepMarks())  # the real main thread
    hb = Heartbeat(
        rank=0, host="h", pid=1, beat=1, time=0.0, phase="", site="", last_seq={}, last_completed={}, inflight=[]
    )
    out = watch.on_beat(hb, now=watch.start + 2.0)
    assert out.window is not None and out.window.run_delay_s is not None and 0.0 <= out.window.run_delay_s <= 2.0


def test_a_rank_starved_of_cpu_is_no_straggler_but_its_wall_clock_alone_would_make_one() -> None:
    # Rank 0 waits 0.3 s a step for a CPU (the host's load), for 6 windows: its wall-clock compute is
    # 1.3x its peers', which the wall-clock rule (no run delay told) reports.
    told, untold = defaults(), defaults()
    found_told, found_untold = [], []
    for n in range(6):
        wins = lockstep([1.0, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1), delays=[0.3, 0.0, 0.0])
        own, *peers = wins
        found_told.append(told.feed(own, dict(enumerate(peers, 1))))
        bare = [w.model_copy(update={"run_delay_s": None}) for w in wins]
        found_untold.append(untold.feed(bare[0], dict(enumerate(bare[1:], 1))))
    assert found_told == [None] * 6
    assert told.score == 1.0
    assert [d is not None for d in found_untold] == [False, True, False, False, False, False]


def test_a_20_percent_straggler_is_named_though_every_rank_waits_for_a_cpu() -> None:
    tracker = defaults()
    found = []
    for n in range(3):  # rank 0 computes 1.2x; every rank waits 0.5 s a step for a CPU, rank 1 twice that
        own, *peers = lockstep([1.2, 1.0, 1.0], 0.3, 10.0, n, 10.0 * (n + 1), delays=[0.5, 1.0, 0.5])
        found.append(tracker.feed(own, dict(enumerate(peers, 1))))
    assert found[0] is None and found[2] is None
    det = found[1]
    assert det is not None and det.straggler is not None and det.straggler.cause == "compute"
    assert det.straggler.slowdown == pytest.approx(1.2, rel=1e-3)
    assert "less the time each waited for a CPU" in det.reason
    ev = det.straggler.windows[-1]
    assert ev.work_frac is not None and ev.peers_work_frac is not None and ev.run_delay_frac is not None
    assert ev.slowdown == pytest.approx(ev.work_frac / ev.peers_work_frac, abs=1e-3)


def test_without_every_ranks_run_delay_all_are_judged_on_the_wall_clock() -> None:
    own, *peers = lockstep([1.3, 1.0, 1.0], 0.2, 10.0, 0, 10.0, delays=[0.0, 0.0, 0.0])
    blind = peers[1].model_copy(update={"run_delay_s": None})
    a = assess(own, {1: peers[0], 2: blind}, 1.15, 0.05)
    assert a is not None and a.compute_slow
    assert (a.evidence.work_frac, a.evidence.peers_work_frac, a.evidence.run_delay_frac) == (None, None, None)
    assert a.evidence.slowdown == pytest.approx(1.3, rel=1e-3)


@settings(max_examples=200, deadline=None)
@given(share=st.floats(0.05, 0.95), peers=st.integers(1, 16), me=st.integers(0, 16), seed=st.integers(0, 2**32))
def test_cpu_starvation_of_equal_ranks_never_fires(share, peers, me, seed) -> None:
    # Work within 5% on every rank, each window any rank waiting up to 3x its compute for a CPU (the
    # draws from a seed hypothesis picks: drawing 340 floats per example took minutes).
    rng = random.Random(seed)
    me = me % (peers + 1)
    tracker = defaults()
    for n in range(10):
        d = [rng.uniform(0.0, 3.0) for _ in range(peers + 1)]
        computes = [1.0 + rng.uniform(-0.05, 0.05) for _ in range(peers + 1)]
        wins = lockstep(computes, 1.0 / share - 1.0, 30.0, n, 30.0 * (n + 1), delays=d)
        own = wins.pop(me)
        assert tracker.feed(own, dict(enumerate(wins))) is None


@settings(max_examples=200, deadline=None)
@given(
    slow=st.floats(1.2, 3.0),
    share=st.floats(0.3, 0.95),
    peers=st.integers(1, 16),
    seed=st.integers(0, 2**32),
)
def test_a_20_percent_straggler_fires_within_3_windows_whatever_the_cpu_waits(slow, share, peers, seed) -> None:
    # Every rank waits up to a quarter of its step's compute for a CPU, unevenly (beyond that the
    # straggler's 20% costs less than straggler_min_share of the longer step: a host that loaded
    # delays the job more than the straggler does).
    rng = random.Random(seed)
    tracker = defaults()
    hits = []
    for n in range(3):
        d = [rng.uniform(0.0, 0.25) for _ in range(peers + 1)]
        computes = [slow if r == 0 else 1.0 for r in range(peers + 1)]
        own, *rest = lockstep(computes, 1.0 / share - 1.0, 30.0, n, 30.0 * (n + 1), delays=d)
        if (found := tracker.feed(own, dict(enumerate(rest, 1)))) is not None:
            hits.append(found)
    assert len(hits) == 1 and hits[0].straggler is not None and hits[0].straggler.cause == "compute"


# ----------------------------------------------------------------- windows on the wall clock


def test_windows_end_on_the_clocks_multiples_so_ranks_started_apart_compare_the_same_span() -> None:
    a = StragglerWatch(0, 10.0, 1.15, 0.05, 2, marks=StepMarks(), thread=MAIN)
    b = StragglerWatch(1, 10.0, 1.15, 0.05, 2, marks=StepMarks(), thread=MAIN)
    a.start, b.start = 1003.0, 1007.5  # watchdogs started 4.5 s apart
    a.tick(1009.9)
    assert a.window is None  # before the first boundary
    a.tick(1010.2)
    b.tick(1010.4)
    assert a.window is not None and b.window is not None
    assert (a.window.n, a.window.end, a.window.length_s) == (100, 1010.0, pytest.approx(7.0))
    assert (b.window.n, b.window.end, b.window.length_s) == (100, 1010.0, pytest.approx(2.5))
    a.tick(1020.05)
    b.tick(1031.0)  # a late tick closes the span up to the last boundary passed
    assert (a.window.n, a.window.length_s) == (101, pytest.approx(10.0))
    assert (b.window.n, b.window.length_s, b.window.end) == (102, pytest.approx(20.0), 1030.0)


def test_measure_leaves_out_records_begun_after_the_window() -> None:
    recs = [rec("all_reduce", t + 0.6, t + 1.0) for t in range(12)]  # the last two begin after 10 s
    w = measure(recs, 0.0, 10.0, thread=MAIN, n=0)
    assert w is not None and w.ops == 10
    assert (w.compute_s, w.wait_s) == (pytest.approx(6.0), pytest.approx(4.0))


def test_check_waits_for_a_peer_that_has_not_published_the_window_yet() -> None:
    hb = {
        "host": "h",
        "pid": 1,
        "beat": 1,
        "time": 0.0,
        "phase": "",
        "site": "",
        "last_seq": {},
        "last_completed": {},
        "inflight": [],
    }
    watch = StragglerWatch(0, 10.0, 1.15, 0.05, 2, marks=StepMarks(), thread=MAIN)
    mine, theirs = lockstep([1.3, 1.0], 0.2, 10.0, 7, 80.0)
    watch.window = mine
    old = theirs.model_copy(update={"n": 6, "end": 70.0})
    assert watch.check({1: Heartbeat(rank=1, **hb, window=old)}, now=81.0) is None
    assert watch.assessed == -1 and watch.tracker.assessed == 0  # not assessed: it waits
    assert watch.check({1: Heartbeat(rank=1, **hb, window=theirs)}, now=82.0) is None  # first slow window
    assert watch.assessed == 7 and watch.tracker.assessed == 1 and len(watch.tracker.compute_run) == 1
    # A peer that never publishes it: after a window's length the rank assesses without it.
    watch.window = mine.model_copy(update={"n": 8, "end": 90.0})
    assert watch.check({1: Heartbeat(rank=1, **hb, window=old)}, now=95.0) is None and watch.assessed == 7
    assert watch.check({1: Heartbeat(rank=1, **hb, window=old)}, now=100.5) is None and watch.assessed == 8


# ----------------------------------------------------------------- the backend's arrivals (ops issued from C++)
#
# A loop that only calls DDP has no ncclguard record per step: its bucket all_reduce is issued from
# C++. torch's flight recorder stamps when each rank reached each op (time_created_ns); in the lockstep
# model rank r reaches op k at R(k-1) + T + c_r(k), where R(k) = max_s a_s(k) is the op's release.


def arrivals_lockstep(
    computes: list[list[float]], transfer: float, start: float = 1000.0, seq0: int = 500
) -> list[list[tuple[int, float]]]:
    """Each rank's arrivals at ``len(computes[r])`` consecutive synchronous ops, ``computes[r][k]`` its
    compute before op ``k``, everyone leaving op ``k`` a ``transfer`` after the last one reached it."""
    out: list[list[tuple[int, float]]] = [[] for _ in computes]
    left = start
    for k in range(len(computes[0])):
        at = [left + c[k] for c in computes]
        for r, a in enumerate(at):
            out[r].append((seq0 + k, a))
        left = max(at) + transfer
    return out


def backend_windows(
    arrivals: list[list[tuple[int, float]]], n: int = 0, delays: list[float] | None = None
) -> list[StragglerWindow]:
    """The windows of ranks whose records hold no op, carrying ``arrivals`` (the newest 32)."""
    return [
        StragglerWindow(
            n=n,
            end=10.0 * (n + 1),
            length_s=10.0,
            compute_s=10.0,
            wait_s=0.0,
            ops=0,
            run_delay_s=None if delays is None else delays[r],
            phase="train",
            arrivals=a[-32:],
            backend_op="gloo:all_reduce",
        )
        for r, a in enumerate(arrivals)
    ]


def steady(per_rank: list[float], ops: int = 32) -> list[list[float]]:
    return [[c] * ops for c in per_rank]


def test_arrivals_give_each_rank_its_waits_and_compute_over_the_same_span() -> None:
    # Ranks 0 and 1 compute 50 ms before each op, rank 2 65 ms; 5 ms of transfer.
    own, *peers = backend_windows(arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005))
    got = from_arrivals(own, dict(enumerate(peers, 1)))
    assert got is not None
    mine, theirs = got
    span = 31 * 0.070  # 32 ops: 31 intervals of 65 + 5 ms between releases
    for w in (mine, *theirs.values()):
        assert (w.length_s, w.ops, w.transfer_ops, w.op) == (pytest.approx(span), 31, 0, "gloo:all_reduce")
        assert w.compute_s + w.wait_s == pytest.approx(span)
    assert mine.wait_s == pytest.approx(0.0, abs=1e-9)  # the last to arrive waits for nobody
    assert theirs[1].wait_s == pytest.approx(31 * 0.015)  # the others wait 15 ms an op for it
    # The transfer counts as compute for all: the ratio is (65 + 5) / (50 + 5), not 65 / 50.
    assert mine.compute_s / theirs[1].compute_s == pytest.approx(70 / 55)


def test_the_transfer_counting_as_compute_hides_a_20_percent_straggler_whose_step_transfers_30_percent() -> None:
    # (0.7 * 1.2 + 0.3) / (0.7 + 0.3) = 1.14 < 1.15: conservative, and documented as such.
    own, *peers = backend_windows(arrivals_lockstep(steady([0.7 * 1.2, 0.7, 0.7]), 0.3))
    a = assess(own, dict(enumerate(peers, 1)), 1.15, 0.05)
    assert a is not None and not a.compute_slow and a.evidence.slowdown == pytest.approx(1.14, abs=1e-3)


def test_a_rank_30_percent_slower_in_a_ddp_only_loop_is_named_from_the_arrivals() -> None:
    tracker = defaults()
    hits = []
    for n in range(3):
        own, *peers = backend_windows(arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005, start=10.0 * n), n)
        a = assess(own, dict(enumerate(peers, 1)), 1.15, 0.05)
        assert a is not None and a.evidence.source == "backend" and a.evidence.common_ops == 32
        assert a.compute_slow and not a.link_slow
        if (d := tracker.feed(own, dict(enumerate(peers, 1)))) is not None:
            hits.append((n, d))
    ((n, det),) = hits
    assert n == 1 and det.straggler is not None  # the second slow window in a row
    assert (det.straggler.rank, det.straggler.cause) == (0, "compute")
    assert det.straggler.slowdown == pytest.approx(70 / 55, rel=1e-3)
    assert "gloo:all_reduce" in det.reason and "torch's flight recorder" in det.reason
    assert all(w.source == "backend" and w.op == "gloo:all_reduce" for w in det.straggler.windows)
    for peer in range(1, 3):  # the peers it is compared with are healthy, seen from their side
        wins = backend_windows(arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005))
        me = wins.pop(peer)
        healthy = assess(me, dict(enumerate(wins)), 1.15, 0.05)
        assert healthy is not None and not healthy.compute_slow and healthy.score == 1.0


def test_the_records_come_first_and_a_window_without_arrivals_or_enough_common_ops_is_not_compared() -> None:
    own, *peers = backend_windows(arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005))
    recs = lockstep([1.0, 1.0, 1.0], 0.2, 10.0, 0, 10.0)
    with_records = [w.model_copy(update={"arrivals": own.arrivals}) for w in recs]
    a = assess(with_records[0], dict(enumerate(with_records[1:], 1)), 1.15, 0.05)
    assert a is not None and a.evidence.source == "records" and not a.compute_slow
    bare = [w.model_copy(update={"arrivals": []}) for w in (own, *peers)]
    assert assess(bare[0], dict(enumerate(bare[1:], 1)), 1.15, 0.05) is None
    few = [w.model_copy(update={"arrivals": w.arrivals[-3:]}) for w in (own, *peers)]  # 3 common ops: 2 spans
    assert assess(few[0], dict(enumerate(few[1:], 1)), 1.15, 0.05) is None


def test_a_peer_sharing_no_op_number_is_left_out_and_alone_gives_no_finding() -> None:
    own, p1, p2 = backend_windows(arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005))
    stranger = p2.model_copy(update={"arrivals": [(s + 10_000, t) for s, t in p2.arrivals]})
    got = from_arrivals(own, {1: p1, 2: stranger})
    assert got is not None and list(got[1]) == [1]
    a = assess(own, {1: p1, 2: stranger}, 1.15, 0.05)
    assert a is not None and a.compute_slow  # judged against rank 1 alone
    assert from_arrivals(own, {2: stranger}) is None and assess(own, {2: stranger}, 1.15, 0.05) is None


def test_an_op_some_rank_passed_without_waiting_is_no_wait() -> None:
    # DDP issues several buckets in one backward and goes on: two buckets per step, 10 ms apart on the
    # fast ranks. The slow rank is 30 ms late at each, so the fast ranks reach the second bucket before
    # the slow one reached the first: they did not wait at the first, only at the second (the step's end).
    per_step = [[0.04, 0.01], [0.04, 0.01], [0.07, 0.01]]  # compute before bucket 1, then before bucket 2
    arr: list[list[tuple[int, float]]] = [[], [], []]
    left, seq = 0.0, 0
    for _ in range(16):
        first = [left + c[0] for c in per_step]
        second = [f + c[1] for f, c in zip(first, per_step, strict=True)]
        for r in range(3):
            arr[r] += [(seq, first[r]), (seq + 1, second[r])]
        seq, left = seq + 2, max(second) + 0.005
    got = from_arrivals(*(lambda w: (w[0], {1: w[1], 2: w[2]}))(backend_windows(arr)))
    assert got is not None
    fast = got[1][1]
    # The span runs from the first bucket of step 0 to the second of step 15: a wait only at each of
    # the 16 second buckets, 30 ms each, not at the 15 first ones too (0.93 s).
    assert fast.wait_s == pytest.approx(16 * 0.03)


def test_healthy_ranks_within_3_percent_never_fire_from_arrivals() -> None:
    rng = random.Random(21)
    for me in range(3):
        tracker = defaults()
        for n in range(10):
            computes = [[0.05 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(40)] for _ in range(3)]
            wins = backend_windows(arrivals_lockstep(computes, 0.005, start=10.0 * n), n)
            own = wins.pop(me)
            assert tracker.feed(own, dict(enumerate(wins))) is None
        assert tracker.assessed == 10


@settings(max_examples=150, deadline=None)
@given(
    slow=st.floats(1.3, 3.0),
    share=st.floats(0.7, 0.95),  # the healthy step's compute share: the rest is the transfer
    peers=st.integers(1, 16),
    seed=st.integers(0, 2**32),
)
def test_arrivals_name_any_30_percent_straggler_within_3_windows(slow, share, peers, seed) -> None:
    # The transfer counts as everyone's compute (conservative): (C s + T) / (C + T) must clear the
    # threshold, 1.15, so the straggler is slow and its step computes 70% or more.
    rng = random.Random(seed)
    tracker = defaults()
    hits = []
    for n in range(3):
        computes = [
            [share * (slow if r == 0 else 1.0) * (1 + rng.uniform(-0.03, 0.03)) for _ in range(40)]
            for r in range(peers + 1)
        ]
        own, *rest = backend_windows(arrivals_lockstep(computes, 1 - share, start=1000.0 * n), n)
        if (d := tracker.feed(own, dict(enumerate(rest, 1)))) is not None:
            hits.append(d)
    assert len(hits) == 1 and hits[0].straggler is not None and hits[0].straggler.cause == "compute"


@settings(max_examples=150, deadline=None)
@given(me=st.integers(0, 16), peers=st.integers(1, 16), share=st.floats(0.05, 0.95), seed=st.integers(0, 2**32))
def test_arrivals_of_ranks_within_3_percent_never_fire(me, peers, share, seed) -> None:
    me, rng = me % (peers + 1), random.Random(seed)
    tracker = defaults()
    for n in range(10):
        bias = [rng.uniform(-0.03, 0.03) for _ in range(peers + 1)]  # a rank 3% slower all window
        computes = [[share * (1 + b) * (1 + rng.uniform(-0.03, 0.03)) for _ in range(40)] for b in bias]
        wins = backend_windows(arrivals_lockstep(computes, 1 - share, start=1000.0 * n), n)
        own = wins.pop(me)
        assert tracker.feed(own, dict(enumerate(wins))) is None


def test_the_run_delay_is_taken_at_its_windows_rate_over_the_span() -> None:
    # Rank 0 computes 30% longer by the wall clock, the extra waiting for a CPU (15 ms of each step):
    # the host's doing, not its work. Told run delays, it is no straggler.
    arr = arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005)
    starved = backend_windows(arr, delays=[10 * 15 / 70, 0.0, 0.0])  # 15 ms of each 70 ms step
    a = assess(starved[0], dict(enumerate(starved[1:], 1)), 1.15, 0.05)
    assert a is not None and not a.compute_slow and a.evidence.work_frac is not None
    assert a.evidence.slowdown == pytest.approx(1.0, abs=0.02)
    # Without every rank's run delay, all are judged on the wall clock (as the records' rule does).
    untold = backend_windows(arr, delays=[2.0, None, 0.0])  # type: ignore[list-item]
    b = assess(untold[0], dict(enumerate(untold[1:], 1)), 1.15, 0.05)
    assert b is not None and b.compute_slow and b.evidence.work_frac is None


def test_a_clock_offset_between_hosts_reads_as_lateness() -> None:
    # time_created_ns is each host's wall clock: a rank whose clock runs d ahead seems to arrive d late
    # at every op. On 50 ms of compute and 5 ms of transfer, 1 ms reads 1.02x; 10 ms 1.22x, a false straggler.
    for offset, fires, reads in ((0.001, False, 55 / 54), (0.005, False, 55 / 50), (0.010, True, 55 / 45)):
        arr = arrivals_lockstep(steady([0.05, 0.05, 0.05]), 0.005)
        arr[0] = [(s, t + offset) for s, t in arr[0]]
        own, *peers = backend_windows(arr)
        a = assess(own, dict(enumerate(peers, 1)), 1.15, 0.05)
        assert a is not None and a.compute_slow is fires, (offset, a.evidence.slowdown)
        assert a.evidence.slowdown == pytest.approx(reads, abs=1e-3)


@pytest.mark.parametrize(
    "garbage",
    [
        [(5, 1.0), (5, 2.0), (6, 0.5), (7, 1e18), (8, -1e18), (9, 0.0)],  # repeats, time going back, huge
        [(k, 1000.0) for k in range(32)],  # every op at one instant: no span
        [(k, 1000.0 - k) for k in range(32)],  # time running backwards
        [(2**62 + k, 1000.0 + k) for k in range(32)],  # huge numbers
    ],
)
def test_garbage_arrivals_never_raise_and_never_make_a_wait_longer_than_the_span(garbage) -> None:
    good = backend_windows(arrivals_lockstep(steady([0.05, 0.05, 0.05]), 0.005))
    bad = good[1].model_copy(update={"arrivals": garbage})
    for own, peers in ((bad, {0: good[0], 2: good[2]}), (good[0], {1: bad, 2: good[2]})):
        got = from_arrivals(own, peers)
        if got is not None:
            for w in (got[0], *got[1].values()):
                assert 0 <= w.wait_s <= w.length_s and 0 <= w.compute_s <= w.length_s
        assess(own, peers, 1.15, 0.05)  # a finding or none, never an exception


def test_the_schema_bounds_arrivals_and_refuses_what_is_not_a_number() -> None:
    (w,) = backend_windows([[(k, 1000.0 + k) for k in range(32)]])
    Heartbeat.model_validate(
        {"rank": 0, "host": "h", "pid": 1, "beat": 1, "time": 0.0, "phase": "", "site": "", "last_seq": {}}
        | {"last_completed": {}, "inflight": [], "window": w.model_dump(mode="json")}
    )
    blob = encode(w)
    assert decode(StragglerWindow, blob, "window", 4096) == w  # 32 arrivals: well under the heartbeat's bound
    bad = [
        {"arrivals": [[k, 1.0] for k in range(33)]},  # over 32
        {"arrivals": [[-1, 1.0]]},
        {"arrivals": [[1, float("nan")]]},
        {"arrivals": [[1, float("inf")]]},
        {"arrivals": [["x", 1.0]]},
        {"arrivals": [[1, 2.0, 3.0]]},
        {"arrivals": {"a": 1}},
        {"backend_op": "x" * 81},
    ]
    for update in bad:
        with pytest.raises(pydantic.ValidationError):
            StragglerWindow.model_validate({**w.model_dump(), **update})


class FakeBackend:
    """A world group's backend for StragglerWatch: a sequence number and arrivals, reads counted."""

    def __init__(self) -> None:
        self.number, self.reads = 0, 0

    def seq(self) -> int | None:
        return self.number

    def arrivals(self, start: float, end: float, last: int) -> tuple[str, list[tuple[int, float]]]:
        self.reads += 1
        return "gloo:all_reduce", [(k, start + 0.1 * k) for k in range(40)][-last:]


def test_the_watch_reads_torchs_recorder_only_when_its_records_fall_short_and_the_backend_ran() -> None:
    backend = FakeBackend()
    watch = StragglerWatch(0, 10.0, 1.15, 0.05, 2, marks=StepMarks(), thread=MAIN, backend=backend)
    watch.start = 0.0
    backend.number = 3  # the backend ran 3 collectives: too few for a finding, not read
    watch.tick(10.1)
    assert backend.reads == 0 and watch.window is not None and watch.window.arrivals == []
    backend.number = 200  # a DDP loop: 197 bucket all_reduces, no record
    watch.tick(20.1)
    assert backend.reads == 1 and watch.window is not None
    assert len(watch.window.arrivals) == 32 and watch.window.backend_op == "gloo:all_reduce"
    assert watch.window.arrivals[-1] == (39, pytest.approx(13.9))
    watch.tick(30.1)  # the backend ran nothing more: not read
    assert backend.reads == 1 and watch.window.arrivals == []
    # ncclguard's records hold the ops (Python collectives): the backend is not read.
    recorded = StragglerWatch(0, 10.0, 1.15, 0.05, 2, marks=StepMarks(), thread=threading.get_ident(), backend=backend)
    recorded.start = time.time()
    for _ in range(4):
        recorder.finish(recorder.start("all_reduce", "straggler-test", 1, "float32", site="t.py:1"))
    backend.number += 500
    recorded.tick(recorded.start + 10.0 + 1e-3)  # past the next boundary: the 4 records fall in the window
    win = recorded.window
    assert win is not None and win.ops >= 3 and win.arrivals == [] and backend.reads == 1


def test_world_arrivals_on_a_real_gloo_group_are_on_time_times_clock() -> None:
    # torch stamps time_created_ns with c10::getTime(): CLOCK_REALTIME on Linux, time.time()'s clock.
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        source = WorldArrivals()
        seq0 = source.seq()
        t = torch.ones(4)
        before = time.time()
        stamps, returned = [], []
        for _ in range(40):
            stamps.append(time.time())
            dist.all_reduce(t)
            returned.append(time.time())
        after = time.time()
        seq1 = source.seq()
        assert seq0 is not None and seq1 is not None and seq1 - seq0 == 40
        op, arrivals = source.arrivals(before, after, 32)
        assert op == "gloo:all_reduce" and len(arrivals) == 32 and source.read_s > 0
        assert [s for s, _ in arrivals] == list(range(arrivals[0][0], arrivals[0][0] + 32))
        # Stamped as the call reached the backend, on this clock: within the call, which a loaded
        # machine may stretch (a bound of 50 ms after the call was a speed target).
        for (_, at), called, back in zip(arrivals, stamps[-32:], returned[-32:], strict=True):
            assert called <= at <= back
        assert source.arrivals(after + 1.0, after + 2.0, 32) == ("", [])  # none in a later span
    finally:
        dist.destroy_process_group()


def test_delay_at_interpolates_between_the_ticks_samples() -> None:
    samples = [(10.0, 1.0), (11.0, 1.5), (13.0, 1.5), (14.0, 3.5)]
    assert delay_at(samples, 10.5) == pytest.approx(1.25)
    assert delay_at(samples, 12.0) == pytest.approx(1.5)
    assert delay_at(samples, 13.5) == pytest.approx(2.5)
    assert delay_at(samples, 10.0) == 1.0 and delay_at(samples, 14.0) == 3.5
    assert delay_at(samples, 9.9) is None and delay_at(samples, 14.1) is None and delay_at([], 1.0) is None


def test_the_run_delay_measured_over_the_arrivals_span_beats_the_windows_average() -> None:
    # Rank 0 waited for a CPU 15 ms of each step in the arrivals' span (a burst of load there), none in
    # the rest of its window: the window's average (0.33 s of 10 s) would leave it 1.23x "slower".
    arr = arrivals_lockstep(steady([0.065, 0.05, 0.05]), 0.005)
    span = [a[-1][1] - a[0][1] for a in arr]
    wins = backend_windows(arr, delays=[31 * 0.015, 0.0, 0.0])
    averaged = assess(wins[0], {1: wins[1], 2: wins[2]}, 1.15, 0.05)
    assert averaged is not None and averaged.compute_slow
    measured = [
        w.model_copy(update={"arrivals_run_delay_s": d}) for w, d in zip(wins, [31 * 0.015, 0.0, 0.0], strict=True)
    ]
    a = assess(measured[0], {1: measured[1], 2: measured[2]}, 1.15, 0.05)
    assert a is not None and not a.compute_slow and a.evidence.slowdown == pytest.approx(1.0, abs=0.02)
    assert a.evidence.run_delay_frac == pytest.approx(31 * 0.015 / span[0], rel=0.05)


def test_the_watch_samples_the_main_threads_run_delay_for_the_arrivals_span() -> None:
    backend = FakeBackend()
    watch = StragglerWatch(0, 10.0, 1.15, 0.05, 2, marks=StepMarks(), thread=threading.get_ident(), backend=backend)
    if watch.native is None or run_delay(watch.native) is None:
        pytest.skip("no schedstat here")
    watch.start = 0.0
    for t in (5.0, 9.5, 10.05):
        watch.tick(t)
    assert watch.window is not None and backend.reads == 0  # the backend ran nothing yet
    backend.number = 200
    for t in range(101, 202):  # a tick every 0.1 s through window 1 (arrivals at 10.0 to 13.9 s)
        watch.tick(t / 10)
    assert backend.reads == 1 and watch.window is not None and watch.window.n == 1
    assert watch.window.arrivals_run_delay_s is not None and watch.window.arrivals_run_delay_s >= 0


@settings(max_examples=300, deadline=None)
@given(
    lists=st.lists(
        st.lists(
            st.tuples(st.integers(0, 40), st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)), max_size=32
        ),
        min_size=2,
        max_size=5,
    )
)
def test_any_arrivals_give_waits_and_compute_within_the_span_or_no_finding(lists) -> None:
    wins = [
        StragglerWindow(n=0, end=10.0, length_s=10.0, compute_s=10.0, wait_s=0.0, run_delay_s=1.0, arrivals=a)
        for a in lists
    ]
    got = from_arrivals(wins[0], dict(enumerate(wins[1:], 1)))
    if got is not None:
        for w in (got[0], *got[1].values()):
            assert w.length_s > 0 and 0 <= w.wait_s <= w.length_s
            assert w.compute_s + w.wait_s == pytest.approx(w.length_s)
            assert w.run_delay_s is not None and 0 <= w.run_delay_s <= w.length_s
    assess(wins[0], dict(enumerate(wins[1:], 1)), 1.15, 0.05)  # never raises
