"""A NaN under FSDP2, named at its rank and module before the reduce-scatter spreads it, never applied.

One launch of tests/workers/fsdp2_numerics_worker.py (3 gloo ranks): numerics_worker's 956,042-parameter
classifier sharded by ``RecoveringStep(..., wrap=FSDP2(each Linear, then the root))``, three runs of 6 steps
over the same batches (``off``: FSDP2's own reduce-scatters; ``clean``: each FSDP module's reduce-scatter
checked, ``on_nonfinite="redo"``; ``redo``: rank 1's loss times NaN at step 3, first attempt), then
``on_nonfinite="auto"``, which leaves FSDP2 unchecked and says so.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]  # 60 s past the launch's own hang guard

STEPS, K = 6, 3  # fsdp2_numerics_worker's
FINITE = {"ok": True, "attempts": 1, "rebuilds": 0, "skipped": False, "commits": [[True, []]], "nonfinite": [{}]}
# One "bucket" per FSDP module that holds parameters, in module order; its own parameters, in theirs.
MODULES = [
    {"index": i, "kind": "NaN", "params": [f"{name}.weight", f"{name}.bias"], "more_params": 0}
    for i, name in enumerate(("fc1", "fc2", "fc3", "head"))
]
REDONE = {
    "ok": True,
    "attempts": 2,
    "rebuilds": 0,
    "skipped": False,
    "commits": [[False, [1]], [True, []]],
    "nonfinite": [{"1": MODULES}, {}],
    "finite": [[0, 2], [0, 1, 2]],
    "error": None,
}


@pytest.fixture(scope="module")
def job():
    # Four 6-step FSDP2 runs after torchrun's start: about 20 s here. Hang guard: 9x that.
    return run_ranks("fsdp2_numerics_worker", 3, timeout_s=180)


def test_each_fsdp_modules_reduce_scatter_is_checked_and_a_fault_free_run_reports_nothing(job):
    for r in range(3):
        res = job[r]
        assert not res["off"]["carries"] and res["clean"]["carries"] and res["redo"]["carries"]
        assert res["clean"]["results"] == [{**FINITE, "finite": [[0, 1, 2]], "error": None}] * STEPS
        assert res["clean"]["seen"] == [] and res["clean_said"] == [] and res["off_said"] == []
        assert res["clean_equal_to_off"], r  # the checked reduce-scatter is FSDP2's own, bit for bit


def test_a_nan_on_one_rank_is_named_at_every_module_redone_once_and_ends_bit_equal(job):
    for r in range(3):
        res = job[r]["redo"]
        assert res["results"][K] == REDONE, (r, res["results"][K])
        assert all(
            s == {**FINITE, "finite": [[0, 1, 2]], "error": None} for i, s in enumerate(res["results"]) if i != K
        )
        assert res["seen"] == [[K, [1], [0, 2], "redo"]]
        said = [line for line in job[r]["redo_said"] if "RecoveringStep: step" in line]
        assert said == [
            f"[rank {r}] RecoveringStep: step {200 + K}: non-finite gradient on rank 1 (NaN in bucket 0 (fc1.weight, "
            "fc1.bias); NaN in bucket 1 (fc2.weight, fc2.bias); NaN in bucket 2 (fc3.weight, fc3.bias); NaN in bucket 3 "
            "(head.weight, head.bias)); ranks 0,2 were finite; the step was not applied on any rank: its state is put "
            "back and it runs again (on_nonfinite='redo')"
        ]
        # The full parameters and AdamW's state, gathered: as if the NaN had never been.
        assert job[r]["redo_equal_to_off"], r


def test_auto_leaves_fsdp2_unchecked_and_says_so_once(job):
    for r in range(3):
        auto = job[r]["auto"]
        assert not auto["carries"]
        assert auto["said"] == [
            f"[rank {r}] RecoveringStep: gradients are not checked for NaN or Inf: on_nonfinite='auto' leaves FSDP2 "
            "unchecked (its check has not run on a GPU yet); 'redo' checks it (docs/numerics.md)"
        ]
