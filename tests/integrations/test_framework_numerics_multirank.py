"""A NaN under a framework's own DDP wrapper, named at its rank and bucket and never applied, on 3 gloo ranks.

One launch of tests/workers/framework_numerics_worker.py (``accelerate``): ``Accelerator(cpu=True)``,
numerics_worker's 956,042-parameter classifier prepared by Accelerate and stepped by
``recovering_step(..., on_nonfinite="redo")``, three runs of 6 steps over the same batches (``off``: no
check, DDP's own path; ``clean``; ``redo``: rank 1's loss times NaN at step 3, first attempt), then two
wrappers the check leaves alone (constructed only). One launch of ``hf``: the same three runs as HF Trainers
(``TrainingArguments(use_cpu=True, ddp_backend="gloo")``, ``guard_trainer(recover=True, on_nonfinite=...)``,
the same seed, so the same batches; rank 1's loss times NaN in ``compute_loss``), each step's ``StepResult``
read where the adapter settles it. One launch of ``lightning``: the same three runs as Lightning fits
(``DDPStrategy(process_group_backend="gloo")``, ``NcclGuardCallback(recover=True, on_nonfinite=...)``; rank 1's
loss times NaN in ``training_step``; a drill, `make drills`: Lightning's DDP strategy wraps torch's
``DistributedDataParallel``, checked through the engine's one hook as Accelerate's and the Trainer's are in the
other two launches, which stay in the suite). Each launch ends with a fourth run, ``flipped``: ``replica_check_every=3``,
no NaN, and once step 2 is applied one bit of one element of rank 2's ``fc2.weight`` flipped: the check of
step 3 names rank 2, heals it from rank 0 in the same world and redoes the step, which ends bit-equal
to the run without the flip (the framework's own wrapper, as ``RecoveringStep``'s own in
tests/recovery/test_replicas_multirank.py).
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]  # 60 s past the launch's own hang guard

STEPS, K = 6, 3  # framework_numerics_worker's
FINITE = {"ok": True, "attempts": 1, "rebuilds": 0, "skipped": False, "commits": [[True, []]], "nonfinite": [{}]}
BUCKETS = [  # DDP's two buckets once rebuilt after step 0, each in its order
    {"index": 0, "kind": "NaN", "params": ["head.bias", "head.weight", "fc3.bias", "fc3.weight"], "more_params": 0},
    {"index": 1, "kind": "NaN", "params": ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"], "more_params": 0},
]


@pytest.fixture(scope="module")
def accelerate():
    # Four 6-step runs and two constructions after torchrun's start: about 25 s here. Hang guard: 7x that.
    return run_ranks("framework_numerics_worker", 3, "accelerate", timeout_s=180)


@pytest.fixture(scope="module")
def lightning():
    # Four 6-step fits after torchrun's start: about 20 s here. Hang guard: 9x that.
    return run_ranks("framework_numerics_worker", 3, "lightning", timeout_s=180)


@pytest.fixture(scope="module")
def hf():
    # Six 6-step Trainer runs after torchrun's start: about 25 s here. Hang guard: 7x that.
    return run_ranks("framework_numerics_worker", 3, "hf", timeout_s=180)


REDONE = {
    "ok": True,
    "attempts": 2,
    "rebuilds": 0,
    "skipped": False,
    "commits": [[False, [1]], [True, []]],
    "nonfinite": [{"1": BUCKETS}, {}],
    "finite": [[0, 2], [0, 1, 2]],
    "error": None,
}


def test_accelerates_wrapper_is_checked_and_a_fault_free_run_reports_nothing(accelerate):
    for r in range(3):
        clean = accelerate[r]["clean"]
        assert clean["carries"] is True and accelerate[r]["off"]["carries"] is False
        assert clean["results"] == [{**FINITE, "finite": [[0, 1, 2]], "error": None}] * STEPS
        assert clean["seen"] == [] and accelerate[r]["clean_said"] == []


def test_a_nan_in_one_ranks_loss_is_named_redone_once_and_ends_bit_equal_to_ddps_own_path(accelerate):
    for r in range(3):
        redo = accelerate[r]["redo"]
        assert redo["results"][K] == REDONE
        assert redo["results"][:K] + redo["results"][K + 1 :] == [{**FINITE, "finite": [[0, 1, 2]], "error": None}] * (
            STEPS - 1
        )
        assert redo["seen"] == [[K, [1], [0, 2], "redo"]]
        # The hook reduces as DDP's own path does (the clean run), and the redone step left no trace.
        assert accelerate[r]["clean_equal_to_off"] is True and accelerate[r]["redo_equal_to_off"] is True
        assert accelerate[r]["redo_same_everywhere"] is True


def test_a_wrapper_with_its_own_comm_hook_or_bucket_views_is_left_unchecked_and_said_once(accelerate):
    for r in range(3):
        alone = accelerate[r]["left_alone"]
        assert alone["own_hook"]["carries"] is False and alone["bucket_view"]["carries"] is False
        (hook,) = alone["own_hook"]["said"]
        assert "carries a comm hook already (allreduce_hook)" in hook
        (view,) = alone["bucket_view"]["said"]
        assert "gradient_as_bucket_view=True" in view and "bit for bit" in view


def three_runs(job) -> None:
    """The off, clean and redo runs of ``hf`` or ``lightning``, as the Accelerate test asserts them."""
    checked = [{**FINITE, "finite": [[0, 1, 2]], "error": None}]
    for r in range(3):
        off, clean, redo = job[r]["off"], job[r]["clean"], job[r]["redo"]
        # Fault-free: the off run carries no hook; the checked one carries it and reports nothing.
        assert off["carries"] is False and off["seen"] == [] and off["global_step"] == STEPS
        assert off["results"] == [{**FINITE, "finite": [[]], "error": None}] * STEPS
        assert clean["carries"] is True and clean["results"] == checked * STEPS
        assert clean["seen"] == [] and job[r]["clean_said"] == [] and clean["global_step"] == STEPS
        # Rank 1's NaN: named with its buckets and parameters, ranks 0 and 2 finite, the step redone once in place.
        assert redo["carries"] is True and redo["global_step"] == STEPS
        assert redo["results"][K] == REDONE
        assert redo["results"][:K] + redo["results"][K + 1 :] == checked * (STEPS - 1)
        assert redo["seen"] == [[K, [1], [0, 2], "redo"]] and redo["tries_at_k"] == 2
        # The hook reduces as DDP's own path does (the clean run), and the redone step left no trace.
        assert job[r]["clean_equal_to_off"] is True and job[r]["redo_equal_to_off"] is True
        assert job[r]["redo_same_everywhere"] is True


def test_the_hf_trainers_wrapper_is_checked_a_nan_is_named_redone_once_and_ends_bit_equal(hf):
    three_runs(hf)


def test_with_skip_the_trainer_drops_the_batch_on_every_rank_as_a_run_that_never_trained_on_it(hf):
    for r in range(3):
        skip, never = hf[r]["skip"], hf[r]["never"]
        # Named at step K, not redone: the step's result is falsy and skipped on every rank.
        assert skip["seen"] == [[K, [1], [0, 2], "skip"]] and skip["tries_at_k"] == 1
        assert skip["results"][K] == {
            "ok": False,
            "attempts": 1,
            "rebuilds": 0,
            "skipped": True,
            "commits": [[False, [1]]],
            "nonfinite": [{"1": BUCKETS}],
            "finite": [[0, 2]],
            "error": "NonFiniteGradient",
        }
        # The Trainer went on (its count includes the dropped batch), and neither the optimizer nor the LR
        # scheduler stepped for it: the parameters of a run that never trained on batch K, bit for bit.
        assert skip["global_step"] == never["global_step"] == STEPS
        assert hf[r]["skip_equal_to_never"] is True and hf[r]["skip_equal_to_off"] is False
        assert skip["lr"] == never["lr"]


# A drill (`make drills`), with the lightning case of the flipped bit below: the same check of a framework's
# DDP wrapper (the engine's numerics.adopt) stays in the suite under Accelerate and the HF Trainer.
@pytest.mark.drill
def test_lightnings_wrapper_is_checked_a_nan_is_named_redone_once_and_ends_bit_equal(lightning):
    three_runs(lightning)


@pytest.mark.parametrize("which", ["accelerate", "hf", pytest.param("lightning", marks=pytest.mark.drill)])
def test_a_flipped_bit_in_one_ranks_replica_under_a_frameworks_wrapper_is_named_healed_and_ends_bit_equal(
    which, request
):
    job = request.getfixturevalue(which)
    for r in range(3):
        flipped = job[r]["flipped"]
        # Step 3's check: rank 2 named, healed from rank 0 (the lowest of the majority), no rebuild.
        assert flipped["replicas_seen"] == [[3, [2], 0, True]]
        assert [(s["attempts"], s["rebuilds"], s["ok"]) for s in flipped["results"]] == [(1, 0, True)] * 3 + [
            (2, 0, True)
        ] + [(1, 0, True)] * 2
        assert flipped["results"][3]["commits"] == [[False, [2]], [True, []]]
        assert flipped["seen"] == []  # no NaN was named
        # The healed rank redid the step from rank 0's replica: every rank ends as the run without the flip.
        assert job[r]["flipped_equal_to_off"] is True and job[r]["flipped_same_everywhere"] is True
    # The other runs keep the default period (the steps whose number 100 divides): nothing drifted there.
    assert all(job[r][run]["replicas_seen"] == [] for r in range(3) for run in ("off", "clean", "redo"))
