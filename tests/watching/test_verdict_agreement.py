"""Act only on an agreed culprit (watching/judge/agreement.py): the pure rule, without processes.
The verdict thread that applies it runs on real ranks in tests/watching/test_verdict_multirank.py."""

from __future__ import annotations

from ncclguard.incidents.beats import Heartbeat
from ncclguard.watching.judge.agreement import agreement

FRESH = 2.0


def beat(rank: int, judged: dict[str, str] | None = None, about: str | None = None) -> Heartbeat:
    return Heartbeat(
        rank=rank, host="h", pid=100 + rank, beat=1, time=0.0, phase="", site="train.py:10",
        last_seq={}, last_completed={}, inflight=[], judged=judged, judged_about=about,
    )  # fmt: skip


def test_a_victim_that_waits_for_a_stuck_rank_is_never_acted_on() -> None:
    # The 3 ranks: rank 2 asleep; rank 1 cut its link to 2 first and moved on, so rank 0, still
    # waiting for 2, looks still from rank 1. Rank 0's own heartbeat says it waits for a stuck rank 2.
    beats = {0: (beat(0, {"2": "stuck: nothing moved for 26.8 s"}), 0.5), 2: (beat(2), 0.5)}
    got = agreement(0, 1, beats, FRESH)
    assert not got.agreed and got.why == "rank 0 itself waits for rank(s) [2], which it judged stuck"


def test_the_culprit_is_acted_on_once_every_other_waiting_rank_judges_it_stuck() -> None:
    beats = {0: (beat(0), 0.5), 2: (beat(2), 0.5)}
    got = agreement(2, 1, beats, FRESH)
    assert not got.agreed and got.why == "rank 0 does not judge rank 2 stuck (not judged yet)"
    beats[0] = (beat(0, {"2": "moving: cpu"}), 0.5)
    assert agreement(2, 1, beats, FRESH).why == "rank 0 does not judge rank 2 stuck (moving: cpu)"
    beats[0] = (beat(0, {"2": "stuck: nothing moved for 10.2 s (cpu, io, ops, stack)"}), 0.5)
    got = agreement(2, 1, beats, FRESH)
    assert got.agreed and got.voters == (0,) and got.why == "rank(s) [0] judge it stuck too"


def test_a_rank_without_a_fresh_heartbeat_has_no_say_and_a_lone_waiter_decides_alone() -> None:
    # Rank 0 stopped too (its last beat 9 s old): it neither blocks nor counts.
    beats = {0: (beat(0), 9.0), 2: (beat(2, {"0": "stuck: x"}), 9.0)}
    got = agreement(2, 1, beats, FRESH)
    assert got.agreed and got.voters == () and got.why == "no other rank waits with a fresh heartbeat"
    assert agreement(1, 0, {1: (beat(1), 0.1)}, FRESH).agreed  # a world of 2: the only waiting rank


def test_a_rank_that_judges_itself_stuck_acts_only_once_its_waiting_peers_agree(monkeypatch) -> None:
    """The self-check (recovery/_verdict/self_check.py) is no lone judge: a rank whose own samples say
    stuck (nothing of it moved past the bound) waits for the ranks ahead of it to judge it stuck too;
    then it asks its supervisor (heal under restarts), once."""
    import torch.distributed as dist

    from ncclguard.recovery._verdict import self_check
    from ncclguard.recovery._verdict.seen import Seen
    from ncclguard.watching.sensors.progress import Progress, Sample

    asks: list[tuple] = []
    monkeypatch.setattr(self_check, "ask_supervisor", lambda *a: asks.append(a) or True)
    events: list[tuple] = []
    check = self_check.SelfCheck("test", exits=True, restarts=lambda: True, event=lambda *a, **k: events.append(a))
    seen = Seen(started=0.0, still_s=10.0, own=Progress(10.0))
    assert seen.own is not None
    for t in (0.0, 5.0, 12.0):  # nothing moves: its CPU and ops stay put
        seen.own.observe(Sample(t, "self", ops=7, cpu_s=1.0))
    assert seen.own.judge(12.0).state == "stuck"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lone = {1: (beat(1), 0.5), 2: (beat(2, {"0": "moving: cpu"}), 0.5)}
        check.check(seen, [1, 2], 12.0, lone, FRESH)
        check.check(seen, [1, 2], 13.0, lone, FRESH)
        assert asks == [] and seen.self_asked is None
        assert [e[0] for e in events] == ["self-awaiting"]  # said once, no action
        agreed = {1: (beat(1, {"0": "stuck: nothing moved"}), 0.5), 2: (beat(2, {"0": "stuck: x"}), 0.5)}
        stale = {1: (beat(1, {"0": "stuck: nothing moved"}), 9.0), 2: (beat(2, {"0": "stuck: x"}), 9.0)}
        check.check(seen, [1, 2], 14.0, stale, FRESH)  # no fresh heartbeat: nobody agrees, nothing done
        assert asks == []
        check.check(seen, [1, 2], 15.0, agreed, FRESH)
        assert len(asks) == 1 and seen.self_asked == 15.0
        assert [e[0] for e in events] == ["self-awaiting", "self-asked"]
    finally:
        dist.destroy_process_group()


def test_a_vote_counts_only_for_the_step_it_is_about() -> None:
    """A vote left in a heartbeat from the step before (a judgment of rank 2 at step 11, carried into
    step 12's heartbeats) is no vote at step 12; the accused's own stale vote makes it no victim."""
    stale = {0: (beat(0, {"2": "stuck: nothing moved for 12.0 s"}, about="0/11"), 0.5), 2: (beat(2), 0.5)}
    got = agreement(2, 1, stale, FRESH, about="0/12")
    assert not got.agreed and got.why == "rank 0 does not judge rank 2 stuck (its votes are about step 0/11, not 0/12)"
    now = {0: (beat(0, {"2": "stuck: nothing moved for 12.0 s"}, about="0/12"), 0.5), 2: (beat(2), 0.5)}
    assert agreement(2, 1, now, FRESH, about="0/12").agreed
    assert not agreement(2, 1, now, FRESH, about="1/12").agreed  # the same step number in another world
    # Rank 0 judged rank 2 stuck at step 11; at step 12 rank 0 is the one behind: no victim's alibi.
    victim = {0: (beat(0, {"2": "stuck: x"}, about="0/11"), 0.5)}
    assert agreement(0, 1, victim, FRESH, about="0/12").agreed
    assert not agreement(0, 1, victim, FRESH).agreed  # without the step, the old vote would still shield it


def test_a_rank_that_stood_judges_afresh_from_fresh_views() -> None:
    """A rank whose threads stood (torch.save's close() on network storage holds the GIL: its verdict
    and its watchdog stop with it) holds views of its peers as old as the stand: a peer idle in its op
    looks still. Its next look starts the window afresh and judges nothing until its views are fresh."""
    from ncclguard.recovery._verdict.seen import Seen
    from ncclguard.watching.sensors.progress import Progress, Sample

    seen = Seen(started=0.0, still_s=10.0)
    assert seen.stood(0.0, 3.0, 5.0) is None and seen.stood(1.0, 3.0, 5.0) is None  # looks every second
    seen.peers[1] = Progress(10.0)
    for t in (0.0, 1.0):
        seen.peers[1].observe(Sample(t, "process", cpu_s=2.0))
    seen.own = Progress(10.0)
    assert seen.stood(29.0, 3.0, 5.0) == 28.0  # a 28 s close(): nothing of the peer moved in that time
    assert seen.peers == {} and seen.own is None and seen.beats == {} and seen.stood_until == 34.0
    assert seen.stood(30.0, 3.0, 5.0) is None and seen.stood_until == 34.0  # the grace stands
