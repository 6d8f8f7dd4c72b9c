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

A watchdog runs on every rank (tests/workers/numerics_views.py): each of the two findings is one
``numerics`` incident saying a silent corruption was seen, and nothing else is (``clean`` raised none);
``ncclguard status``, read by rank 0 from the job's store, lists them; this test runs ``ncclguard
report`` on each incident's directory after the launch and draws the timeline of the healed one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_ranks

from ncclguard.cli import main
from ncclguard.incidents.files import load
from ncclguard.incidents.pictures import timeline

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


FOUND = [  # each finding's incident, in words: its reason, its summary and status's row
    "step 108: a silent corruption was seen: rank 2's replica drifted from ranks 0-1's (parameters: rank 2); the step "
    "was not applied; rank 2 was healed from rank 0 in this world and the step redone",
    "step 208: a silent corruption was seen: the replicas of ranks 0-2 differ (parameters: ranks 0-2) and no digest "
    "is held by a majority, so which one drifted cannot be told; the step was not applied: ReplicasDiverged raised "
    "on every rank",
]
SEEN = [
    "  parameters: rank 2 differed\n  ranks 0-1: the majority (the same digests)\n\n"
    "WHAT WAS DONE (the same on every rank; the step was not applied on any rank)\n"
    "  rank 2 healed from rank 0 in this world (no rebuild), the step redone\n",
    "  parameters: ranks 0-2 differed\n  no digest is held by a majority: which replica drifted cannot be told\n\n"
    "WHAT WAS DONE (the same on every rank; the step was not applied on any rank)\n"
    "  ReplicasDiverged was raised on every rank; nothing was healed\n",
]


def test_each_drift_is_one_incident_that_status_lists_and_nothing_else_is_raised(drill):
    for r in range(3):  # the same incidents on every rank; none from the clean run
        assert [(i["kind"], i["reason"]) for i in drill[r]["incidents"]] == [("numerics", f) for f in FOUND]
    status = drill[0]["status"]
    # Past events that named no suspect device: the job is healthy.
    assert (status["code"], status["health"], status["reasons"], status["incident_count"]) == (0, "healthy", [], 2)
    assert status["incidents"] == [
        {"n": n, "kind": "numerics", "reason": f, "open": False, "suspects": []} for n, f in enumerate(FOUND, 1)
    ]
    for f in FOUND:
        assert f[:80] in status["screen"], status["screen"]


def test_ncclguard_report_says_a_silent_corruption_was_seen_and_whom_the_drifted_rank_was_healed_from(drill, capsys):
    for incident, found, seen in zip(drill[0]["incidents"], FOUND, SEEN, strict=True):
        assert main(["report", incident["dir"]]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"ncclguard incident {incident['id']}: {found}\n")
        assert (
            f"\nIN ONE LINE\n  {found}\n\n"
            f"SILENT CORRUPTION (step {found.split(' ', 2)[1][:-1]}, attempt 1, no phase set; the replicas' digests "
            f"compared at the commit, before the step was applied)\n{seen}"
        ) in out
    where = Path(drill[0]["incidents"][0]["dir"])
    tl = timeline(load(where)[0], where)
    assert tl.marks == {2: "replica drifted (parameters)"}
