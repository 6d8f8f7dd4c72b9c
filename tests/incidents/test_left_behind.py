"""The left-behind fence without processes: when a rank counts as left behind (pure), and the job's
world record read through the watchdog's store protocol (torch's HashStore, hostile values
included). The real-rank test is tests/recovery/test_fence_multirank.py::test_a_stuck_rank_nobody_names_...
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from ncclguard.store.codec import encode
from ncclguard.store.keys import world_record_key
from ncclguard.store.world_record import MAX_RECORD_BYTES, WorldRecord
from ncclguard.watching.base.watchdog_store import Keys, WatchdogStore
from ncclguard.watching.desk.left_behind import LeftBehind
from ncclguard.watching.watchdog import Watchdog


def test_a_newer_generation_counts_only_after_the_grace_and_resets_when_it_is_gone():
    lb = LeftBehind(grace_s=2.0)
    assert lb.observe(1, 0, told=False, member=True, now=10.0) is False  # first seen
    assert lb.observe(1, 0, told=False, member=True, now=11.9) is False
    assert lb.observe(1, 0, told=False, member=True, now=12.0) is True  # seen for the whole grace
    # The watchdog followed its own rebuild meanwhile (a member that was only slow to follow).
    assert lb.observe(1, 1, told=False, member=True, now=12.5) is False
    assert lb.since is None
    assert lb.observe(2, 1, told=False, member=True, now=13.0) is False  # the clock starts again


@pytest.mark.parametrize(
    ("recorded", "mine", "told", "member"),
    [
        (None, 0, False, True),  # no rebuild recorded a world yet
        (0, 0, False, True),  # the record is this rank's own world
        (1, 2, False, True),  # an older record (this rank is ahead of it)
        (3, 0, True, True),  # the process was told (its rebuild_world came late): its code decides
        (3, 0, False, False),  # a restarted process waiting to rejoin holds no group yet
    ],
)
def test_nothing_excuses_less_than_a_newer_world_this_process_was_not_told_of(recorded, mine, told, member):
    lb = LeftBehind(grace_s=0.5)
    assert not any(lb.observe(recorded, mine, told=told, member=member, now=t) for t in (0.0, 1.0, 100.0))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans(), st.booleans()), max_size=40))
def test_it_never_acts_before_a_newer_untold_world_was_seen_for_the_grace(readings):
    lb = LeftBehind(grace_s=1.0)
    run_start = None
    for i, (recorded, mine, told, member) in enumerate(readings):
        now = float(i) * 0.3
        acted = lb.observe(recorded, mine, told=told, member=member, now=now)
        behind = recorded > mine and not told and member
        run_start = (run_start if run_start is not None else now) if behind else None
        assert acted == (behind and run_start is not None and now - run_start >= 1.0)


def wstore(store: dist.Store) -> WatchdogStore:
    return WatchdogStore(store, Keys("main"), 1.0, 5.0)


def test_the_world_record_is_read_outside_the_watchdogs_namespace():
    store = dist.HashStore()
    ws = wstore(store)
    assert ws.read_world_record() is None
    rec = WorldRecord(generation=2, origins=[0, 1, 3], backend="gloo", timeout_s=6.0)
    store.set(world_record_key(), encode(rec))
    assert ws.read_world_record() == rec


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"generation": -1, "origins": [0], "backend": "gloo", "timeout_s": 1}',
        b'{"generation": 1, "origins": [], "backend": "gloo", "timeout_s": 1}',
        b'{"generation": 1, "origins": [0], "backend": "gloo", "timeout_s": 1, "extra": 1}',
        b'{"generation": 1, "origins": [0], "backend": "gloo", "timeout_s": NaN}',
        b"[" * 100_000,
        b" " * (MAX_RECORD_BYTES + 1),
    ],
)
def test_a_hostile_world_record_reads_as_none_and_is_logged_once(raw, caplog):
    store = dist.HashStore()
    store.set(world_record_key(), raw)
    ws = wstore(store)
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        assert ws.read_world_record() is None
        assert ws.read_world_record() is None
    assert len([r for r in caplog.records if world_record_key() in r.getMessage()]) == 1


def test_only_a_ladder_that_fences_watches_for_being_left_behind():
    assert Watchdog(action="report")._left is None
    wd = Watchdog(action="fence", fence_after_s=12.0)
    assert wd._left is not None and wd._left.grace_s == 12.0
