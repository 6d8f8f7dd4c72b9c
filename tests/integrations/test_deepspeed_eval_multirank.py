"""guarded_evaluate / patch_trainer on real DeepSpeed engines (ZeRO 0 and 2) of the real tiny Qwen2.5-VL
classifier, 2 ranks under torchrun with gloo on CPU.

The trainer is reference_trainer.ReferenceTrainer, whose evaluate()
all-reduces its metrics with dist.all_reduce on the default group, as the seeds' trainer does.

Launches (tests/workers/deepspeed_worker.py), each 2 ranks under torchrun:
``0`` ``2`` (the ZeRO stages, as arguments of one launch): first the side group alone (default-group calls
    routed to it; rank 0's all_reduce on it, which rank 1 never joins, ends at a 1.5 s deadline); then per
    stage a healthy evaluation unguarded and guarded; rank 1 stalling 30 s in its first evaluation batch
    (both ranks skip at the 2 s deadline, 3 training steps follow); rank 1 late to an evaluation (both
    skip); a retry whose shrink() halves the batch; slim_outputs on the engine.
``example``: docs/examples/deepspeed_guarded_eval.py with ``--stall-rank 1 --steps 8 --timeout 2``: the
    evaluation of step 4 is skipped on both ranks, the one of step 8 works, parameters equal across ranks.
"""

from __future__ import annotations

import re

import pytest
from harness import run_ranks

# The launch's own guard (330 s, below) is over pytest-timeout's 300 s default: this module's is 400.
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(400)]
RANKS = (0, 1)
STAGES = ("zero0", "zero2")
TIMEOUT_S = 2.0  # the worker's evaluation deadline
STALL_S = 30.0  # how long rank 1 would stall without the guard
# The hang guard of a call the deadline ends: half the 30 s that the stall (or the side group's own
# timeout) would take, so a call they ended cannot pass; over 7x the 2 s deadline.
GUARD_S = STALL_S / 2


@pytest.fixture(scope="module")
def job():
    # The first DeepSpeed launch on a machine JIT-builds deepspeed_shm_comm (about a minute on 2
    # cores; `make` builds it into .venv/torch_extensions beforehand); the bound leaves room for it. Hang
    # guard: over 3x the 102 s the launch took, built, at load average 11.
    return run_ranks("deepspeed_worker", 2, "0", "2", timeout_s=330)


@pytest.fixture(params=STAGES)
def stage(request):
    return request.param


def test_side_group_takes_default_group_calls_and_restores_it(job):
    for r in RANKS:
        eg = job[r]["eval_group"]
        assert eg["routed_is_side"] is True
        assert eg["routed_sum"] == 3.0  # 1 + 2: the call went through the side group
        assert eg["restored_after_error"] is True
        assert eg["world_ok_after"] is True


def test_side_group_op_gives_up_at_the_deadline_not_at_its_own_timeout(job):
    eg = job[0]["eval_group"]
    assert "Timed out waiting" in eg["op"]
    # Deadline 1.5 s after start, group timeout 30 s: it ends at the deadline, never before it, and
    # long before the group's own timeout (the upper bound is a hang guard, 3x a loaded run's need).
    assert 1.3 <= eg["op_elapsed_s"] < GUARD_S


def test_lowering_a_gloo_timeout_does_not_reach_an_op_in_flight(job):
    # Group timeout 4 s; deadline_timeout entered 0.3 s after the op started, with a deadline 1 s
    # after the start, lowers it: the op in flight still waits its 4 s.
    assert job[0]["eval_group"]["inflight_op_elapsed_s"] >= 3.5


def test_healthy_guarded_evaluation_returns_what_the_unguarded_one_returns(job, stage):
    for r in RANKS:
        res = job[r][stage]
        assert res["guarded"] == res["unguarded"]
        assert res["sums_guarded"] == res["unguarded"]  # EvalSums reduced by the guard
        assert res["healthy_report"]["ok"] is True
        assert res["healthy_report"]["attempts"] == 1
    assert job[0][stage]["unguarded"] == job[1][stage]["unguarded"]


def test_eval_mode_is_set_on_engine_and_module_and_restored(job, stage):
    for r in RANKS:
        res = job[r][stage]
        assert res["modes_before"] == [True, True]
        assert res["modes_during"] == [[False, False]]  # DeepSpeedEngine.eval() alone leaves engine.training True
        assert res["modes_after"] == [True, True]
        assert res["modes_after_failure"] == [True, True]


def test_default_group_is_restored(job, stage):
    for r in RANKS:
        assert job[r][stage]["default_pg_restored"] is True
        assert job[r][stage]["default_pg_restored_after_failure"] is True


def test_stalled_rank_makes_every_rank_skip_by_the_deadline(job, stage):
    reports = [job[r][stage]["stalled_report"] for r in RANKS]
    for r, rep in zip(RANKS, reports, strict=True):
        res = job[r][stage]
        assert res["stalled_value"] == [0.0, 0.0]  # the fallback
        assert rep["ok"] is False
        assert rep["attempts"] == 1
        assert rep["failed_ranks"] == [0, 1]
        # Deadline 2 s; rank 1 would sleep 30 s and rank 0 would wait in all_reduce for 60 s.
        assert res["stalled_elapsed_s"] < GUARD_S
    assert reports[0]["reasons"] == reports[1]["reasons"]  # one agreed answer
    reason = reports[0]["reasons"][0]
    # The guard gets what is left of the 2 s deadline when it starts (1.99 s on a loaded machine).
    left = re.search(r"rank 1: DeadlineExceeded: the evaluation ran past its ([0-9.]+) s deadline", reason)
    assert left is not None and 1.0 < float(left.group(1)) <= 2.0, reason
    assert "rank 0: DeadlineExceeded" in reason and "Timed out waiting" in reason  # rank 0 was in all_reduce


def test_monitor_records_evaluation_failed(job, stage):
    for r in RANKS:
        records = job[r][stage]["failure_records"]
        assert len(records) == 1
        step, metrics = records[0]
        assert step == 3
        assert metrics["eval/evaluation_failed"] == 1.0
        assert metrics["eval/attempts"] == 1.0
        assert "deadline" in metrics["eval/failure_reason"]


def test_training_goes_on_and_parameters_stay_identical(job, stage):
    for r in RANKS:
        res = job[r][stage]
        assert res["steps_after_failure"] == 3
        assert len(res["losses_after_failure"]) == 3
        assert all(0.0 < loss < 10.0 for loss in res["losses_after_failure"])
    assert job[0][stage]["digest_after_failure"] == job[1][stage]["digest_after_failure"]
    assert job[0][stage]["digest_end"] == job[1][stage]["digest_end"]


def test_late_rank_fails_the_barrier_on_every_rank(job, stage):
    on_time, late = job[0][stage], job[1][stage]
    assert on_time["late_value"] == late["late_value"] == [0.0, 0.0]
    assert on_time["late_report"]["failed_ranks"] == [1]
    assert "ranks [1] did not reach barrier" in on_time["late_report"]["reasons"][0]
    assert late["late_report"]["failed_ranks"] == [1]
    assert "arrived after the other ranks gave up" in late["late_report"]["reasons"][0]
    # The late rank learns the answer at once, not at its own deadline: the reason above says so (it
    # arrived after the others gave up). The bound is a hang guard with room for a loaded machine's
    # store stalls (a store answer once took over 4 s); 1.0 s once asserted here was a speed target.
    assert late["late_elapsed_s"] < GUARD_S
    for r in RANKS:
        assert len(job[r][stage]["losses_after_late"]) == 1


def test_retry_after_shrink_succeeds(job, stage):
    for r in RANKS:
        res = job[r][stage]
        assert res["retry_report"] == {"ok": True, "attempts": 2, "n_reasons": 1}
        assert res["retry_batch_size"] == 2
        assert res["retry_value"] == res["unguarded_at_2"]
        assert res["unpatched_is_class_method"] is True


def test_slim_outputs_on_a_deepspeed_engine(job, stage):
    for r in RANKS:
        res = job[r][stage]
        assert res["engine_hidden_unslim"] is True  # config.output_hidden_states=True
        assert res["engine_slimmed"] == [True, True]
        assert res["engine_fields_slim"] == ["logits", "loss"]
        assert res["engine_hidden_when_asked"] == 3  # 2 layers + embeddings
        assert res["engine_hidden_unslimmed_again"] is True


# --- the example of docs/examples/ and docs/integrations.md ----------------------------------------


@pytest.fixture(scope="module")
def example():
    return run_ranks(
        "deepspeed_worker", 2, "example", "--stall-rank", "1", "--steps", "8", "--timeout", "2", timeout_s=240
    )


def test_example_skips_the_stalled_evaluation_and_trains_on(example):
    out = example.output
    assert example[0]["example_finished"] is True and example[1]["example_finished"] is True
    assert "[rank 1] stalling 30 s in the evaluation loop" in out
    assert "step 4: evaluation skipped on every rank" in out
    assert "'eval/evaluation_failed': 1.0" in out
    assert "step 8: eval loss" in out  # the next evaluation works
    assert "done: 8 steps, parameters identical across ranks: True" in out
