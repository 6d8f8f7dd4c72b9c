"""The watchdog's hang bound learned per phase (ncclguard/watching/base/hang_bound.py): pure logic driven tick by
tick as the watchdog drives it, what it keeps in a real store, what the user's setting does, and what
``python -m ncclguard status`` says with it. No process group."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from ncclguard.incidents.model import Heartbeat
from ncclguard.store.keys import Keys
from ncclguard.store.learned import hang_key
from ncclguard.watching.base.hang_bound import HANG_VAR, UNPHASED, HangBound, given, phase_kind
from ncclguard.watching.base.learner import WARMUP
from ncclguard.watching.base.settings import WatchdogConfig
from ncclguard.watching.base.watchdog_store import WatchdogStore


class Job:
    """Drives a HangBound as the watchdog's ticks do: ``run(seconds, kinds)`` ticks every 0.5 s and moves
    this rank's backend numbers once at its end (one interval between collectives)."""

    def __init__(self, bound: HangBound) -> None:
        self.bound, self.now, self.total, self.cases = bound, 100.0, 7, 0
        self.changes: list = []
        self.tick({UNPHASED})  # the first look
        self.total += 1
        self.tick({UNPHASED})  # the first move: the interval before it held the start-up, not counted

    def tick(self, kinds: set[str]) -> None:
        change = self.bound.tick(self.now, self.total, kinds, self.cases)
        if change is not None:
            self.changes.append(change)

    def run(self, seconds: float, kinds: set[str]) -> None:
        end = self.now + seconds
        while self.now + 0.5 < end:
            self.now += 0.5
            self.tick(kinds)
        self.now, self.total = end, self.total + 1
        self.tick(kinds)


def test_each_phase_learns_its_own_bound_and_the_bound_in_force_is_the_largest_of_the_phases_now(caplog):
    hb = HangBound(300.0, 5.0, fixed=False, name="rank 0")
    job = Job(hb)
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        for _ in range(WARMUP):
            job.run(0.5, {"train"})
    # Ten train intervals of 0.5 s: 5 x 0.5 = 2.5 s, clamped up to the floor (2 heartbeats, at least 10 s).
    assert hb.bound({"train"}) == 10.0 and hb.learner.learned("train")
    assert "learned hang bound for phase 'train' 300 s -> 10 s (clamped up to the floor 10 s from 2.5 s" in caplog.text
    # A peer in a long evaluation: the interval counts for eval, never for train; eval has its own warm-up,
    # so a rank waiting in a train step while a peer evaluates keeps the default until then.
    job.run(40.0, {"train", "eval"})
    assert hb.learner.state.longest_s["train"] == 0.5 and hb.learner.state.counts["eval"] == 1
    assert hb.bound({"train"}) == 10.0 and hb.bound({"train", "eval"}) == 300.0
    for _ in range(WARMUP - 1):
        job.run(20.0, {"eval"})
    assert hb.bound({"eval"}) == 200.0 and hb.bound({"train", "eval"}) == 200.0  # 5 x the longest, 40 s
    # A save on rank 0 seen by a rank in a train step: it teaches save, not train.
    job.run(60.0, {"train", "save"})
    assert hb.bound({"train"}) == 10.0 and not hb.learner.learned("save") and hb.bound({"save"}) == 300.0
    # Outside any phase: a kind of its own.
    assert phase_kind("") == UNPHASED and phase_kind("train step=3 > eval batch=2") == "eval"
    assert hb.bound({UNPHASED}) == 300.0
    assert [(c.kind, c.new_s) for c in job.changes] == [("train", 10.0), ("eval", 200.0)]
    assert hb.dirty


def test_a_hang_and_a_world_change_teach_nothing_and_a_value_over_the_cap_is_clamped(caplog):
    hb = HangBound(120.0, 5.0, fixed=False)
    job = Job(hb)
    for _ in range(WARMUP):
        job.run(1.0, {"train"})
    assert hb.bound({"train"}) == 10.0
    job.cases = 1  # an incident opened during the next interval (a hang): not counted
    job.run(500.0, {"train"})
    assert hb.learner.state.longest_s["train"] == 1.0 and hb.bound({"train"}) == 10.0
    hb.new_world()  # a rebuild: the numbers start again; the interval across it is not counted
    job.total = 3
    job.tick({"train"})
    job.run(400.0, {"train"})  # the first move of the new world
    assert hb.learner.state.longest_s["train"] == 1.0
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        job.run(30.0, {"train"})  # 5 x 30 s = 150 s, over the cap (the configured 120 s)
    assert hb.bound({"train"}) == 120.0
    assert "120 s (clamped down to the cap 120 s from 150 s, after 11 intervals)" in caplog.text


def test_the_users_setting_wins_from_a_field_the_environment_or_the_cli(monkeypatch):
    monkeypatch.delenv(HANG_VAR, raising=False)
    assert not given(WatchdogConfig().model_fields_set)
    assert given(WatchdogConfig(hang_timeout_s=40).model_fields_set)
    monkeypatch.setenv(HANG_VAR, "40")  # what --ncclguard-hang-timeout-s sets for the ranks
    cfg = WatchdogConfig()
    assert cfg.hang_timeout_s == 40 and given(cfg.model_fields_set)
    fixed = HangBound(40.0, 5.0, fixed=True)
    job = Job(fixed)
    for _ in range(2 * WARMUP):
        job.run(0.5, {"train"})
    assert fixed.bound({"train", "eval"}) == 40.0 and not job.changes and not fixed.dirty


def _store() -> WatchdogStore:
    # Each call's bound (30 s) is a hang guard: every call here must answer, and a 1 s bound can pass
    # on a loaded machine (the learned bounds would then be missing, not wrong).
    return WatchdogStore(dist.HashStore(), Keys("main"), 30.0, 60.0)


def test_what_was_learned_survives_a_restart_through_the_store_and_a_bad_value_is_ignored(caplog):
    store = _store()
    first = HangBound(300.0, 5.0, fixed=False)
    job = Job(first)
    for _ in range(WARMUP):
        job.run(3.0, {"train"})
    first.save(store, 2)
    assert not first.dirty and store.read_learned(hang_key(2)) is not None
    again = HangBound(300.0, 5.0, fixed=False)  # a restarted process of launch rank 2
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        again.load(store, 2)
    assert again.bound({"train"}) == 15.0 and again.learner.state == first.learner.state
    assert "learned hang bounds from the store: phase 'train' 15 s (5 x the longest interval seen)" in caplog.text
    other = HangBound(300.0, 5.0, fixed=False)
    other.load(store, 1)  # nothing under launch rank 1: the default holds
    assert other.bound({"train"}) == 300.0
    store.put_learned(hang_key(3), '{"counts": {"train": "many"}}')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        bad = HangBound(300.0, 5.0, fixed=False)
        bad.load(store, 3)
    assert bad.bound({"train"}) == 300.0 and "does not parse; ignored" in caplog.text
    # A persisted value outside floor and cap (a longer cap before, a hand-written value) is clamped.
    store.put_learned(hang_key(4), '{"counts": {"train": 12}, "longest_s": {"train": 900.0}}')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        clamped = HangBound(300.0, 5.0, fixed=False)
        clamped.load(store, 4)
    assert clamped.bound({"train"}) == 300.0 and "clamped down to the cap 300 s from 4.5e+03 s" in caplog.text


def test_status_judges_a_long_op_against_the_ranks_own_bound():
    from ncclguard.cli.status_read import RankRow, _health
    from ncclguard.watching.base.index import WatchIndex

    index = WatchIndex(
        run_id="r",
        restart="0",
        session="main",
        generation=0,
        world_size=2,
        heartbeat_s=5.0,
        peer_timeout_s=30.0,
        hang_timeout_s=300.0,
        written=0.0,
    )
    rows = [
        RankRow(rank=0, state="ok", inflight_s=8.0, hang_bound_s=10.0),  # over half of its learned 10 s
        RankRow(rank=1, state="ok", inflight_s=8.0),  # no bound in its heartbeat: the index's 300 s
    ]
    health, reasons = _health(rows, [], index)
    assert health == "suspect" and reasons == ["in one op for over half of its hang bound (10 s): ranks 0"]


def test_a_heartbeat_carries_the_bound():
    hb = Heartbeat(
        rank=0,
        host="h",
        pid=1,
        beat=1,
        time=0.0,
        phase="",
        site="",
        last_seq={},
        last_completed={},
        inflight=[],
        hang_bound_s=10.0,
    )
    assert Heartbeat.model_validate_json(hb.model_dump_json()).hang_bound_s == 10.0


@pytest.mark.parametrize("path,kind", [("save step=4", "save"), ("x" * 100, "x" * 40), ("train > ", "train")])
def test_phase_kinds(path, kind):
    assert phase_kind(path) == kind


def test_a_ladder_that_acts_keeps_the_configured_bound(monkeypatch):
    """Rungs past ``report`` act on a hang without progress evidence: a busy rank must not meet them after
    a learned 10 s, so with such a ladder hang_timeout_s holds; the default ladder (report) learns."""
    from ncclguard.watching.watchdog import Watchdog

    monkeypatch.delenv(HANG_VAR, raising=False)
    monkeypatch.delenv("NCCLGUARD_WATCHDOG_ACTION", raising=False)
    assert Watchdog().hang.fixed is False
    for action in ("raise", "abort", "fence", "exit"):
        assert Watchdog(action=action).hang.fixed is True, action
    assert Watchdog(hang_timeout_s=60).hang.fixed is True
