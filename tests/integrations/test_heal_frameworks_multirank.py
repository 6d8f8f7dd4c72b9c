"""A killed rank heals inside the frameworks, with their defaults: 3 gloo ranks under torchrun, each
under its supervisor with a warm spare.

Launches (tests/workers/heal_frameworks_worker.py), each 3 ranks under torchrun, supervised with
``--restarts=1 --warm-spare``: 6 steps; at step 3 rank 1 SIGKILLs itself, the survivors' step fails, the
warm spare joins their rebuild and receives a live peer's state, every rank redoes step 3 and the ranks end
with the same parameters and optimizer state:
``accelerate``: a hand-written Accelerate loop under ``recovering_step(heal=True)``; the survivors first run
    the same loop with no fault and no ncclguard, and end bit-equal to it.
``hf``: a tiny BERT in the HF Trainer, with HF's defaults, under ``guard_trainer(recover=True, heal=True)``;
    the losses and the scheduler's learning rate are the same on every rank.
``lightning``: a Lightning fit (DDP on gloo) under ``NcclGuardCallback(recover=True, heal=True)``; each
    training_step gets its step's batch, also after the join; the survivors first run the same fit with
    no fault and no ncclguard, and end bit-equal to it.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(480)]  # past each launch's own hang guard

STEPS, K = 6, 3
SUPERVISE = ["--restarts=1", "--warm-spare"]


def killed_and_healed(job, final_generation: int = 1) -> None:
    """What every framework's run must show: the kill, the restart from the spare, the heal, the
    redo of step K on every rank, and every rank ending on the same parameters."""
    assert "exited -9; restart 1 of 1" in job.output and "restart 1: the warm spare (pid " in job.output
    for r in range(3):
        assert job[r]["world"] == [r, 3, final_generation]
        assert job[r]["params_equal_across_ranks"] is True
    assert job[1]["life"] == 1 and job[0]["life"] == job[2]["life"] == 0


@pytest.fixture(scope="module")
def accelerate_job():
    # 6 steps, a SIGKILL, a restart from a warm spare, a 3 s step bound: about 40 s here.
    return run_ranks("heal_frameworks_worker", 3, "accelerate", supervise=SUPERVISE, timeout_s=300)


def test_a_killed_rank_heals_inside_an_accelerate_loop(accelerate_job):
    killed_and_healed(accelerate_job)
    for r in (0, 2):
        res = accelerate_job[r]
        # Step K failed on the survivors (the commit settled on the death notice), was redone in
        # generation 1 with the restarted rank healed, and the rest ran there.
        assert res["results"][K] == [K, True, 2, 1, True]
        assert [s[:4] for s in res["results"]] == [[s, True, 1, 0] for s in range(K)] + [[K, True, 2, 1]] + [
            [s, True, 1, 1] for s in range(K + 1, STEPS)
        ]
        assert res["recoveries"] == [[K, 2, 1, [1]]]
        assert res["healed"] is None and res["resume_step"] is None
        assert res["optimizer_equal_across_ranks"] is True
        # Bit for bit the loop with no fault (Accelerate's DDP, defaults: every rank's new wrapper
        # took the buckets the survivors' wrappers had rebuilt after their first step).
        assert res["params_equal_to_reference"] is True
    back = accelerate_job[1]
    assert back["resume_step"] == K and back["healed"] == [True, "receiver", K]
    assert [s[:4] for s in back["results"]] == [[s, True, 1, 1] for s in range(K, STEPS)]
    assert back["optimizer_equal_across_ranks"] is True


@pytest.fixture(scope="module")
def hf_job():
    # The warm spare imports transformers too. 6 steps of a tiny BERT, a SIGKILL: about 60 s here.
    supervise = [*SUPERVISE, "--preload=transformers"]
    return run_ranks("heal_frameworks_worker", 3, "hf", supervise=supervise, timeout_s=400)


# A drill (`make drills`): a killed rank of the Trainer on DDP healed from a live peer stays in the
# suite, checked bit-equal to a run without the fault step by step, in
# tests/integrations/test_hf_bitequal_multirank.py (``ddp``); the warm spare, in this module's other two.
@pytest.mark.drill
def test_a_killed_rank_heals_inside_the_hf_trainer_with_its_defaults(hf_job):
    killed_and_healed(hf_job)
    for r in range(3):
        res = hf_job[r]
        assert res["global_step"] == STEPS
        assert res["optimizer_equal_across_ranks"] is True
        # One (gathered) loss per step, the redone step K once, as a run without a fault; the
        # restarted rank's history up to K came with the Trainer's state in the heal.
        assert [s for s, _ in res["losses"]] == list(range(1, STEPS + 1))
        assert res["losses"] == hf_job[0]["losses"]
    assert hf_job[0]["lr"] == hf_job[1]["lr"] == hf_job[2]["lr"]  # the scheduler was healed too
    for r in (0, 2):
        assert hf_job[r]["recoveries"] == [[K, 2, 1, [1]]]
        (logged,) = hf_job[r]["logged"]
        assert logged["ncclguard_recover_generation"] == 1 and logged["ncclguard_recover_attempts"] == 2
    assert hf_job[1]["recoveries"] == []  # its first step was the others' redo


@pytest.fixture(scope="module")
def lightning_job():
    # The warm spare imports Lightning too. 6 steps, a SIGKILL: about 60 s here.
    supervise = [*SUPERVISE, "--preload=lightning.pytorch"]
    return run_ranks("heal_frameworks_worker", 3, "lightning", supervise=supervise, timeout_s=400)


def test_a_killed_rank_heals_inside_a_lightning_fit_with_its_defaults(lightning_job):
    killed_and_healed(lightning_job)
    for r in range(3):
        res = lightning_job[r]
        assert res["global_step"] == STEPS
        assert res["optimizer_equal_across_ranks"] is True
        assert res["lr"] == pytest.approx(0.01 * 0.9**STEPS, rel=1e-12)  # the scheduler stepped once a step
        # Each training_step had its step's batch: after the join too, where the fit loop is entered
        # again and the loader starts its epoch again (its batches up to step K drawn and dropped).
        assert all(ok for _, ok in res["batches"])
    for r in (0, 2):
        assert lightning_job[r]["recoveries"] == [[K, 2, 1, [1]]]
        assert [s for s, _ in lightning_job[r]["batches"]] == list(range(K + 1)) + list(range(K, STEPS))
    assert lightning_job[1]["recoveries"] == []
    # Bit for bit the fit with no fault (DDP's default find_unused_parameters=False: every rank's new
    # wrapper took the buckets the old ones had rebuilt after their first step).
    assert lightning_job[0]["params_equal_to_reference"] is True
    assert lightning_job[2]["params_equal_to_reference"] is True
    assert [s for s, _ in lightning_job[1]["batches"]] == list(range(K, STEPS))
