"""RecoveringStep on 3 real gloo ranks under torchrun.

Launches (tests/workers/recovering_worker.py), each 3 ranks under torchrun, 5 steps, a 6 s step bound
(``collective_timeout``; the group keeps 60 s):
``stall``: a fault-free DDP run, then the same run through RecoveringStep with rank 2 sleeping 10 s in
    step 2's first attempt: every rank redoes step 2 in generation 1 and ends bit-equal to the fault-free run.
``fsdp2``: ``stall`` with the module sharded by FSDP2 and Adam (after what FSDP2 refuses): step 2 is redone
    on a module sharded again; full parameters and Adam's state end bit-equal to the fault-free run.
``shrink``: ``allow_shrink=True``, rank 2 stuck at step 2 until the others are done: ranks 0-1 go on as a
    world of 2; rank 2 then finds itself left out and exits 0.
``handshake``: a fault-free DDP run, then rank 2 raises in step 2 and rank 1's handshake into the rebuilt
    world fails once (10 s to meet and shake hands): every rank rebuilds again and redoes step 2 in
    generation 2, bit-equal to the fault-free run. The model is small: what is checked is the order of
    the ranks' moves, not the state's size.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(400)]  # past each launch's own hang guard

K = 2  # the step that fails (recovering_worker.K)
CLEAN = {"ok": True, "attempts": 1, "rebuilds": 0, "commits": [[True, []]], "error": None}


@pytest.fixture(scope="module")
def stall_job():
    # A fault-free run, then one with rank 2 stalled 10 s past the 6 s step bound: 22 s here.
    # Hang guard: over 3x a loaded run's.
    return run_ranks("recovering_worker", 3, "stall", timeout_s=240)


@pytest.fixture(scope="module")
def fsdp2_job():
    # As stall_job, with the module sharded by FSDP2 and Adam.
    return run_ranks("recovering_worker", 3, "fsdp2", timeout_s=240)


@pytest.fixture(scope="module")
def shrink_job():
    # 6 s step bound, 20 s commit, 20 s rebuild, then rank 2 wakes and leaves: 73 s here.
    return run_ranks("recovering_worker", 3, "shrink", timeout_s=300)


@pytest.fixture(scope="module")
def handshake_job():
    # A fault-free run, then one whose first rebuild fails its handshake (about 10 s of it): 25 s here.
    return run_ranks("recovering_worker", 3, "handshake", timeout_s=240)


def redone_on_generation_1(world_sizes: list[int]) -> dict[str, object]:
    """Step K as every member reports it: failed once on generation 0, committed on generation 1."""
    return {
        "ok": True,
        "attempts": 2,
        "generation": 1,
        "rebuilds": 1,
        "commits": [[False, [0, 1, 2]], [True, []]],
        "error": None,
        "world_sizes": world_sizes,
    }


def test_a_stalled_step_is_redone_on_the_rebuilt_world_and_ends_bit_equal(stall_job):
    for r in range(3):
        res = stall_job[r]
        assert res["reference_results"] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * 5
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K] == redone_on_generation_1(world_sizes=[3, 3])
        assert steps[K + 1 :] == [{**CLEAN, "generation": 1, "world_sizes": [3]}] * 2
        assert res["equal_across_ranks"] is True
        assert res["equal_to_reference"] is True  # bit for bit, the fault-free run's parameters
        assert res["final"] == [r, 3]
        # gloo's step bound: each attempt's groups got the bound as their timeout (5 steps, one redone);
        # no abort (NCCL's rule: tests/recovery/test_nccl_stand_in_multirank.py).
        assert res["step_bound"] == {"aborted": 0, "lowered": 6}


def test_an_fsdp2_step_is_redone_on_a_world_sharded_again_and_ends_bit_equal(fsdp2_job):
    for r in range(3):
        res = fsdp2_job[r]
        assert res["reference_results"] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * 5
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K] == redone_on_generation_1(world_sizes=[3, 3])
        assert steps[K + 1 :] == [{**CLEAN, "generation": 1, "world_sizes": [3]}] * 2
        assert res["sharded"] == ["DTensor"]
        already, stepped = res["refusals"]
        assert already.startswith("FSDP2 was given a module that is already sharded")
        assert stepped.startswith("FSDP2: build the optimizer on the unsharded module's parameters")
        assert res["module_is_new"] is True
        # Bit for bit: the full parameters and Adam's full state, against the fault-free run.
        assert res["equal_to_reference"] is True
        assert res["equal_across_ranks"] is True
        assert res["final"] == [r, 3]
        assert res["step_bound"] == {"aborted": 0, "lowered": 6}  # gloo's rule, as for DDP


def test_with_allow_shrink_the_survivors_go_on_without_a_stuck_rank(shrink_job):
    for r in (0, 1):
        res = shrink_job[r]
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K] == redone_on_generation_1(world_sizes=[3, 2])
        assert steps[K + 1 :] == [{**CLEAN, "generation": 1, "world_sizes": [2]}] * 2
        assert res["final"] == [r, 2]
        # record_ddp: each bucket all-reduce of generation 1 recorded, none left in flight.
        assert res["ddp_records"] == [["DDP bucket 0", "completed", True]] * 3
        assert res["ddp_inflight"] == 0
        assert res["equal_across_ranks"] is True
        # Against one process averaging 3 ranks' losses before K and 2 ranks' after (float64).
        assert res["max_diff_to_reference"] < 1e-12
    stuck = shrink_job[2]
    assert stuck["woke_after_survivors"] is True
    assert stuck["results"][:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
    # Step K: the commit failed, the rebuild came late, and the engine's left-out policy ended the rank
    # (status 0, checked by the harness) right after its "left_out" subscriber (world.subscribe) saved this.
    assert stuck["results"][K] == {"left_out": True, "error": "RebuildFailed", "step": K, "late": True, "generation": 0}
    assert len(stuck["results"]) == K + 1


def test_a_handshake_that_fails_into_the_rebuilt_world_is_met_again_and_the_step_redone_bit_equal(handshake_job):
    """Rank 1's handshake into generation 1 fails; ranks 0 and 2 give up theirs at its bound. No rank
    commits as a world of one (the second commit fails on every rank, naming all three, with no
    communication), every rank meets again, and step K is redone in generation 2 on a DDP wrap made
    there: its third attempt, within the default ``max_attempts``."""
    for r in range(3):
        res = handshake_job[r]
        assert res["reference_results"] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * 5
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K] == {
            "ok": True,
            "attempts": 3,
            "generation": 2,
            "rebuilds": 2,
            # Rank 2 raised before its backward: ranks 0-1's DDP all_reduce met the 6 s step bound.
            "commits": [[False, [0, 1, 2]], [False, [0, 1, 2]], [True, []]],
            "error": None,
            "world_sizes": [3, 3],
        }, steps[K]
        assert steps[K + 1 :] == [{**CLEAN, "generation": 2, "world_sizes": [3]}] * 2
        assert res["equal_across_ranks"] is True
        assert res["equal_to_reference"] is True  # bit for bit, the fault-free run's parameters
        assert res["final"] == [r, 3]
