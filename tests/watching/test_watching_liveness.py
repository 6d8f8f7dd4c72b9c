"""Peer liveness on synthetic heartbeats and clocks: who is watched, when a peer goes stale, that
it is announced once, and that it comes back."""

from __future__ import annotations

import pytest

from ncclguard.incidents.model import Heartbeat, PeerView
from ncclguard.watching.sensors.detect import SeqView
from ncclguard.watching.sensors.liveness import Liveness, SeqClock, watched_peers


def hb(rank: int, beat: int) -> Heartbeat:
    return Heartbeat(
        rank=rank,
        host="h",
        pid=1,
        beat=beat,
        time=0.0,
        phase="",
        site="?",
        last_seq={},
        last_completed={},
        inflight=[],
    )


def test_each_rank_watches_the_next_ones_in_ring_order():
    assert watched_peers(6, 8, 3) == [7, 0, 1]
    assert watched_peers(0, 3, 16) == [1, 2]  # never more than the others
    assert watched_peers(0, 1, 16) == []
    # Every rank is watched by as many ranks as it watches.
    watchers = [r for src in range(8) for r in watched_peers(src, 8, 3)]
    assert sorted(watchers) == sorted(list(range(8)) * 3)


def test_a_peer_whose_beat_stops_goes_stale_after_peer_timeout_and_is_announced_once():
    live = Liveness(0, 3, watch_peers=2, peer_timeout=3.0, startup_grace_s=60.0)
    assert live.stale(100.0) == {}  # nothing watched yet
    live.observe({1: hb(1, 1), 2: hb(2, 1)}, now=100.0)
    live.observe({1: hb(1, 2), 2: hb(2, 1)}, now=101.0)  # rank 2's beat did not change
    assert live.stale(102.9) == {}
    assert live.stale(103.0) == {2: 3.0}
    assert live.newly_stale(103.5) == {2: 3.5}
    assert live.newly_stale(103.9) == {}  # announced already; rank 1 beat at 101
    assert live.stale(104.1) == pytest.approx({1: 3.1, 2: 4.1})
    assert live.newly_stale(104.1).keys() == {1}
    views = live.views(104.1)
    assert views["2"] == PeerView(age_s=4.1, stale=True, seen=True)
    assert live.heartbeats() == {1: hb(1, 2), 2: hb(2, 1)}


def test_a_stale_peer_that_beats_again_is_reported_back_and_can_be_announced_again():
    live = Liveness(0, 2, watch_peers=16, peer_timeout=2.0, startup_grace_s=60.0)
    live.observe({1: hb(1, 1)}, now=0.0)
    assert live.newly_stale(2.5) == {1: 2.5}
    assert live.observe({1: hb(1, 1)}, now=3.0) == []  # the same beat: still silent
    assert live.observe({1: hb(1, 2)}, now=4.0) == [1]
    assert live.stale(5.0) == {}
    assert live.newly_stale(6.0) == {1: 2.0}


def test_a_peer_never_heard_from_gets_the_startup_grace():
    live = Liveness(1, 3, watch_peers=2, peer_timeout=3.0, startup_grace_s=20.0)
    assert live.watched == [2, 0]
    live.observe({2: hb(2, 1)}, now=0.0)  # rank 0 has not published yet
    assert live.stale(10.0) == {2: 10.0}
    assert live.stale(20.0) == {2: 20.0, 0: 20.0}
    assert live.views(20.0)["0"] == PeerView(age_s=20.0, stale=True, seen=False)


def test_backend_numbers_stand_still_from_when_the_rank_itself_saw_them_change():
    clock = SeqClock()
    clock.update({"0": 5}, now=10.0)
    clock.update({"0": 5}, now=12.0)
    assert clock.views(13.0) == {"0": SeqView(5, 3.0)} and clock.still(13.0) == {"0": 3.0}
    clock.update({"0": 6, "1": 2}, now=14.0, still={"0": 0.5, "1": 30.0})  # dated back by the rank's own count
    assert clock.views(15.0) == {"0": SeqView(6, 1.5), "1": SeqView(2, 31.0)}


def test_the_live_peers_numbers_come_from_their_heartbeats():
    live = Liveness(0, 3, watch_peers=2, peer_timeout=3.0, startup_grace_s=60.0)
    beat = hb(1, 1).model_copy(update={"backend_seq": {"0": 8}, "backend_still": {"0": 2.0}})
    live.observe({1: beat, 2: hb(2, 1)}, now=100.0)  # rank 2's torch gives no numbers
    assert live.seq_views(101.0) == {1: {"0": SeqView(8, 3.0)}}
    live.observe({1: beat.model_copy(update={"beat": 2})}, now=102.0)  # a new beat, the same number
    assert live.seq_views(104.0) == {1: {"0": SeqView(8, 6.0)}}
    assert live.seq_views(105.5) == {}  # rank 1 is stale now: the lost detector speaks for it
