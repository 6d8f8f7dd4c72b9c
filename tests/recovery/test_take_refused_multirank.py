"""A snapshot's take that fails or is refused never fails a training step (issue 59: "a take never
fails a step"): real gloo ranks, FSDP2, a snapshot every step. Rank side: tests/workers/take_refused_worker.py.

At step 2 rank 1's capture is slow, past the take's deadline: rank 0's wait for its replica times
out. Every rank comes to the take's agreement in the job's store (ncclguard/recovery/snapshots/agreement.py),
so the take fails alone: the step goes on, the snapshots of step 1 stay, and the side group is made
again at the next take, which commits.

From step 6 rank 1's module holds a buffer rank 0's does not, so each rank refuses the other's
replica at its manifest (ncclguard/recovery/snapshots/packing.py ``admit_peer``). Every rank agrees the
take was only refused: the step goes on, the snapshots of step 5 stay, and the next take comes later,
backing off.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank


def test_a_failed_or_refused_take_leaves_the_step_applied_the_snapshot_before_kept_and_backs_off() -> None:
    # About 25 s here (2 ranks, 14 steps of a 1.1M-parameter model, a take 7.5 s late); hang guard 180 s.
    job = run_ranks("take_refused_worker", 2, timeout_s=180)
    for r in (0, 1):
        res = job[r]
        assert res["rows"] == [[s, True, 1, 0] for s in range(14)], res["rows"]  # no step failed, no rebuild
        assert res["world"] == [r, 2]
        takes, failed, refused, in_a_row = res["takes"]
        # Steps 0-1 committed; step 2's failed (rank 1 late), the next at step 4 (2 later) on a new side
        # group committed, and 5; from step 6 each take is refused, the next 2, then 4, later: 6, 8, 12.
        assert (takes, failed, refused, in_a_row) == (4, 4, 3, 3), res["takes"]
        assert res["held"][-1] == 5, res["held"]  # the newest snapshot kept is the last committed one
        assert res["heartbeat_says"].startswith(
            "3 takes in a row lost, the newest snapshot is of step 5; the last refused: rank 0: the snapshots' swap was "
            "refused: rank 1's: its tensors are not this rank's"
        ), res["heartbeat_says"]
        assert 5.0 <= res["deadline_s"] < 6.0  # heal_timeout, and the take's bytes at a slow link's rate
    out = job.output
    assert out.count("snapshots: step 2's snapshot failed (rank 0: ") == 2, out  # both read rank 0's reason
    assert "step 4's snapshot" not in out
    assert out.count("snapshots: step 6's snapshot refused") == 2  # said once per rank and reason
    assert "snapshots: step 8's snapshot refused" not in out
    assert out.count("snapshots: 3 takes in a row lost (the last: ") == 2  # the one line, once per rank
