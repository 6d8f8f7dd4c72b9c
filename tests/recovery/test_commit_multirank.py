"""should_commit on 3 real gloo ranks (one torchrun launch).

Launches (tests/workers/commit_worker.py):
``agree`` 3 ranks, torchrun, every check in order: bad input refused before any communication; (a) clean
    DDP steps commit everywhere with the same numbers; (b) rank 2 comes 6 s late to a 2 s safe_all_reduce,
    after the others' commit settled: falsy on all three, rank 2 ``late``, the step after a rebuild commits;
    (c) rank 2 issues one all_reduce more: the count mismatch names it; (d) ranks 0-1 time out on an op rank 2
    never issues: the commit on the dead group still settles; (e) a send from rank 0 to rank 1 fails nothing,
    one all_reduce more on a subgroup names rank 2.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

TIMEOUT_MSG = "timed out after"
SETTLE_GUARD_S = 30  # hang guard: the round settles at ranks 0-1's 2 s timeout, over 10x that


@pytest.fixture(scope="module")
def job():
    # About 40 s here with 3 rebuilds and a 6 s late rank; hang guard over 3x a loaded run's.
    return run_ranks("commit_worker", 3, "agree", timeout_s=240)


def same_on_every_rank(job, key):
    values = [job[r][key] for r in range(3)]
    verdicts = [{k: v for k, v in val.items() if k not in ("late", "elapsed_s")} for val in values]
    assert verdicts[0] == verdicts[1] == verdicts[2], values
    return values


def test_bad_input_is_refused_before_any_communication(job):
    for r in range(3):
        bad = job[r]["bad"]
        assert {k: v[0] for k, v in bad.items()} == {
            "timeout_str": "TypeError",
            "timeout_zero": "ValueError",
            "step_negative": "TypeError",
            "step_bool": "TypeError",
            "failure_int": "TypeError",
        }
        assert job[r]["user_step_repeat"] == [
            "ValueError",
            "should_commit was called for step=7 after step=7: once per step, and the step must grow",
        ]
        assert job[r]["b_old_group"][0] == "ValueError"
        assert "abandoned world" in job[r]["b_old_group"][1]


def test_clean_steps_commit_on_every_rank_with_the_same_numbers(job):
    for r in range(3):
        commits = job[r]["a_commits"]
        assert [(c["ok"], c["bool"], c["step"], c["generation"], c["failed_ranks"]) for c in commits] == [
            (True, True, 0, 0, []),
            (True, True, 1, 0, []),
            (True, True, 2, 0, []),
        ]
        assert all(c["error_type"] is None and not c["late"] for c in commits)
        assert job[r]["a_params_equal"] is True
        assert job[r]["user_step"]["ok"] is True and job[r]["user_step"]["step"] == 3
        assert job[r]["committed_step"] == 3


def test_a_late_rank_reads_the_same_falsy_outcome_and_the_next_world_commits(job):
    # The case: ranks 0-1 time out, rank 2 completes the op they abandoned.
    for r in (0, 1):
        assert job[r]["b_all_reduce"] == [False, "CollectiveTimeout"]
    assert job[2]["b_all_reduce"] == [True, "NoneType", [3.0, 3.0, 3.0, 3.0]]
    assert job[2]["b_late_by_s"] >= 6.0
    commits = same_on_every_rank(job, "b_commit")
    for c in commits:
        assert (c["ok"], c["bool"], c["step"], c["generation"]) == (False, False, 4, 0)
        assert c["failed_ranks"] == [0, 1, 2]
        assert c["error_type"] == "CommitFailed" and c["error_agrees"] is True
        assert c["reasons"]["2"] == ["did not reach should_commit for commit 4 within 2 s"]
        for r in ("0", "1"):
            assert len(c["reasons"][r]) == 1  # the group mark and its failed record, said once
            assert c["reasons"][r][0].startswith("group '0' failed (CollectiveTimeout: all_reduce(SUM)")
            assert TIMEOUT_MSG in c["reasons"][r][0]
    assert [c["late"] for c in commits] == [False, False, True]
    for r in range(3):
        assert job[r]["b_rebuild"] == [True, 1]
        after = job[r]["b_after"]
        assert (after["ok"], after["step"], after["generation"], after["failed_ranks"]) == (True, 0, 1, [])


def test_a_rank_that_issued_one_collective_more_is_named(job):
    commits = same_on_every_rank(job, "c_commit")
    for c in commits:
        assert (c["ok"], c["step"], c["generation"], c["failed_ranks"], c["late"]) == (False, 1, 1, [2], False)
        assert c["reasons"] == {
            "2": ["issued 1 collective(s) more than ranks 0-1 on the group (backend sequence number 1, theirs 0)"]
        }
    for r in range(3):
        assert job[r]["c_rebuild"] == 2
        assert [(c["ok"], c["step"], c["generation"]) for c in job[r]["c_after_commits"]] == [
            (True, 0, 2),
            (True, 1, 2),
        ]
        assert job[r]["c_after_params_equal"] is True


def test_a_commit_on_a_dead_communicator_settles(job):
    for r in (0, 1):
        assert job[r]["d_dead"] == ["CollectiveTimeout", True]
    commits = same_on_every_rank(job, "d_commit")
    for c in commits:
        assert (c["ok"], c["step"], c["generation"], c["failed_ranks"], c["late"]) == (False, 2, 2, [0, 1, 2], False)
        assert c["reasons"]["2"] == [
            "issued 1 collective(s) fewer than ranks 0-1 on the group (backend sequence number 8, theirs 9)"
        ]
        # Hang guard: the round waits for ranks 0-1's 2 s timeout, then settles at once.
        assert c["elapsed_s"] < SETTLE_GUARD_S
    for r in range(3):
        assert job[r]["d_rebuild"] == 3
        assert (job[r]["d_after"]["ok"], job[r]["d_after"]["generation"]) == (True, 3)


def test_every_group_is_compared_and_point_to_point_ops_are_no_mismatch(job):
    # gloo counts the send and the recv in ranks 0 and 1's sequence numbers only (torch 2.13).
    assert [job[r]["e_p2p_seq"] for r in range(3)] == [job[2]["e_p2p_seq"] + 1] * 2 + [job[2]["e_p2p_seq"]]
    for c in same_on_every_rank(job, "e_p2p_commit"):
        assert (c["ok"], c["step"], c["generation"], c["failed_ranks"]) == (True, 1, 3, [])
    (name,) = {job[r]["e_sub_name"] for r in range(3)}
    for c in same_on_every_rank(job, "e_sub_commit"):
        assert (c["ok"], c["step"], c["failed_ranks"]) == (False, 2, [2])
        assert c["reasons"] == {
            "2": [f"issued 1 collective(s) more than ranks 0-1 on group {name!r} (backend sequence number 2, theirs 1)"]
        }
