"""Act only on an agreed culprit (recovery/_verdict/agreement.py): the pure rule, without processes.
The verdict thread that applies it runs on real ranks in tests/watching/test_verdict_multirank.py."""

from __future__ import annotations

from ncclguard.incidents.beats import Heartbeat
from ncclguard.recovery._verdict.agreement import agreement

FRESH = 2.0


def beat(rank: int, judged: dict[str, str] | None = None) -> Heartbeat:
    return Heartbeat(
        rank=rank, host="h", pid=100 + rank, beat=1, time=0.0, phase="", site="train.py:10",
        last_seq={}, last_completed={}, inflight=[], judged=judged,
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
