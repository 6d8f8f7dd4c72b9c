"""The one judge's rules (ncclguard/watching/judge/rules.py), without processes: every seat's ruling,
the invariants over any input (hypothesis), and the levers that refuse to act without an acting ruling.
The seats that apply them run on real ranks in tests/watching/test_verdict_multirank.py and
tests/watching/test_supervise_stuck.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ncclguard.errors import NcclGuardError, UnjudgedAction
from ncclguard.watching.judge.agreement import Agreement
from ncclguard.watching.judge.rules import (
    Ruling,
    rule_ask,
    rule_fence,
    rule_left_behind,
    rule_peer,
    rule_self,
    rule_silent,
)

STEP = "0/12"
TWO = Agreement(True, "rank(s) [0] judge it stuck too", (0,))
ALONE = Agreement(True, "no other rank waits with a fresh heartbeat", ())
NOT_YET = Agreement(False, "rank 0 does not judge rank 2 stuck (not judged yet)")
VICTIM = Agreement(False, "rank 2 itself waits for rank(s) [3], which it judged stuck", victim=True)


def test_a_waiting_rank_acts_with_a_second_view_and_never_on_its_own() -> None:
    got = rule_peer(1, "stuck", "nothing moved for 10.2 s", TWO, STEP, STEP, supervised=False)
    assert (got.kind, got.views) == ("act", ("rank 1", "rank 0"))
    # The only rank waiting: its supervisor's look is asked for, never acted on here.
    got = rule_peer(1, "stuck", "nothing moved", ALONE, STEP, STEP, supervised=True)
    assert got.kind == "confirm" and not got.acts and got.asks and got.views == ("rank 1",)
    got = rule_peer(1, "stuck", "nothing moved", ALONE, STEP, STEP, supervised=False)
    assert got.kind == "await" and not got.asks
    assert got.why.endswith("and no supervisor to look: one view, no action (the step bound is the cap)")
    assert rule_peer(1, "stuck", "x", NOT_YET, STEP, STEP, True).kind == "await"
    assert rule_peer(1, "stuck", "x", VICTIM, STEP, STEP, True).kind == "victim"


def test_movement_and_staleness_act_on_nothing_whatever_the_votes() -> None:
    busy = rule_peer(1, "moving", "blocked in close() on /mnt/ckpt for 47.0 s", TWO, STEP, STEP, True)
    assert busy.kind == "busy" and "close()" in busy.why
    assert rule_peer(1, "unknown", "2 samples", TWO, STEP, STEP, True).kind == "unknown"
    # The step ended while the look ran (disarmed: nothing open), or a rebuild opened another.
    assert rule_peer(1, "stuck", "x", TWO, STEP, None, True).kind == "stale"
    assert rule_peer(1, "stuck", "x", TWO, STEP, "1/12", True).kind == "stale"
    assert rule_silent(12.0, STEP, None).kind == "stale"
    assert rule_silent(12.0, STEP, STEP).kind == "ask"


def test_a_rank_acts_on_itself_only_once_a_waiting_peer_agrees() -> None:
    got = rule_self("stuck", "nothing moved", TWO, STEP, STEP)
    assert got.kind == "act" and got.views == ("itself", "rank 0")
    assert rule_self("stuck", "nothing moved", ALONE, STEP, STEP).kind == "await"  # its own samples alone
    assert rule_self("stuck", "nothing moved", NOT_YET, STEP, STEP).kind == "await"
    assert rule_self("moving", "cpu", TWO, STEP, STEP).kind == "busy"


def test_the_supervisor_acts_on_two_views_and_vetoes_what_it_sees_move() -> None:
    assert rule_ask("stuck", True, "stuck", "stopped", True, 0.0, 3.0).acts
    assert rule_ask("stuck", True, "unknown", "1 sample", False, 0.0, 3.0).acts  # agreed by the waiting ranks
    veto = rule_ask("stuck", True, "moving", "blocked in close() on /mnt", False, 0.0, 3.0)
    assert veto.kind == "veto" and "sees it moving" in veto.why
    assert rule_ask("stuck", True, "moving", "cpu", True, 0.0, 3.0).acts  # stopped: what it shows is no movement
    # Posted dead by the waiting ranks: the grace for a rank that exits by itself, then ended.
    assert rule_ask("stuck", False, "stuck", "x", True, 1.0, 3.0).kind == "wait"
    assert rule_ask("stuck", False, "moving", "cpu", False, 3.0, 3.0).acts
    # One waiting rank's view (confirm) or none (unknown): only its own look of stuck acts.
    for judged in ("confirm", "unknown"):
        assert rule_ask(judged, True, "stuck", "stopped", True, 0.0, 3.0).views == ("the asker", "its supervisor")
        assert rule_ask(judged, True, "moving", "cpu", False, 0.0, 3.0).kind == "busy"
        assert rule_ask(judged, True, "unknown", "1 sample", False, 0.0, 3.0).kind == "wait"


def test_the_fence_and_the_left_behind_act_on_their_own_evidence_only() -> None:
    assert rule_fence(2, None).kind == "wait"
    assert rule_fence(2, [1]).kind == "await"
    assert rule_fence(2, [1, 2]).acts
    assert rule_left_behind(3, 2, False, True, 29.0, 30.0).kind == "wait"
    assert rule_left_behind(3, 2, False, True, 30.0, 30.0).acts
    for told, member, recorded in ((True, True, 3), (False, False, 3), (False, True, 2), (False, True, None)):
        assert rule_left_behind(recorded, 2, told, member, 99.0, 30.0).kind == "await"


def test_a_lever_reached_without_an_acting_ruling_refuses_before_anything_is_done() -> None:
    from ncclguard.recovery._verdict.levers import ask_supervisor, post_stuck_death

    confirm = rule_peer(1, "stuck", "x", ALONE, STEP, STEP, supervised=True)
    with pytest.raises(UnjudgedAction, match="the death notice of rank 2 refused"):
        post_stuck_death(None, 2, 1234, "h", confirm)  # no world, no store: it must refuse first
    with pytest.raises(UnjudgedAction, match=r"an ask \(stuck\) about launch rank 2 refused"):
        ask_supervisor(2, (1234, ""), "stuck", True, 10.0, 1, confirm)
    stale = rule_peer(1, "stuck", "x", TWO, STEP, None, supervised=True)
    with pytest.raises(UnjudgedAction):
        ask_supervisor(2, (1234, ""), "confirm", True, 10.0, 1, stale)
    assert issubclass(UnjudgedAction, NcclGuardError)


STATES = st.sampled_from(["moving", "stuck", "unknown"])
ABOUT = st.sampled_from([None, "0/11", "0/12", "1/12"])
AGREEMENTS = st.builds(
    Agreement,
    agreed=st.booleans(),
    why=st.just("w"),
    voters=st.lists(st.integers(0, 7), max_size=3, unique=True).map(tuple),
    victim=st.booleans(),
)


def _invariants(got: Ruling, state: str, about: str | None, open_about: str | None) -> None:
    if got.acts:
        assert len(got.views) >= 2, got  # two views or more, named
        assert state == "stuck" and about == open_about, got
    if about != open_about:
        assert got.kind == "stale" and not got.asks


@given(STATES, AGREEMENTS, ABOUT, ABOUT, st.booleans())
def test_no_seat_acts_on_one_view_on_movement_or_on_a_stale_look(state, agreed, about, open_about, supervised) -> None:
    peer = rule_peer(1, state, "e", agreed, about, open_about, supervised)
    _invariants(peer, state, about, open_about)
    if peer.acts:
        assert agreed.agreed and agreed.voters and not agreed.victim
    if agreed.victim and not agreed.agreed:
        assert not peer.asks
    _invariants(rule_self(state, "e", agreed, about, open_about), state, about, open_about)


@given(st.sampled_from(["stuck", "confirm", "unknown"]), st.booleans(), STATES, st.booleans(), st.floats(0, 10))
def test_a_supervisor_never_ends_a_process_it_sees_move_unless_the_world_went_on_without_it(
    judged, heal, state, stopped, waited
) -> None:
    got = rule_ask(judged, heal, state, "e", stopped, waited, 3.0)
    if state == "moving" and not stopped and got.acts:
        # Only once its death is posted on an agreed verdict (the world went on without it) and the
        # grace is over: the kill is then cleanup, no judgment.
        assert (judged, heal) == ("stuck", False) and waited >= 3.0
    if judged != "stuck" and got.acts:
        assert state == "stuck" and got.views == ("the asker", "its supervisor")
