"""should_commit's outcome logic (pure), its round on a real TCPStore with ranks as threads, and a
world of one. The multi-rank cases on real gloo ranks: tests/recovery/test_commit_multirank.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ncclguard
from ncclguard.collectives.groups import GroupInfo
from ncclguard.deadlines import Deadline
from ncclguard.errors import CommitFailed
from ncclguard.recording.flight import recorder
from ncclguard.recovery import commit as commit_mod
from ncclguard.recovery._commit.statements import (
    MAX_PROBLEMS,
    MAX_STATEMENT_BYTES,
    CommitOutcome,
    CommitStatement,
    commit_keys,
    decide,
    outcome_limit,
)
from ncclguard.store.clients import store_for_this_thread
from ncclguard.store.codec import decode, encode
from ncclguard.watching.ladder.actions import Action, Outcome
from ncclguard.watching.watchdog import Watchdog


def stmt(rank: int, seq: int | None = 10, **kw) -> CommitStatement:
    base = {"rank": rank, "step": 3, "generation": 0, "group": "0", "group_size": 4, "seq": seq}
    return CommitStatement(**{**base, **kw})


def test_every_rank_clean_and_in_step_commits():
    v = decide({r: stmt(r) for r in range(4)}, 4, 3, 5.0)
    assert v == CommitOutcome(ok=True, step=3, arrived=[0, 1, 2, 3], failed={})


def test_missing_unreadable_and_failing_ranks_are_named():
    v = decide({0: stmt(0), 1: None, 3: stmt(3, problems=["all_reduce failed"])}, 4, 3, 5.0)
    assert v.ok is False
    assert v.arrived == [0, 1, 3]
    assert v.failed == {
        1: ["its statement could not be read"],
        2: ["did not reach should_commit for commit 3 within 5 s"],
        3: ["all_reduce failed"],
    }


def test_a_missing_rank_known_dead_is_named_with_how_it_is_known():
    v = decide(
        {0: stmt(0, problems=["gloo: Connection reset by peer"]), 2: stmt(2)}, 3, 0, 5.0, {1: "its process died"}
    )
    assert not v.ok and v.arrived == [0, 2]
    assert v.failed == {0: ["gloo: Connection reset by peer"], 1: ["its process died"]}
    # A rank that arrived is judged by its statement, whatever a notice says of it.
    assert decide({0: stmt(0), 1: stmt(1)}, 2, 0, 5.0, {1: "its process died"}).ok


def test_the_rank_with_a_different_collective_count_is_named():
    v = decide({0: stmt(0), 1: stmt(1), 2: stmt(2, seq=12), 3: stmt(3)}, 4, 3, 5.0)
    assert v.failed == {
        2: ["issued 2 collective(s) more than ranks 0-1,3 on the group (backend sequence number 12, theirs 10)"]
    }
    v = decide({0: stmt(0), 1: stmt(1, seq=9), 2: stmt(2), 3: stmt(3)}, 4, 3, 5.0)
    assert v.failed == {
        1: ["issued 1 collective(s) fewer than ranks 0,2-3 on the group (backend sequence number 9, theirs 10)"]
    }


def test_two_ranks_that_disagree_are_both_named():
    v = decide({0: stmt(0, seq=4), 1: stmt(1, seq=5)}, 2, 3, 5.0)
    assert v.failed == {
        0: ["the backend ran 4 collectives on its group, the others differ (rank 1: 5)"],
        1: ["the backend ran 5 collectives on its group, the others differ (rank 0: 4)"],
    }


def test_every_group_a_rank_is_in_is_compared_by_name():
    # Ranks 0-2 share group "1" (say a tensor-parallel group); rank 3 holds a group "2" alone.
    seqs = {0: {"1": 7}, 1: {"1": 7}, 2: {"1": 8}, 3: {"2": 3}}
    v = decide({r: stmt(r, other_seqs=seqs[r]) for r in range(4)}, 4, 3, 5.0)
    assert v.failed == {
        2: ["issued 1 collective(s) more than ranks 0-1 on group '1' (backend sequence number 8, theirs 7)"]
    }


def test_a_group_with_point_to_point_ops_is_not_compared():
    # Measured on gloo (torch 2.13): a send from rank 0 to rank 1 raises the group's sequence
    # number on ranks 0 and 1 only, so healthy ranks hold different numbers.
    one_said_p2p = {0: stmt(0, seq=11, p2p_groups=["0"]), 1: stmt(1, seq=11), 2: stmt(2, seq=10)}
    assert decide(one_said_p2p, 3, 3, 5.0).ok is True
    others = {r: stmt(r, other_seqs={"4": 5 + (r == 0)}, p2p_groups=["4"] if r == 1 else []) for r in range(3)}
    assert decide(others, 3, 3, 5.0).ok is True
    everywhere = {r: stmt(r, seq=10 + r, other_seqs={"4": r}, p2p_groups=["*"] if r == 2 else []) for r in range(3)}
    assert decide(everywhere, 3, 3, 5.0).ok is True
    others[1] = stmt(1, other_seqs={"4": 5})  # nobody saw point-to-point ops on "4": rank 0 is odd
    assert decide(others, 3, 3, 5.0).failed == {
        0: ["issued 1 collective(s) more than ranks 1-2 on group '4' (backend sequence number 6, theirs 5)"]
    }


def test_an_unreadable_sequence_number_is_not_a_mismatch():
    v = decide({0: stmt(0, seq=None), 1: stmt(1), 2: stmt(2)}, 3, 3, 5.0)
    assert v.ok is True


def test_generation_group_and_user_step_disagreements_are_named():
    v = decide({0: stmt(0, generation=1), 1: stmt(1), 2: stmt(2)}, 3, 3, 5.0)
    assert v.failed == {0: ["is in world generation 1, where ranks 1-2 are in generation 0"]}
    v = decide({0: stmt(0), 1: stmt(1, group="5"), 2: stmt(2)}, 3, 3, 5.0)
    assert v.failed == {1: ["committed on group '5', where ranks 0,2 committed on group '0'"]}
    v = decide({0: stmt(0, user_step=8), 1: stmt(1, user_step=7), 2: stmt(2, user_step=7)}, 3, 3, 5.0)
    assert v.failed == {0: ["passed step=8, where ranks 1-2 passed step=7"]}


statements = st.dictionaries(
    st.integers(0, 7),
    st.one_of(
        st.none(),
        st.builds(
            lambda r, seq, bad: stmt(r, seq=seq, problems=["x" * 400] * bad),
            st.integers(0, 7),
            st.one_of(st.none(), st.integers(0, 3)),
            st.integers(0, MAX_PROBLEMS),
        ),
    ),
)


@settings(max_examples=200, deadline=None)
@given(statements, st.integers(1, 8))
def test_the_outcome_is_ok_exactly_when_nothing_is_wrong_and_fits_its_bound(found, size):
    v = decide(found, size, 0, 1.0)
    readable = {r: s for r, s in found.items() if s is not None and r < size}
    seqs = {s.seq for s in readable.values() if s.seq is not None}
    clean = (
        set(range(size)) <= set(found)
        and len(readable) == size
        and all(not s.problems for s in readable.values())
        and len(seqs) <= 1
    )
    assert v.ok is clean
    assert v.ok is (not v.failed)
    assert set(v.failed) <= set(range(size))
    assert set(range(size)) - set(found) <= set(v.failed)
    assert all(len(text) <= 300 for reasons in v.failed.values() for text in reasons)
    # The codec reads it back within the bound the readers use.
    assert decode(CommitOutcome, encode(v), "outcome", outcome_limit(size)) == v


def test_a_statement_at_its_bounds_fits_the_codec_limit():
    s = stmt(0, problems=["y" * 300] * MAX_PROBLEMS, group="g" * 255)
    assert len(encode(s)) <= MAX_STATEMENT_BYTES
    with pytest.raises(ValueError, match="List should have at most 8 items"):
        stmt(0, problems=["z"] * (MAX_PROBLEMS + 1))


def test_commit_keys_are_per_group_generation_and_step():
    assert commit_keys("0", 2, 5, restart="1").outcome == "ncclguard/commit/1/0/g2/s5/o"
    assert commit_keys("0", 2, 5) != commit_keys("0", 3, 5)


@pytest.fixture
def fresh():
    """A world of one whose earlier problems (other tests' failed records) are counted already."""
    assert not dist.is_initialized()
    recorder.clear()
    ncclguard.should_commit()


def test_a_world_of_one_commits_unless_something_failed_here(fresh):
    res = ncclguard.should_commit()
    assert res and res.ok and res.error is None and res.failed_ranks == [] and res.raise_for_error() is res
    res = ncclguard.should_commit(failure=ValueError("loss is nan"))
    assert not res
    assert res.failed_ranks == [0]
    assert res.reasons == {0: ["the caller reported: ValueError: loss is nan"]}
    with pytest.raises(CommitFailed, match="may not be applied") as info:
        res.raise_for_error()
    assert info.value.failed_ranks == [0] and info.value.step == res.step


def test_a_failed_recorded_call_fails_the_next_commit_only(fresh):
    rec = recorder.start("all_reduce(SUM)", "7", 4, "float32")
    recorder.finish(rec, "peer closed")
    res = ncclguard.should_commit()
    assert res.reasons == {0: ["all_reduce(SUM) on group '7' (call 1) failed: peer closed"]}
    assert ncclguard.should_commit().ok is True  # counted since the last commit only


def test_a_second_thread_is_refused_while_a_commit_runs():
    state = ncclguard.recovery.commit.current_world().get(commit_mod._COMMITS)
    with state.lock:  # a commit in progress on another thread
        with pytest.raises(RuntimeError, match="already running in another thread"):
            ncclguard.should_commit()


# A bound that only a hung round reaches: the store calls of the ranks that must not be late, and
# the waits of the test's own threads.
HANG_GUARD_S = 30.0


def _thread_ranks(
    size: int,
    late: set[int],
    timeout_s: float,
    rounds: int = 1,
    keys: list[int] | None = None,
    settler: int | None = None,
) -> dict[int, tuple[CommitOutcome, bool]]:
    """Runs the commit round of ``size`` ranks as threads, each with its own client of one TCPStore.

    With ``settler``, only that rank's deadline is ``timeout_s``, and it starts its round once every
    other rank not in ``late`` has written its statement; the others get a hang guard. So the round is
    settled by the settler's deadline with every on-time rank in it, however late a loaded machine
    starts a thread or answers a store call: only the ranks in ``late`` can be late."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    out: dict[int, tuple[CommitOutcome, bool]] = {}
    settled = threading.Event()
    done, between = threading.Barrier(size), threading.Barrier(size)

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=HANG_GUARD_S))
        # This thread's clone of the client, made now: connecting it is not the round's to wait for.
        store_for_this_thread(store, Deadline.within(HANG_GUARD_S))
        if r in late:
            settled.wait(HANG_GUARD_S)
        info = GroupInfo(group=None, name="t", rank=r, size=size, backend="gloo", store=store)  # type: ignore[arg-type]
        for n in range(rounds):
            statement = stmt(r, group="t", group_size=size, step=n)
            deadline_s = timeout_s
            if settler is not None and r != settler:
                deadline_s = HANG_GUARD_S
            elif settler is not None:
                on_time = [commit_keys("t", 0, n).arrival(o) for o in range(size) if o != r and o not in late]
                store.wait(on_time, timedelta(seconds=HANG_GUARD_S))
            out[r] = commit_mod._settle(info, 0, n, statement, Deadline.within(deadline_s), timeout_s)
            settled.set()
            done.wait(HANG_GUARD_S)  # every rank is out of round n: the store's key count is read between rounds
            if r == 0 and keys is not None:
                keys.append(server.num_keys())
            between.wait(HANG_GUARD_S)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(rounds * HANG_GUARD_S + 30)
    assert len(out) == size
    return out


def test_the_round_on_a_real_store_gives_every_rank_one_outcome_and_names_the_late_one():
    # Rank 0's 3 s deadline settles the round, started once ranks 1 and 3 are in (see _thread_ranks):
    # a thread started late or a slow store answer on a loaded host cannot leave them out.
    out = _thread_ranks(4, late={2}, timeout_s=3.0, settler=0)
    outcomes = [v for v, _ in out.values()]
    assert all(v == outcomes[0] for v in outcomes)
    assert outcomes[0].arrived == [0, 1, 3]
    assert outcomes[0].failed == {2: ["did not reach should_commit for commit 0 within 3 s"]}
    assert {r: late for r, (_, late) in out.items()} == {0: False, 1: False, 2: True, 3: False}
    counts: list[int] = []
    # Every rank comes: each round settles when the last one arrives, so the deadline is a hang guard
    # (it was 10 s, which a starved thread plus slow store answers could approach).
    clean = _thread_ranks(4, late=set(), timeout_s=HANG_GUARD_S, rounds=4, keys=counts)
    assert [v.ok for v, _ in clean.values()] == [True] * 4
    # Each round that every rank reached deletes the round before: the store does not grow.
    assert counts[1] == counts[2] == counts[3] == counts[0]


class _Note(Action):
    """A rung of the user's own that acts (here: notes that it ran)."""

    name = "note"
    wait_s = 0.05

    def __call__(self, incident, ctx) -> Outcome:
        return Outcome(done=True)


@pytest.mark.parametrize("ladder", [["report"], ["report", _Note()]])
def test_an_incident_fails_the_next_commit_only_when_its_ladder_acted(fresh, tmp_path, ladder):
    """A world of one with a real watchdog: a synthetic op left in flight past the hang timeout is
    an incident. Reported only (a busy rank past a learned hang bound), it fails nothing; when a rung
    past ``report`` acted, the next commit names it and the one after is clean again."""
    wd = Watchdog(heartbeat_s=0.1, hang_timeout_s=0.3, incident_dir=tmp_path, actions=ladder)
    rec = recorder.start("all_reduce(SUM)", "commit-test", 4, "float32", site="/job/t.py:1")
    try:
        wd.start()
        (inc,) = wd.wait_for_incident(30, settled=True)  # hang guard: the incident comes after ~0.4 s
        recorder.finish(rec)
        res = ncclguard.should_commit()
        if len(ladder) == 1:
            assert res.ok is True and [a["rung"] for a in inc["actions"]] == ["report"]
        else:
            assert not res
            assert res.reasons == {0: [f"the watchdog raised incident {inc['id']} (hang) and took note"]}
            assert ncclguard.should_commit().ok is True
    finally:
        recorder.finish(rec)
        wd.stop()
        recorder.clear()
