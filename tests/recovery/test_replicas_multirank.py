"""A replica that silently drifted (one flipped bit), named at the next check, healed from a peer in the
same world and ending bit-equal to the run without the fault, on 3 real gloo ranks.

One launch of tests/workers/replicas_worker.py, 3 ranks under torchrun, scenario ``drill``: three runs
in a row from the same start (a 956,042-parameter classifier with dropout, AdamW, a warm-up LR
schedule stepped every iteration, shuffled data, 10 steps, RecoveringStep with every default but
``replica_check_every=4``):

1. ``clean``: no fault: nothing reported, every step committed at its first attempt, 0 rebuilds.
2. ``flipped``: bit 20 of one element of rank 2's ``fc2.weight`` flipped after step 7: the check at
   step 8 names rank 2 (its parameters; ranks 0-1 the majority) on every rank, the step is not
   applied, rank 2 is healed from rank 0 with no rebuild, the step redone; the run ends bit-equal to
   ``clean`` (every parameter and every optimizer state tensor, on every rank).
3. ``split``: ranks 1 and 2 each flip a different bit: three digests, no majority: every rank raises
   ``ReplicasDiverged`` at step 8 naming ranks 0-2, nothing healed.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(210)]  # 60 s past the launch's own hang guard

STEPS, EVERY, FLIP_AFTER = 10, 4, 7  # replicas_worker's
CHECK = FLIP_AFTER + 1
CLEAN = {"ok": True, "attempts": 1, "rebuilds": 0, "commits": [[True, []]], "drift": [None], "healed": None}


@pytest.fixture(scope="module")
def drill():
    # Three 10-step runs after torchrun's start: 15-20 s here, 60 s under a load of 17 on 2 cores. Hang guard:
    return run_ranks("replicas_worker", 3, "drill", timeout_s=150)


def test_a_fault_free_run_reports_nothing_and_rebuilds_nothing(drill):
    for r in range(3):
        clean = drill[r]["clean"]
        assert clean["results"] == [CLEAN] * STEPS
        assert (clean["seen"], clean["suspects"], clean["recoveries"], clean["raised"]) == ([], [], 0, None)
        # Nothing said but the step bound learned from the steps' times (a loaded machine's timing).
        assert [w for w in drill[r]["clean_warnings"] if "learned step bound" not in w] == []


def test_a_flipped_bit_is_named_at_the_next_check_healed_in_the_same_world_and_ends_bit_equal(drill):
    drift = {"ranks": [2], "majority": [0, 1], "parts": {"parameters": [2]}}
    healed = {
        "ok": True,
        "attempts": 2,
        "rebuilds": 0,
        "commits": [[False, [2]], [True, []]],
        "drift": [drift, None],
        "healed": "HealResult",
    }
    for r in range(3):
        flipped = drill[r]["flipped"]
        assert flipped["results"] == [CLEAN] * CHECK + [healed] + [CLEAN] * (STEPS - CHECK - 1)
        assert flipped["seen"] == [[CHECK, [2], {"parameters": [2]}, 0, True]]
        assert (flipped["recoveries"], flipped["raised"], flipped["suspects"]) == (0, None, [])
        warnings = drill[r]["flipped_warnings"]
        sdc = [w for w in warnings if "silent data corruption" in w]
        assert len(sdc) == 1, warnings
        assert (
            f"[rank {r}] RecoveringStep: silent data corruption seen at step {100 + CHECK}: rank 2's replica differed "
            "from ranks 0-1's before the step (parameters: rank 2); the step was not applied on any rank; rank 2 is "
            "healed from rank 0 in this world (no rebuild) and the step is redone" == sdc[0]
        )
        assert not [w for w in warnings if "rebuil" in w and "no rebuild" not in w], warnings
        assert drill[r]["equal_to_clean"] is True  # bit for bit: parameters and AdamW's state
        assert drill[r]["same_everywhere"] is True


def test_without_a_majority_every_rank_raises_and_nothing_is_healed(drill):
    for r in range(3):
        split = drill[r]["split"]
        assert split["results"] == [CLEAN] * CHECK
        assert split["raised"] == {"step": CHECK, "ranks": [0, 1, 2], "parts": ["parameters"], "at": CHECK}
        assert split["seen"] == []
        (critical,) = drill[r]["split_critical"]
        assert "the replicas of ranks 0-2 differ at step 208 (parameters)" in critical
