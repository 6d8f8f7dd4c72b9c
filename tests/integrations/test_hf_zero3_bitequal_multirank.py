"""Issue 44: the HF Trainer on DeepSpeed ZeRO-3 as a new user sets it up, a realistic BERT (4.4 M
parameters, default dropout), a ZeRO-3 config of ``"auto"`` values, warm-up, a shuffled dataset,
``guard_trainer(recover=True, heal=True)`` and nothing else: a rank SIGKILLed and healed ends with
every rank's full parameters bit-equal to a run without the fault.

Launch (tests/workers/hf_zero3_bitequal_worker.py, which says more), under torchrun:
``kill`` 3 ranks, each under its supervisor (``--restarts=1``): the reference (8 steps, no fault, no
    ncclguard), then the guarded run where launch rank 2 SIGKILLs itself as step 5 begins; restarted,
    its ``"auto"`` ``train_batch_size`` is made for the joined world, it takes its partitions from its
    buddy, and every rank goes back to the newest snapshot; per step, every rank's batch, generator
    state, loss and learning rate are those of the reference."""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(400)]

STEPS, KILL, VICTIM = 8, 5, 2


@pytest.fixture(scope="module")
def kill_job():
    # Two ZeRO-3 runs of 8 steps on 3 ranks and a cold restart that imports torch, transformers and
    # DeepSpeed again: 55-65 s on a quiet 2-core machine. Hang guard: 360 s.
    return run_ranks("hf_zero3_bitequal_worker", 3, "kill", supervise=["--restarts=1"], timeout_s=360)


def _last_per_step(trace: list[list]) -> dict[int, list]:
    """The micro-batch record of each step's last attempt (a rolled-back step is computed twice)."""
    return {entry[1]: entry[2:] for entry in trace if entry[0] == "micro"}


def test_a_killed_rank_of_a_realistic_zero3_trainer_heals_bit_equal(kill_job):
    assert "exited -9; restart 1 of 1" in kill_job.output
    assert "every rank is back at step" in kill_job.output
    for r in range(3):
        res = kill_job[r]
        assert res["life"] == (1 if r == VICTIM else 0)
        assert res["world"] == [r, 3, 1]  # one rebuild: the join of the restarted rank
        assert res["global_step"] == res["global_steps"] == STEPS  # the Trainer's count and DeepSpeed's
        assert res["digest"] == kill_job[0]["reference"]  # the full gathered parameters, bit for bit
        assert res["sum"] == kill_job[0]["reference_sum"]
        # Every step each rank computed, as the reference computed it: the batch (the shuffled order
        # after the resume's skip), the generator (dropout), the loss and the learning rate (warm-up).
        reference, healed = _last_per_step(res["reference_trace"]), _last_per_step(res["trace"])
        assert sorted(reference) == list(range(STEPS))
        first = min(healed) if r == VICTIM else 0  # the restarted process starts at the snapshot's step
        assert sorted(healed) == list(range(first, STEPS))
        if r == VICTIM:
            assert first < KILL
        assert {s: reference[s] for s in healed} == healed
    for r in range(3):
        if r != VICTIM:
            (back,) = kill_job[r]["recoveries"]  # [step, attempts, generation, healed ranks]
            assert back[0] == min(_last_per_step(kill_job[VICTIM]["trace"]))
            assert back[2:] == [1, [VICTIM]]
