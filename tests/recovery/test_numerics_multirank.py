"""A gradient that turns NaN or Inf on one rank, named at its source and never applied, on 3 real gloo ranks.

One launch of tests/workers/numerics_worker.py, 3 ranks under torchrun, scenario ``drill``: five runs
in a row from the same start (a 956,042-parameter classifier with dropout, AdamW, a warm-up LR
schedule stepped every iteration, shuffled data, 8 steps, RecoveringStep with every default but
``on_nonfinite="redo"`` unless said: the default, ``"auto"``, checks only a model on a GPU); rank 1's gradient of ``fc1.weight`` is poisoned by a tensor hook, so one of DDP's two buckets
holds it:

1. ``clean``: no fault: nothing reported, every commit names the three ranks finite, 0 rebuilds.
2. ``redo``: NaN at step K in the first attempt: the commit names rank 1, bucket 1 and its four
   parameters, ranks 0 and 2 finite; the step is redone once on the same world (no rebuild) and the
   run ends bit-equal to ``clean``.
3. ``skip``: ``on_nonfinite="skip"``, Inf at steps K and K2: both steps skipped (falsy,
   ``NonFiniteGradient``), rank 1 named a suspect device once; the run ends bit-equal to ``plain``.
4. ``plain``: a plain DDP loop without ncclguard that leaves batches K and K2 out (so the check's
   comm hook also reduces as DDP's own path does, bit for bit).
5. ``raise``: ``on_nonfinite="raise"``: every rank raises ``NonFiniteGradient`` naming rank 1, its
   parameters as the step found them.

Then ``safe_all_reduce``'s input check: NaN on rank 1 with ``check_finite=True``, Inf on rank 2 with
``verify=True`` under ``Config.check_finite="verified"``: every rank's call fails naming the rank,
nothing reduced; a finite call after it works; under the default (``"never"``) nothing is checked.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]  # 60 s past the launch's own hang guard

STEPS, K, K2 = 8, 3, 6  # numerics_worker's
CLEAN = {
    "ok": True,
    "attempts": 1,
    "rebuilds": 0,
    "skipped": False,
    "commits": [[True, []]],
    "nonfinite": [{}],
    "finite": [[0, 1, 2]],
    "error": None,
}
# DDP's second bucket once rebuilt after step 0 (the first holds head and fc3), in its order.
BUCKET_1 = ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]


def flagged(kind: str) -> dict[str, list[dict[str, object]]]:
    return {"1": [{"index": 1, "kind": kind, "params": BUCKET_1, "more_params": 0}]}


@pytest.fixture(scope="module")
def drill():
    # Five short runs and four all_reduces after torchrun's start: 9 s here. Hang guard: over 10x that.
    return run_ranks("numerics_worker", 3, "drill", timeout_s=150)


def test_a_fault_free_run_reports_nothing_and_rebuilds_nothing(drill):
    for r in range(3):
        clean = drill[r]["clean"]
        assert clean["results"] == [CLEAN] * STEPS
        assert (clean["seen"], clean["suspects"], clean["recoveries"], clean["raised"]) == ([], [], 0, None)
        assert drill[r]["clean_warnings"] == []


def test_a_nan_named_at_its_rank_bucket_and_parameters_is_redone_once_and_ends_bit_equal(drill):
    redone = {
        "ok": True,
        "attempts": 2,
        "rebuilds": 0,
        "skipped": False,
        "commits": [[False, [1]], [True, []]],
        "nonfinite": [flagged("NaN"), {}],
        "finite": [[0, 2], [0, 1, 2]],
        "error": None,
    }
    for r in range(3):
        redo = drill[r]["redo"]
        assert redo["results"] == [CLEAN] * K + [redone] + [CLEAN] * (STEPS - K - 1)
        assert redo["seen"] == [[K, [1], [0, 2], "redo"]]
        assert (redo["suspects"], redo["recoveries"]) == ([], 0)  # a redo for the values is no recovery
        assert drill[r]["redo_equal_to_clean"] is True  # bit for bit, the run without the fault
        assert drill[r]["redo_same_everywhere"] is True


def test_skipped_batches_leave_no_trace_and_a_rank_flagged_twice_is_a_suspect_device(drill):
    skipped = {
        "ok": False,
        "attempts": 1,
        "rebuilds": 0,
        "skipped": True,
        "commits": [[False, [1]]],
        "nonfinite": [flagged("Inf")],
        "finite": [[0, 2]],
        "error": "NonFiniteGradient",
    }
    for r in range(3):
        skip = drill[r]["skip"]
        expected = [CLEAN] * STEPS
        expected[K] = expected[K2] = skipped
        assert skip["results"] == expected
        assert skip["seen"] == [[K, [1], [0, 2], "skip"], [K2, [1], [0, 2], "skip"]]
        assert skip["suspects"] == [1]
        (warning,) = drill[r]["skip_suspect_warnings"]  # one warning, on every rank, naming rank 1
        assert f"[rank {r}] RecoveringStep: rank 1 gave a non-finite gradient again at step {200 + K2}" in warning
        # Bit for bit, a plain DDP loop (no hook, no ncclguard) that left batches K and K2 out.
        assert drill[r]["skip_equal_to_plain"] is True
        assert drill[r]["skip_same_everywhere"] is True
        assert drill[r]["skip_differs_from_clean"] is True
        assert drill[r]["finite"] is True  # every parameter of the three runs


def test_with_raise_every_rank_raises_naming_the_rank_and_nothing_is_applied(drill):
    for r in range(3):
        raised = drill[r]["raise"]
        assert raised["results"] == [CLEAN] * K
        assert raised["raised"] == {
            "step": 300 + K,
            "ranks": [1],
            "finite": [0, 2],
            "action": "raise",
            "buckets": {"1": [{"index": 1, "kind": "NaN", "params": BUCKET_1, "more_params": 0}]},
            "untouched": True,
        }


def test_safe_all_reduce_names_a_non_finite_input_before_anything_is_reduced(drill):
    for r in range(3):
        said = drill[r]["all_reduce"]
        mine = [float(r + i) for i in range(4)]
        assert said["checked"] == {
            "ok": False,
            "error": "NonFiniteInput",
            "ranks": [1],
            "kinds": {"1": "NaN"},
            "nothing_reduced": True,
            "untouched": True,  # bit for bit, rank 1's NaN included
            "values": mine if r != 1 else [1.0, 2.0, "nan", 4.0],
        }
        assert said["finite_after"] == {
            "ok": True,
            "error": None,
            "ranks": None,
            "kinds": {},
            "nothing_reduced": False,
            "untouched": False,
            "values": [3.0, 6.0, 9.0, 12.0],
        }
        assert said["verified"]["error"] == "NonFiniteInput" and said["verified"]["ranks"] == [2]
        assert said["verified"]["kinds"] == {"2": "Inf"} and said["verified"]["untouched"] is True
        # Off by default (its measured cost, docs/numerics.md): not checked, even in the round; the NaN spreads.
        assert said["default"]["ok"] is True and said["default"]["values"] == [3.0, 6.0, "nan", 12.0]
