"""ncclguard.recovery without launching ranks: the meeting's logic, the meeting itself on a real
in-process store (torch's HashStore) with one thread per rank, the reaper, and argument checks."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch.distributed as dist

from ncclguard import rebuild_world
from ncclguard.deadlines import Deadline
from ncclguard.errors import StoreUnreachable
from ncclguard.recovery import generation
from ncclguard.recovery._rebuild.meeting import (
    MAX_ARRIVAL_BYTES,
    Arrival,
    Meeting,
    MeetingKeys,
    MeetingOutcome,
    Roster,
    check_arrivals,
    decide,
    dense_rank_map,
    handshake_timeout,
    meet,
    parse,
    validate_arguments,
    world_prefix,
)
from ncclguard.recovery._rebuild.reaper import Reaper
from ncclguard.recovery.rebuild import RebuildResult, _forget_generation
from ncclguard.world import WorldChange, current_world, notify, subscribe


def arrival(rank: int, size: int = 3, **over: object) -> Arrival:
    fields = dict(rank=rank, world_size=size, generation=0, backend="gloo", allow_shrink=False, host="h", pid=1)
    fields.update(over)
    return Arrival(**fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------- pure logic


def test_decide_everyone_missing_and_shrink():
    assert decide([2, 0, 1], 3, False) == MeetingOutcome(arrived=[0, 1, 2], ok=True, shrunk=False)
    assert decide([0, 2], 3, False) == MeetingOutcome(arrived=[0, 2], ok=False, shrunk=True)
    assert decide([0, 2], 3, False).missing(3) == [1]
    assert decide([0, 2], 3, True) == MeetingOutcome(arrived=[0, 2], ok=True, shrunk=True)
    assert decide([], 3, True).ok is False
    with pytest.raises(ValueError, match="outside a world of 3"):
        decide([0, 3], 3, True)


def test_dense_rank_map_keeps_order():
    assert dense_rank_map([5, 0, 2]) == {0: 0, 2: 1, 5: 2}
    assert dense_rank_map([0, 1, 2]) == {0: 0, 1: 1, 2: 2}


def test_check_arrivals_finds_every_disagreement():
    everyone = MeetingOutcome(arrived=[0, 1], ok=True)
    assert check_arrivals(everyone, {0: arrival(0, 2), 1: arrival(1, 2)}, 2) is None
    assert "could not be read" in check_arrivals(everyone, {0: arrival(0, 2)}, 2)
    assert "another rank's key" in check_arrivals(everyone, {0: arrival(0, 2), 1: arrival(0, 2)}, 2)
    assert "backend" in check_arrivals(everyone, {0: arrival(0, 2), 1: arrival(1, 2, backend="nccl")}, 2)
    assert "world size" in check_arrivals(everyone, {0: arrival(0, 2), 1: arrival(1, 3)}, 2)
    assert "one of 3" in check_arrivals(everyone, {0: arrival(0, 2), 1: arrival(1, 2)}, 3)
    shrunk = MeetingOutcome(arrived=[0, 1], ok=True, shrunk=True)
    mixed = {0: arrival(0, allow_shrink=True), 1: arrival(1, allow_shrink=False)}
    assert "ranks [1] passed allow_shrink=False" in check_arrivals(shrunk, mixed, 3)


def test_parse_refuses_large_or_malformed_peer_data():
    good = arrival(1).model_dump_json()
    assert parse(Arrival, good, MAX_ARRIVAL_BYTES) == arrival(1)
    # The store layer's one codec words every refusal (ncclguard.store.codec.decode).
    with pytest.raises(ValueError, match=f"over the {MAX_ARRIVAL_BYTES}-byte bound of a Arrival"):
        parse(Arrival, good + " " * MAX_ARRIVAL_BYTES, MAX_ARRIVAL_BYTES)
    with pytest.raises(ValueError, match="not a valid Arrival"):
        parse(Arrival, b"\x80\x04pickle", MAX_ARRIVAL_BYTES)
    with pytest.raises(ValueError, match="not a valid Arrival"):
        parse(Arrival, good.replace('"pid":1', '"pid":1,"extra":2'), MAX_ARRIVAL_BYTES)
    with pytest.raises(ValueError, match="not a valid MeetingOutcome"):
        parse(MeetingOutcome, b'{"arrived": [0, "x"], "ok": true}', 1000)


def test_arguments_are_checked():
    assert validate_arguments(2, True) == 2.0
    assert validate_arguments(timedelta(seconds=3), False) == 3.0
    for timeout, shrink, exc, text in [
        (0, False, ValueError, "positive"),
        (-1.5, False, ValueError, "positive"),
        (float("inf"), False, ValueError, "positive"),
        ("60", False, TypeError, "seconds"),
        (True, False, TypeError, "seconds"),
        (5, "yes", TypeError, "allow_shrink"),
        (5, 1, TypeError, "allow_shrink"),
    ]:
        with pytest.raises(exc, match=text):
            validate_arguments(timeout, shrink)


def test_handshake_gets_at_least_a_quarter_of_the_timeout():
    assert handshake_timeout(60, 50) == 50
    assert handshake_timeout(60, 0.1) == 15
    assert handshake_timeout(4, -1) == 2.0


def test_keys_are_namespaced_by_generation_and_attempt():
    k = MeetingKeys(3, 1)
    assert k.arrival(2) == "ncclguard/rebuild/g3/t1/a2"
    assert k.outcome == "ncclguard/rebuild/g3/t1/v"
    assert k.outcome not in k.transient(4) and len(k.transient(4)) == 6
    assert world_prefix(3) == "ncclguard/world/g3"


# ----------------------------------------------------------------- the meeting, one thread per rank


# A bound that only a hung meeting reaches: the deadline of the ranks that must not be late.
HANG_GUARD_S = 30.0


def run_meeting(
    store: dist.Store,
    ranks: dict[int, tuple[float, bool]],
    size: int = 3,
    attempt: int = 0,
    deadline_s: float = 1.0,
    settler: int | None = None,
):
    """Each rank: (seconds it waits before arriving, allow_shrink); deadline ``deadline_s`` after it
    arrives. Where every rank comes, or the rank is late, a long deadline costs nothing (the meeting
    settles when the last one arrives, a late rank reads the verdict at once): there it is 30 s, so
    that a thread started late on a loaded machine is not taken for a rank that never came.

    With ``settler``, only that rank's deadline is ``deadline_s``, and it arrives once every other
    rank of ``ranks`` has: the others get :data:`HANG_GUARD_S`. So the meeting is settled by the
    settler's deadline with every rank of ``ranks`` in it, however late a loaded machine starts a
    thread."""
    out: dict[int, Meeting | BaseException] = {}

    def one(rank: int, delay: float, shrink: bool) -> None:
        time.sleep(delay)
        try:
            me = arrival(rank, size, allow_shrink=shrink)
            wait_s = deadline_s
            if settler is not None and rank != settler:
                wait_s = HANG_GUARD_S
            elif settler is not None:
                others = [MeetingKeys(me.generation + 1, attempt).arrival(r) for r in ranks if r != rank]
                store.wait(others, timedelta(seconds=HANG_GUARD_S))
            out[rank] = meet(store, me, attempt, Deadline.within(wait_s))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r, d, s)) for r, (d, s) in ranks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline_s, HANG_GUARD_S if settler is not None else 0) + 10)
    assert not any(t.is_alive() for t in threads)
    return out


def test_meeting_of_everyone_agrees_and_cleans_up():
    store = dist.HashStore()
    out = run_meeting(store, {0: (0, False), 1: (0.05, False), 2: (0.1, False)}, deadline_s=30)
    for rank in range(3):
        m = out[rank]
        assert isinstance(m, Meeting) and m.goes_on and not m.late
        # The settling rank read the arrivals once: the roster stands for them (a Meeting holds none).
        roster = Roster(origins=[0, 1, 2], rejoined=[], problem=None, world_size=3)
        assert m.outcome == MeetingOutcome(arrived=[0, 1, 2], ok=True, roster=roster)
        assert (m.origins(), m.rejoined(), m.problem) == ([0, 1, 2], [], None)
    assert store.list_keys() == [MeetingKeys(1, 0).outcome]  # only the outcome stays


def test_meeting_without_a_rank_fails_then_names_the_late_one():
    store = dist.HashStore()
    t0 = time.monotonic()
    out = run_meeting(store, {0: (0, False), 1: (0, False)}, settler=0)
    # Ended by rank 0's 1 s deadline, not rank 1's 30 s guard: a bound between the two, well above
    # what a loaded machine adds (threads starved ~2 s seen; 3.5 s was too close).
    assert time.monotonic() - t0 < 20
    for rank in (0, 1):
        assert not out[rank].goes_on and not out[rank].late
        assert out[rank].outcome.missing(3) == [2]
    t0 = time.monotonic()
    late = run_meeting(store, {2: (0, False)}, deadline_s=30)[2]
    # At once: a hang guard far below the 30 s it was given.
    assert late.late and not late.goes_on and time.monotonic() - t0 < 10
    # The next attempt of every rank meets in a fresh namespace.
    again = run_meeting(store, {0: (0, False), 1: (0, False), 2: (0, False)}, attempt=1, deadline_s=30)
    assert all(again[r].goes_on for r in range(3))


def test_meeting_with_shrink_goes_on_without_the_absent_rank():
    store = dist.HashStore()
    out = run_meeting(store, {0: (0, True), 2: (0, True)}, settler=0)
    for rank in (0, 2):
        assert out[rank].goes_on
        roster = Roster(origins=[0, 2], rejoined=[], problem=None, world_size=3)
        assert out[rank].outcome == MeetingOutcome(arrived=[0, 2], ok=True, shrunk=True, roster=roster)
    # Late: it reads the kept verdict at once, so its deadline is a hang guard (a 1 s one could pass
    # before a starved helper thread answers, failing the call instead of reading the verdict).
    left_out = run_meeting(store, {1: (0, True)}, deadline_s=HANG_GUARD_S)[1]
    assert left_out.late and left_out.outcome.ok and not left_out.goes_on


def test_meeting_refused_when_ranks_disagree_on_shrinking():
    store = dist.HashStore()
    # Rank 0 allows shrinking and settles (its 1 s deadline, once rank 1 is in: ordered, not slept);
    # rank 1 did not allow it: both refuse together.
    out = run_meeting(store, {0: (0, True), 1: (0, False)}, settler=0)
    for rank in (0, 1):
        assert out[rank].outcome.ok and out[rank].outcome.shrunk
        assert not out[rank].goes_on
        assert "allow_shrink=False" in out[rank].problem


def test_an_unreadable_outcome_is_refused():
    store = dist.HashStore()
    store.set(MeetingKeys(1, 0).outcome, b"\x80\x04not json")
    with pytest.raises(StoreUnreachable, match="cannot be read"):
        # The verdict is there already: a hang guard, so that a starved thread cannot turn the
        # unreadable verdict into a store that did not answer.
        meet(store, arrival(0), 0, Deadline.within(HANG_GUARD_S))


def test_forget_generation_deletes_only_that_prefix():
    store = dist.HashStore()
    for key in ("ncclguard/world/g1/0//cpu//rank_0", "ncclguard/world/g1/x", "ncclguard/world/g10/x", "other"):
        store.set(key, "1")
    assert _forget_generation(store, 1, Deadline.within(30)) == 2
    assert sorted(store.list_keys()) == ["ncclguard/world/g10/x", "other"]


# ----------------------------------------------------------------- the reaper


def gloo_group() -> object:
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))


def test_reaper_waits_for_the_last_reference_and_releases_on_its_thread():
    reaper = Reaper(poll_s=0.01)
    pg = gloo_group()
    ref = weakref.ref(pg)
    user_copy = pg
    reaper.bury([pg], hold_s=30, label="test group")
    del pg
    time.sleep(0.2)
    assert ref() is not None and reaper.pending() == 1  # the user still holds it
    del user_copy
    assert reaper.wait_idle(20)  # hang guard (polled every 0.01 s); a starved thread takes seconds
    assert ref() is None and reaper.pending() == 0
    assert reaper._thread is None  # no thread while idle


def test_reaper_collects_cycles_and_lets_go_after_the_hold(caplog):
    reaper = Reaper(poll_s=0.01)

    class Cycle:
        pass

    pg = gloo_group()
    ref = weakref.ref(pg)
    holder = Cycle()
    holder.me = holder  # a cycle: only the cyclic collector frees it
    holder.pg = pg
    gc.disable()
    try:
        reaper.bury([pg], hold_s=30)
        del pg, holder
        # The first collection comes after 2 s; a hang guard below the 30 s hold (past it the group
        # would be let go still referenced, and ref() below would fail).
        assert reaper.wait_idle(20)
        assert ref() is None
    finally:
        gc.enable()

    kept = gloo_group()
    with caplog.at_level(logging.WARNING, logger="ncclguard"):
        reaper.bury([kept], hold_s=0.1, label="stubborn group")
        assert reaper.wait_idle(20)  # hang guard
    assert "abandoned stubborn group is still referenced 1 time(s)" in caplog.text
    assert kept is not None


# ----------------------------------------------------------------- the public entry, no processes


def test_rebuild_world_checks_arguments_first_and_needs_a_world():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="positive"):
        rebuild_world(timeout=0)
    with pytest.raises(TypeError, match="allow_shrink"):
        rebuild_world(allow_shrink="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_process_group"):
        rebuild_world(timeout=1)
    assert generation() == 0


def test_the_rebuild_hook_registers_and_unregisters():
    # A rebuild is told through the world's one hook (what on_rebuild was): kind "rebuilt".
    with pytest.raises(TypeError, match="callable"):
        subscribe(42, kinds=("rebuilt",))  # type: ignore[arg-type]
    seen: list[WorldChange] = []
    remove = subscribe(seen.append, kinds=("rebuilt",))
    world = current_world()
    rebuilt = WorldChange(world, world, "rebuilt", step=3)
    notify(rebuilt)
    assert seen == [rebuilt]
    remove()
    remove()  # twice is harmless
    notify(rebuilt)
    assert seen == [rebuilt]  # unregistered: not told


def test_result_is_truthy_only_on_success():
    ok = RebuildResult(ok=True, generation=1, rank=0, world_size=2, rank_map={0: 0, 2: 1}, missing_ranks=[1])
    bad = RebuildResult(ok=False, generation=0, rank=0, world_size=3, missing_ranks=[1], error="x")
    assert ok and not bad


def test_a_second_concurrent_call_is_refused():
    from ncclguard.recovery import rebuild as module

    with module._lock:  # as if another thread of this process were rebuilding
        with pytest.raises(RuntimeError, match="already running in another thread"):
            rebuild_world(timeout=1)


def test_gloo_cannot_shrink_on_this_torch():
    # Why rebuild_world builds a new group instead of calling torch.distributed.shrink_group,
    # which refuses a backend whose supports_shrinking is False (torch 2.13).
    assert gloo_group().supports_shrinking is False  # type: ignore[attr-defined]


def _meet_two(store: dist.Store, deadline_s: float, settler: int | None = None) -> dict[int, Meeting | BaseException]:
    return run_meeting(store, {0: (0, True), 1: (0, True)}, deadline_s=deadline_s, settler=settler)


def test_a_meeting_settles_at_once_without_a_rank_a_verdict_judged_stuck_but_waits_for_a_killed_one():
    from ncclguard.store.deaths import STUCK_RC, notice_now, post_death

    stuck = dist.HashStore()
    post_death(stuck, notice_now(2, 4242, STUCK_RC, 0, "here"))
    out = _meet_two(stuck, 60.0)
    for rank in (0, 1):
        m = out[rank]
        assert isinstance(m, Meeting) and m.goes_on, m
        assert m.outcome.arrived == [0, 1] and m.outcome.shrunk
        assert m.elapsed_s < 30.0  # settled long before its 60 s deadline (a hang guard, not a timing)
    # A killed rank's notice: its restart may come to rejoin, so the meeting waits its deadline (rank
    # 0's, started once rank 1 is in, so that a starved thread cannot leave rank 1 out).
    killed = dist.HashStore()
    post_death(killed, notice_now(2, 4242, -9, 0, "here"))
    out = _meet_two(killed, 1.0, settler=0)
    for rank in (0, 1):
        m = out[rank]
        assert isinstance(m, Meeting) and m.outcome.arrived == [0, 1]
        assert m.elapsed_s >= 0.9
