"""Healing a restarted rank, on 3 real gloo ranks under ncclguard's launcher with a restart
policy. Rank side: tests/workers/heal_worker.py; its plain launch (rank 1 killed once, healed) runs
under ncclguard's launcher and under torchrun with supervisors, and ``twice`` (restarts=2) has rank
1's first restart die again inside its heal: the world is rebuilt with its second restart, healed."""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(450)]  # past each launch's own hang guard

STEPS, K, BASE = 6, 3, 6  # heal_worker's: rank 1 dies at step K of the run whose steps are BASE + step
CLEAN0 = {
    "ok": True,
    "attempts": 1,
    "generation": 0,
    "rebuilds": 0,
    "commits": [[True, []]],
    "died": [],
    "early": False,
    "error": None,
}
CLEAN1 = {**CLEAN0, "generation": 1}
# What moves: parameters 65 float64 (520 B), buffers 16 float64 + one int64 (136 B), Adam's
# exp_avg and exp_avg_sq for 65 float64 each (1040 B) and 6 float32 step counts (24 B): 1,720 B;
# then the generators as the redone step found them, which the restarted rank's redo starts from:
# torch's CPU generator (5,056 B) and numpy's key (624 int64, 4,992 B).
MODEL_BYTES, MODEL_CHUNKS = 1720, 7  # the module's and the optimizer's, in 256-byte chunks
STATE_BYTES = MODEL_BYTES + 5056 + 4992
CHUNKS = -(-STATE_BYTES // 256)


@pytest.fixture(scope="module")
def job():
    # Two runs of 6 steps on 3 ranks, a SIGKILL, a restart (importing torch again: 20 s seen on
    # a loaded host), a 3 s step bound: 28-65 s here. Hang guard: 360 s.
    return run_ranks("heal_worker", 3, launcher="spawn", restarts=1, restart_on=[-9], timeout_s=360)


@pytest.fixture(scope="module")
def torchrun_job():
    # The torchrun recipe: each rank under its supervisor (python -m ncclguard.supervise), so the
    # agent never sees the SIGKILL, with a warm spare that takes the dead rank's place. The same
    # worker: 64 s here on a loaded host. Hang guard: 360 s.
    return run_ranks("heal_worker", 3, supervise=["--restarts=1", "--warm-spare"], timeout_s=360)


@pytest.fixture(scope="module")
def twice_job():
    # The job's launch, with rank 1's first restart dying inside its heal and a second restart:
    # a rebuild and a restart more (about 20 s more here). Hang guard: 360 s.
    return run_ranks("heal_worker", 3, "twice", launcher="spawn", restarts=2, restart_on=[-9], timeout_s=360)


# A drill (`make drills`): a rank restarted from its warm spare by its supervisor under torchrun and
# healed, bit-equal to the run without the fault, stays in the suite in the failure drill's short
# form (tests/recovery/test_failure_drill.py, its ``spare`` mode) and in
# tests/integrations/test_heal_frameworks_multirank.py.
@pytest.mark.drill
def test_under_torchrun_a_supervisor_restarts_the_rank_alone_from_its_warm_spare_and_it_is_healed(torchrun_job):
    assert "ncclguard.supervise: the rank (pid " in torchrun_job.output
    assert "exited -9; restart 1 of 1" in torchrun_job.output
    assert "restart 1: the warm spare (pid " in torchrun_job.output
    assert torchrun_job[1]["life"] == 1 and torchrun_job[0]["life"] == torchrun_job[2]["life"] == 0
    assert torchrun_job[1]["healed"] == [True, "receiver", 0, [1], BASE + K, STATE_BYTES, CHUNKS]
    for r in range(3):
        res = torchrun_job[r]
        assert res["final"] == [r, 3, 1]
        assert (res["equal_across_ranks"], res["equal_to_reference"], res["buffers_equal_to_own_reference"]) == (
            True,
            True,
            True,
        )
    assert torchrun_job[0]["results"][K]["commits"] == [[False, [0, 1, 2]], [True, []]]
    for r in (0, 2):  # the survivors' fault-free run first: every step at its first attempt, no rebuild
        assert torchrun_job[r]["reference_results"] == [{"step": s, **CLEAN0, "world_size": 3} for s in range(STEPS)]
    # The supervisor posted the death: the survivors' commit named rank 1 dead and settled then.
    for r in (0, 2):
        assert (torchrun_job[r]["results"][K]["died"], torchrun_job[r]["results"][K]["early"]) == ([1], True)


def test_the_launcher_restarted_the_killed_rank_once_and_alone(job):
    assert [(r.rank, r.count, r.returncode) for r in job.restarts] == [(1, 1, -9)]
    assert job.lives == {0: [0], 1: [-9, 0], 2: [0]}
    first_life = json.loads((job.out_dir / "life0-rank1.json").read_text())
    assert [s["step"] for s in first_life["results"]] == list(range(K))
    assert all(s["ok"] and s["generation"] == 0 for s in first_life["results"])


def test_the_survivors_rebuild_with_the_restarted_rank_and_heal_it(job):
    for r, role in ((0, "source"), (2, "bystander")):
        res = job[r]
        assert res["reference_results"] == [{"step": s, **CLEAN0, "world_size": 3} for s in range(STEPS)]
        steps = res["results"]
        assert steps[:K] == [{"step": s, **CLEAN0, "world_size": 3} for s in range(K)]
        # The dead rank's absence fails the commit on all three; the rebuild admits its restart.
        assert steps[K] == {
            "step": K,
            "ok": True,
            "attempts": 2,
            "generation": 1,
            "rebuilds": 1,
            "commits": [[False, [0, 1, 2]], [True, []]],
            "died": [1],  # the launcher's notice: the commit did not wait its bound for rank 1
            "early": True,
            "error": None,
            "world_size": 3,
            "healed": [True, role, 0, [1], BASE + K, STATE_BYTES, CHUNKS],
        }
        assert steps[K + 1 :] == [{"step": s, **CLEAN1, "world_size": 3} for s in range(K + 1, STEPS)]
        assert res["resume_step"] is None and res["life"] == 0


def test_the_restarted_rank_resumes_at_the_redone_step_with_the_peers_state(job):
    res = job[1]
    assert res["life"] == 1
    assert res["resume_step"] == BASE + K
    assert res["healed"] == [True, "receiver", 0, [1], BASE + K, STATE_BYTES, CHUNKS]
    assert (res["expected_bytes"], res["expected_chunks"]) == (MODEL_BYTES, MODEL_CHUNKS)  # its own state's size
    assert res["results"] == [{"step": s, **CLEAN1, "world_size": 3} for s in range(K, STEPS)]


def test_all_three_end_bit_equal_to_each_other_and_to_the_fault_free_run(job):
    for r in range(3):
        res = job[r]
        assert res["final"] == [r, 3, 1]  # rank, world size, generation
        assert res["equal_across_ranks"] is True  # parameters and Adam's state, bit for bit
        assert res["equal_to_reference"] is True  # torch.equal to the fault-free run's
        assert res["buffers_equal_to_own_reference"] is True  # BatchNorm's stats, per rank


def test_a_receiver_with_another_shape_refuses_and_nothing_moves(job):
    for r, role in ((0, "source"), (1, "receiver"), (2, "bystander")):
        refused = job[r]["refused"]
        assert (refused["ok"], refused["role"], refused["refused_ranks"], refused["bytes"]) == (False, role, [1], 0)
        assert refused["untouched"] is True
    assert job[1]["refused"]["error"] == (
        "rank 1 refused the source's state: p:weight torch.float64[8, 4] does not match this module's "
        "p:weight torch.float64[9, 4]"
    )
    assert job[0]["refused"]["error"] == "rank 1 refused the source's state"


def test_a_restart_that_dies_inside_its_heal_is_restarted_again_healed_and_every_rank_ends_bit_equal(twice_job):
    assert [(r.rank, r.count, r.returncode) for r in twice_job.restarts] == [(1, 1, -9), (1, 2, -9)]
    assert twice_job.lives == {0: [0], 1: [-9, -9, 0], 2: [0]}
    for r, role in ((0, "source"), (2, "bystander")):
        assert twice_job[r]["reference_results"] == [{"step": s, **CLEAN0, "world_size": 3} for s in range(STEPS)]
        steps = twice_job[r]["results"]
        assert steps[:K] == [{"step": s, **CLEAN0, "world_size": 3} for s in range(K)]
        # The heal into generation 1 failed (its receiver died): no redo there; the next commit
        # failed on it and the world was rebuilt with the second restart, healed and redone.
        assert steps[K] == {
            "step": K,
            "ok": True,
            "attempts": 3,
            "generation": 2,
            "rebuilds": 2,
            "commits": [[False, [0, 1, 2]], [False, [0, 1, 2]], [True, []]],
            "died": [1, 1],
            "early": True,
            "error": None,
            "world_size": 3,
            "healed": [True, role, 0, [1], BASE + K, STATE_BYTES, CHUNKS],
        }
        assert steps[K + 1 :] == [{"step": s, **CLEAN0, "generation": 2, "world_size": 3} for s in range(K + 1, STEPS)]
    assert twice_job.output.count("the world is rebuilt again") == 2  # the source's and the bystander's
    # gloo may leave a survivor waiting on a live one when the receiver dies; the receiver's death
    # notice ends that wait, not heal_timeout (150 s here): the step took 3-9 s with both restarts.
    for r in (0, 2):
        assert twice_job[r]["elapsed"][K] < 100.0, twice_job[r]["elapsed"]
    res = twice_job[1]
    assert (res["life"], res["resume_step"]) == (2, BASE + K)
    assert res["healed"] == [True, "receiver", 0, [1], BASE + K, STATE_BYTES, CHUNKS]
    for r in range(3):
        res = twice_job[r]
        assert res["final"] == [r, 3, 2]
        assert (res["equal_across_ranks"], res["equal_to_reference"], res["buffers_equal_to_own_reference"]) == (
            True,
            True,
            True,
        )
