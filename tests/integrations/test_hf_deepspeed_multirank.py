"""The HF Trainer on DeepSpeed ZeRO under ``guard_trainer(recover=True, heal=True)``, on real gloo
ranks under torchrun: a failed step redone on a new engine, a killed rank healed from its buddy's
in-memory snapshot, every rank bit-equal to a run without a fault.

Launches (tests/workers/hf_deepspeed_worker.py, which says more), each under torchrun:
``heal`` 3 ranks, each under its supervisor (``--restarts=1``): a tiny BERT on ZeRO-3, 8 steps without a
    fault (the reference), then guarded: rank 2 raises at step 1, rank 0 sleeps 8 s past the 3 s step bound
    at step 2 (both redone on a new engine), rank 1 SIGKILLs itself at step 5; restarted, it takes its
    partitions from its buddy and every rank goes back to the snapshot of step 4. A drill (`make drills`; its
    test says what stays in the suite).
``stages`` 2 ranks: what ``guard_trainer(recover=True)`` refuses before any step; ZeRO-1 and ZeRO-2 Trainers
    (ZeRO-2 with ``model_init`` and 2 micro-batches a step), each a reference run and a guarded run whose
    step 1 raises on rank 1; a snapshot's state that does not fit the engine it is offered to is refused.
``numerics`` 3 ranks: ZeRO-2 and ZeRO-3 Trainers under ``on_nonfinite="redo"``: a NaN loss on rank 1 at step 2
    and on rank 2 at step 3 (first attempts), each named and redone on a new engine, bit-equal to the run
    without them; ZeRO-2 under ``"raise"``."""

from __future__ import annotations

import pytest
from harness import run_ranks

# The heal launch's guard (480 s, below) is over pytest-timeout's 300 s default.
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

STEPS, RAISE, STALL, KILL = 8, 1, 2, 5
BACK = KILL - 1  # snapshot_every=2: the newest snapshot every rank holds at the kill is of step KILL-1


@pytest.fixture(scope="module")
def heal_job():
    # Two ZeRO-3 runs of 8 steps on 3 ranks: a raise and an 8 s stall each redone on a new engine
    # (a 3 s step bound), a SIGKILL and a cold restart that imports torch, transformers and DeepSpeed
    # again: 45 s on a quiet machine. Hang guard: 480 s.
    return run_ranks("hf_deepspeed_worker", 3, "heal", supervise=["--restarts=1"], timeout_s=480)


@pytest.fixture(scope="module")
def stages_job():
    # The refusals, then ZeRO-1 and ZeRO-2: 3 steps each, twice, a redo each: 20 s on a quiet machine.
    return run_ranks("hf_deepspeed_worker", 2, "stages", timeout_s=300)


@pytest.fixture(scope="module")
def numerics_job():
    # Seven 4-step Trainer runs on 3 ranks, four redos on a new engine: 26 s on a quiet machine. Hang guard: 300 s.
    return run_ranks("hf_deepspeed_worker", 3, "numerics", timeout_s=300)


# A drill (`make drills`): a killed rank of a ZeRO-3 Trainer restored from its snapshots, bit-equal step by step, stays
# in the suite in tests/integrations/test_hf_bitequal_multirank.py (``kill short`` and ``host``); a Trainer's step
# redone on a new engine, in this module's ``stages`` (a raise on ZeRO-1 and ZeRO-2) and ``numerics`` (ZeRO-2 and
# ZeRO-3) launches; a stall past the step bound redone on a new engine, in
# tests/integrations/test_deepspeed_commit_multirank.py (``rebuild_engine``).
@pytest.mark.drill
def test_a_killed_zero3_rank_heals_from_its_buddy_and_every_rank_ends_bit_equal(heal_job):
    assert "exited -9; restart 1 of 1" in heal_job.output
    reference, ref_losses = heal_job[0]["reference"], heal_job[0]["reference_losses"]
    assert len(ref_losses) == STEPS
    for r in range(3):
        res = heal_job[r]
        assert res["world"] == [r, 3, 3]  # three rebuilds: the raise, the stall, the kill
        assert res["digest"] == reference  # the full gathered parameters, bit for bit
        assert res["losses"] == ref_losses  # one logged loss per step, each the fault-free run's
        assert res["global_step"] == res["global_steps"] == STEPS  # the Trainer's count and DeepSpeed's
        # Each recovery in the Trainer's log (the attempts it took); the restarted rank's log up to
        # step BACK came with the Trainer's state in its snapshot, so it holds the first two.
        assert res["logged"] == ([2, 2] if r == 1 else [2, 2, 2])
    assert (heal_job[0]["life"], heal_job[1]["life"], heal_job[2]["life"]) == (0, 1, 0)
    for r in (0, 2):
        # Steps RAISE and STALL entered twice (the redo on a new engine); the kill at step KILL
        # sent every rank back to the snapshot of step BACK, through the Trainer's resume path.
        assert heal_job[r]["begun"] == [0, 1, 1, 2, 2, 3, 4, 5, 4, 5, 6, 7]
        assert heal_job[r]["recoveries"] == [[RAISE, 2, 1, []], [STALL, 2, 2, []], [BACK, 2, 3, [1]]]
    victim = heal_job[1]
    assert victim["begun"] == list(range(BACK, STEPS))  # the restarted process starts at the snapshot's step
    assert victim["recoveries"] == []  # its first step was the others' redo
    assert "snapshots: every rank is back at step 4 (rank 1 receiver" in heal_job.output
    assert "(rank 2 holder, rolled back" in heal_job.output  # rank 1's buddy sent its replica


def test_zero_1_and_2_trainers_redo_a_failed_step_bit_equal(stages_job):
    for r in range(2):
        res = stages_job[r]
        for stage in (1, 2):  # ZeRO-2's Trainer: model_init, 2 micro-batches a step, the second raising
            assert res[f"z{stage}_digest"] == res[f"reference{stage}"]
            assert res[f"z{stage}_losses"] == res[f"reference_losses{stage}"]
            assert res[f"z{stage}_begun"] == [0, 1, 1, 2]
            assert res[f"z{stage}_recoveries"] == [[1, 2, stage, []]]
            assert res[f"z{stage}_global_step"] == res[f"z{stage}_global_steps"] == 3


def test_what_cannot_be_recovered_is_refused_before_any_step(stages_job):
    res = stages_job[0]
    assert "ZeRO stage 0" in res["refused_stage0"] and "train without deepspeed=" in res["refused_stage0"]
    assert "offload_optimizer to NVMe" in res["refused_nvme"] and "offload to cpu" in res["refused_nvme"]
    assert res["refused_shrink"].startswith("allow_shrink=True cannot go on with DeepSpeed ZeRO")
    assert "this model is a Sequential: pass Trainer(model_init=...)" in res["refused_module"]
    assert res["accepted_model_init"] == "accepted"
    # fsdp= on the CPU: Accelerate leaves FSDP off and the Trainer trains under DDP, which is recovered.
    assert res["fsdp_on_cpu"] == [False, "DistributedType.MULTI_CPU", "accepted"]
    assert "TrainingArguments(fsdp=...) is not in force here" in stages_job.output


def test_a_snapshot_of_another_model_is_refused_and_nothing_is_copied(stages_job):
    for r in range(2):
        res = stages_job[r]
        assert res["stage_refusal"] == "zero_stage: the capture has 2, this engine 1"
        assert res["apply_refused"].startswith("DeepSpeedState.apply: the capture does not fit this engine: zero_stage")
        assert res["unchanged_after_refusal"] is True
        assert (
            "parameter bert.embeddings.word_embeddings.weight: shape [100, 32] in the capture, [100, 64] here"
            in (res["shape_refusal"])
        )


NAN_AT = 2  # the worker's: rank 1's NaN at step 2, rank 2's at step 3
EMBEDDINGS = [  # each parameter a bucket: the first four of the model's, in its order (all NaN: the loss was)
    [f"bert.embeddings.{name}"]
    for name in (
        "word_embeddings.weight",
        "position_embeddings.weight",
        "token_type_embeddings.weight",
        "LayerNorm.weight",
    )
]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_trainer_on_zero_names_a_nan_at_its_rank_and_redoes_the_step_on_a_new_engine_bit_equal(numerics_job, stage):
    for r in range(3):
        res = numerics_job[r]
        # Fault-free: checked, nothing seen, no step entered twice.
        assert (res[f"clean{stage}_checked"], res[f"clean{stage}_seen"]) == (True, [])
        assert res[f"clean{stage}_begun"] == [0, 1, 2, 3] and res[f"clean{stage}_digest"] == res[f"reference{stage}"]
        # Each NaN named at its rank and parameters, the other two ranks finite, the step redone once; the
        # second on the engine the first redo built (its new parameters carry the check too).
        assert res[f"nan{stage}_seen"] == [
            [NAN_AT, [1], [0, 2], "redo", {"1": EMBEDDINGS}],
            [NAN_AT + 1, [2], [0, 1], "redo", {"2": EMBEDDINGS}],
        ]
        assert res[f"nan{stage}_begun"] == [0, 1, 2, 2, 3, 3]  # each redo entered the Trainer's loop again there
        assert res[f"nan{stage}_recoveries"] == [] and res[f"nan{stage}_logged"] == []  # no world rebuilt
        # The full gathered parameters and every logged loss: the fault-free run's, bit for bit (ZeRO-3 is
        # not without the new engine: the old one kept rank 1's NaN in its partitions).
        assert res[f"nan{stage}_digest"] == res[f"reference{stage}"]
        assert res[f"nan{stage}_losses"] == res[f"reference_losses{stage}"]
        assert res[f"nan{stage}_global_step"] == res[f"nan{stage}_global_steps"] == 4


def test_the_trainer_on_zero_raises_a_nan_with_raise_on_every_rank_refuses_skip_and_never_rebuilt(numerics_job):
    for r in range(3):
        res = numerics_job[r]
        assert res["raised"].startswith("step 2: non-finite gradient on rank 1 (NaN in bucket 0 (bert.embeddings.")
        assert res["raised"].endswith(
            "ranks 0,2 were finite; the step was not applied on any rank: NonFiniteGradient is raised"
        )
        assert res["generation"] == 0
        assert res["refused_skip"].startswith("on_nonfinite='skip' cannot drop a batch under DeepSpeed")
        assert res["refused_skip"].endswith("Use on_nonfinite='redo' (the step runs again on a new engine) or 'raise'")
