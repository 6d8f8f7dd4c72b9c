"""A snapshot's take refused by a buddy never fails a training step (issue 59: "a take never fails a
step"): real gloo ranks, FSDP2, a snapshot every step. Rank side: tests/workers/take_refused_worker.py.

From step 4 rank 1's module holds a buffer rank 0's does not, so each rank refuses the other's
replica at its manifest (ncclguard/recovery/snapshots/packing.py ``admit_peer``). Before, each
refused take failed its step: the world was rebuilt at every step. Now every rank agrees the take
was only refused (every rank alive, the side group whole): the step goes on, the snapshots of step 3
stay, and the next take comes later, backing off.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank


def test_a_refused_take_leaves_the_step_applied_the_snapshot_before_kept_and_backs_off() -> None:
    # About 15 s here (2 ranks, 12 steps of a 1.1M-parameter model); hang guard 180 s.
    job = run_ranks("take_refused_worker", 2, timeout_s=180)
    for r in (0, 1):
        res = job[r]
        assert res["rows"] == [[s, True, 1, 0] for s in range(12)], res["rows"]  # no step failed, no rebuild
        assert res["world"] == [r, 2]
        takes, failed, refused = res["takes"]
        # Takes at steps 0-3 committed; from step 4 each take is refused and the next comes later: steps
        # 4, 6 (2 later), 10 (4 later) within 12 steps.
        assert (takes, failed, refused) == (4, 3, 3), res["takes"]
        assert res["held"][-1] == 3, res["held"]  # the newest snapshot kept is the last committed one
    assert job.output.count("snapshots: step 4's snapshot was refused") == 2  # said once per rank and reason
    assert "snapshots: step 6's snapshot was refused" not in job.output
