"""RecoveringStep on 3 real gloo ranks under torchrun.

Launches (tests/workers/recovering_worker.py), each 3 ranks under torchrun, 5 steps a run, a 6 s step
bound (``collective_timeout``; the group keeps 60 s). The first launch runs ``stall``, ``handshake`` and
``fsdp2`` one after another on the same process group, each saved under its own name: the world's
generation grows across them, so each scenario starts on the generation the one before left.
``stall``: a fault-free DDP run (generation 0), then the same run through RecoveringStep with rank 2
    sleeping 10 s in step 2's first attempt: every rank redoes step 2 in generation 1 and ends bit-equal
    to the fault-free run.
``handshake``: from generation 1, the same fault-free run's parameters to match: rank 2 raises in step 2
    and rank 1's handshake into the rebuilt world fails once (10 s to meet and shake hands): every rank
    rebuilds again and redoes step 2 in generation 3, bit-equal to the fault-free run. The model is
    small: what is checked is the order of the ranks' moves, not the state's size.
``fsdp2``: from generation 3, ``stall`` with the module sharded by FSDP2 and Adam (after what FSDP2
    refuses), its own fault-free run first: step 2 is redone in generation 4 on a module sharded again;
    full parameters and Adam's state end bit-equal to the fault-free run.
The second launch:
``shrink``: ``allow_shrink=True``, rank 2 stuck at step 2 until the others are done (an 8 s commit and a
    20 s rebuild wait for it): ranks 0-1 go on as a world of 2; rank 2 then finds itself left out and
    exits 0. A drill (`make drills`; its test says what stays in the suite).
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(780)]  # past each launch's own hang guard

K = 2  # the step that fails (recovering_worker.K)
CLEAN = {"ok": True, "attempts": 1, "rebuilds": 0, "commits": [[True, []]], "error": None}


@pytest.fixture(scope="module")
def job():
    # One fault-free DDP run, then stall (rank 2 stalled 10 s past the 6 s step bound), handshake
    # (about 10 s of a failed handshake) and fsdp2 (its own fault-free run, then stall's fault): 43-45 s
    # here, where they were three launches of 16-22 s each. Hang guard: their three 240 s, summed.
    return run_ranks("recovering_worker", 3, "stall", "handshake", "fsdp2", timeout_s=720)


@pytest.fixture(scope="module")
def shrink_job():
    # 6 s step bound, 8 s commit, 20 s rebuild, then rank 2 wakes and leaves: 40 s here (54 s with a 20 s commit).
    return run_ranks("recovering_worker", 3, "shrink", timeout_s=300)


def redone_on(generation: int, world_sizes: list[int]) -> dict[str, object]:
    """Step K as every member reports it: failed once on the generation before, committed on ``generation``."""
    return {
        "ok": True,
        "attempts": 2,
        "generation": generation,
        "rebuilds": 1,
        "commits": [[False, [0, 1, 2]], [True, []]],
        "error": None,
        "world_sizes": world_sizes,
    }


def test_a_stalled_step_is_redone_on_the_rebuilt_world_and_ends_bit_equal(job):
    for r in range(3):
        res = job[r]["stall"]
        assert res["reference_results"] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * 5
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K] == redone_on(1, world_sizes=[3, 3])
        assert steps[K + 1 :] == [{**CLEAN, "generation": 1, "world_sizes": [3]}] * 2
        assert res["equal_across_ranks"] is True
        assert res["equal_to_reference"] is True  # bit for bit, the fault-free run's parameters
        assert res["final"] == [r, 3]
        # gloo's step bound: each attempt's groups got the bound as their timeout (5 steps, one redone);
        # no abort (NCCL's rule: tests/recovery/test_nccl_stand_in_multirank.py).
        assert res["step_bound"] == {"aborted": 0, "lowered": 6}


def test_an_fsdp2_step_is_redone_on_a_world_sharded_again_and_ends_bit_equal(job):
    for r in range(3):
        res = job[r]["fsdp2"]
        # The launch's third scenario: it starts where handshake left the world, in generation 3.
        assert res["reference_results"] == [{**CLEAN, "generation": 3, "world_sizes": [3]}] * 5
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 3, "world_sizes": [3]}] * K
        assert steps[K] == redone_on(4, world_sizes=[3, 3])
        assert steps[K + 1 :] == [{**CLEAN, "generation": 4, "world_sizes": [3]}] * 2
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


# A drill (`make drills`): RecoveringStep(allow_shrink=True) with rank 2 stuck at step 2, the step bound ending the
# survivors' op and ranks 0-1 going on as a world of 2, stays in the suite in
# tests/recovery/test_fence_multirank.py::test_a_stuck_rank_nobody_names_is_fenced_once_the_others_went_on_without_it;
# a stuck rank that wakes after the survivors went on, ended with status 0 by the engine's left-out policy, through
# Lightning's callback in tests/integrations/test_lightning_recover_multirank.py (``shrink``).
@pytest.mark.drill
def test_with_allow_shrink_the_survivors_go_on_without_a_stuck_rank(shrink_job):
    for r in (0, 1):
        res = shrink_job[r]
        steps = res["results"]
        assert steps[:K] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * K
        assert steps[K] == redone_on(1, world_sizes=[3, 2])
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


def test_a_handshake_that_fails_into_the_rebuilt_world_is_met_again_and_the_step_redone_bit_equal(job):
    """Rank 1's handshake into the next generation fails; ranks 0 and 2 give up theirs at its bound. No
    rank commits as a world of one (the second commit fails on every rank, naming all three, with no
    communication), every rank meets again, and step K is redone two generations on, on a DDP wrap made
    there: its third attempt, within the default ``max_attempts``."""
    for r in range(3):
        res = job[r]["handshake"]
        # The fault-free run is stall's, made once in generation 0 before either scenario.
        assert res["reference_results"] == [{**CLEAN, "generation": 0, "world_sizes": [3]}] * 5
        steps = res["results"]
        # The launch's second scenario: it starts where stall left the world, in generation 1, so the
        # failed handshake is into generation 2 and step K is redone in generation 3.
        assert steps[:K] == [{**CLEAN, "generation": 1, "world_sizes": [3]}] * K
        assert steps[K] == {
            "ok": True,
            "attempts": 3,
            "generation": 3,
            "rebuilds": 2,
            # Rank 2 raised before its backward: ranks 0-1's DDP all_reduce met the 6 s step bound.
            "commits": [[False, [0, 1, 2]], [False, [0, 1, 2]], [True, []]],
            "error": None,
            "world_sizes": [3, 3],
        }, steps[K]
        assert steps[K + 1 :] == [{**CLEAN, "generation": 3, "world_sizes": [3]}] * 2
        assert res["equal_across_ranks"] is True
        assert res["equal_to_reference"] is True  # bit for bit, the fault-free run's parameters
        assert res["final"] == [r, 3]
