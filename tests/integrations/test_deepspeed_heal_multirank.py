"""A DeepSpeed ZeRO-3 rank killed and restored from its buddy's in-memory snapshot, bit-equal to a
fault-free run, on real gloo ranks under ncclguard's launcher; a model of 2.1M parameters with
dropout. Rank side: tests/workers/deepspeed_heal_worker.py:

(no scenario, ``kill``) 3 ranks: rank 1 killed at step K and restored from its buddy's replica.
``host`` 4 ranks on two simulated hosts of 2: both ranks of the second killed at once and restored
    from the replicas the first holds.
``refused`` 3 ranks: as ``kill``, every replica of rank 1 damaged by its buddy first: every rank exits
    75 at once and no checkpoint holds the restarted rank's fresh partitions.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(500)]  # past each launch's own hang guard

STEPS, K, BASE = 6, 3, 6


@pytest.fixture(scope="module")
def job():
    # Two runs of 6 ZeRO-3 steps on 3 ranks, a SIGKILL, a restart that imports torch and DeepSpeed
    # again, a rollback: 40-90 s here. Hang guard: 420 s.
    return run_ranks("deepspeed_heal_worker", 3, launcher="spawn", restarts=1, restart_on=[-9], timeout_s=420)


@pytest.fixture(scope="module")
def host_job():
    # The same two runs on 4 ranks, two simulated hosts of 2 (GROUP_RANK set by the worker): ranks 2
    # and 3 SIGKILLed at once and both restarted cold: 25-60 s on a loaded 2-core machine. Hang guard: 240 s
    # (under pytest-timeout's 300 s).
    return run_ranks("deepspeed_heal_worker", 4, "host", launcher="spawn", restarts=1, restart_on=[-9], timeout_s=240)


def _survivor_ran(res: dict, back: int, after: list[dict]) -> None:
    """A survivor's steps: the reference's all applied in generation 0, then the faulty run's K steps, its
    step BASE+K rolled back to ``back`` in generation 1, and the steps ``after`` it."""
    assert res["reference_results"] == [
        {"step": s, "applied": True, "rewound_to": None, "generation": 0} for s in range(STEPS)
    ]
    assert res["reference_takes"] == [STEPS // 2, 0]  # a snapshot at steps 0, 2 and 4, none lost
    assert res["results"][:K] == [
        {"step": BASE + s, "applied": True, "rewound_to": None, "generation": 0} for s in range(K)
    ]
    assert res["results"][K] == {"step": BASE + K, "applied": False, "rewound_to": back, "generation": 1}
    assert res["results"][K + 1 :] == after


def test_a_killed_zero3_rank_is_restored_from_its_buddy_and_every_rank_ends_bit_equal(job):
    assert [(r.rank, r.count, r.returncode) for r in job.restarts] == [(1, 1, -9)]
    back = BASE + K - 1  # a snapshot every 2 steps from BASE: the newest at the kill is of step BASE+K-1
    after = [{"step": s, "applied": True, "rewound_to": None, "generation": 1} for s in range(back, BASE + STEPS)]
    for r in (0, 2):
        res = job[r]
        _survivor_ran(res, back, after)
    phases = ["agree", "apply", "check", "fetch"]  # Restored.timings
    for r, role in ((0, "survivor"), (2, "holder")):  # rank 1's replica is on rank 2 (one host: the next rank)
        assert job[r]["rewind"] == {
            "timings": ["attempt", "commit", "heal", "rebuild", "rewrap"],  # EngineStepResult.timings
            "role": role,
            "restore": phases,
        }
        assert job[r]["healed"] is None
    assert (job[1]["life"], job[1]["resume_step"]) == (1, back)
    healed = job[1]["healed"]
    assert (healed["role"], healed["step"], healed["restore"]) == ("receiver", back, phases) and healed["bytes"] > 0
    assert job[1]["results"] == after
    reference = job[0]["reference"]
    for r in range(3):
        assert job[r]["generation"] == 1
        assert job[r]["global_steps"] == STEPS  # DeepSpeed's own count, restored with the partitions
        assert job[r]["digest"] == reference  # the full (gathered) parameters, bit for bit


# A drill (`make drills`): a whole ZeRO-3 host lost and restored from the other host's replicas stays in
# the suite through the Trainer (tests/integrations/test_hf_bitequal_multirank.py, the ``host`` launch),
# on the same placement and restore code.
@pytest.mark.drill
def test_a_whole_host_of_zero3_ranks_lost_is_restored_from_the_replicas_on_the_other_host(host_job):
    assert sorted((r.rank, r.count, r.returncode) for r in host_job.restarts) == [(2, 1, -9), (3, 1, -9)]
    holders = {"2": 0, "3": 1}  # host 0 holds host 1's replicas: rank 2's on rank 0, rank 3's on rank 1
    back = BASE + K - 1  # a snapshot every 2 steps from BASE: the newest at the kill is of step BASE+K-1
    after = [{"step": s, "applied": True, "rewound_to": None, "generation": 1} for s in range(back, BASE + STEPS)]
    phases = ["agree", "apply", "check", "fetch"]  # Restored.timings
    for r in (0, 1):
        res = host_job[r]
        assert res["life"] == 0
        _survivor_ran(res, back, after)
        assert res["rewind"] == {
            "timings": ["attempt", "commit", "heal", "rebuild", "rewrap"],  # EngineStepResult.timings
            "role": "holder",  # each survivor sent the replica it held for the other host's rank
            "restore": phases,
        }
        assert res["holders"] == holders
        assert res["healed"] is None
    for r in (2, 3):
        res = host_job[r]
        assert (res["life"], res["resume_step"]) == (1, back)
        healed = res["healed"]
        assert (healed["role"], healed["step"], healed["restore"]) == ("receiver", back, phases)
        assert healed["bytes"] > 0
        assert res["holders"] == holders
        assert res["results"] == after
    reference = host_job[0]["reference"]
    for r in range(4):
        assert host_job[r]["world"] == [r, 4]
        assert host_job[r]["generation"] == 1  # one rebuild: both restarted ranks joined it together
        assert host_job[r]["global_steps"] == STEPS  # DeepSpeed's own count, restored with the partitions
        assert host_job[r]["digest"] == reference  # the full (gathered) parameters, bit for bit


@pytest.fixture(scope="module")
def refused_job():
    # One run of 3 ZeRO-3 steps on 3 ranks, a SIGKILL, a restart that imports torch and DeepSpeed
    # again, every snapshot refused, every rank exiting 75 at once: 20-40 s here. Hang guard: 240 s
    # (the survivors' rebuild would wait out its 90 s for a rank that is gone).
    return run_ranks(
        "deepspeed_heal_worker",
        3,
        "refused",
        launcher="spawn",
        restarts=1,
        restart_on=[-9],
        timeout_s=240,
        expect_rc={0: 75, 1: 75, 2: 75},
    )


def test_a_restarted_rank_whose_snapshots_are_all_refused_ends_every_rank_with_75_and_no_checkpoint(refused_job):
    """Issue 59: after every snapshot was refused, the restarted rank holds its fresh engine's
    partitions; a checkpoint of that world would save them as the run's and point ``latest`` at it.
    Every rank exits 75 at once, writes nothing, and names where the launcher's restart goes."""
    out = refused_job.output
    assert refused_job[2]["damaged"] == [BASE + 2], refused_job[2]  # the buddy held rank 1's replicas and damaged each
    assert "rank 2's snapshot of step" in out and "arrived damaged" in out
    assert out.count("CommittedEngineStep: the restarted rank(s) could not be restored") == 3, out[-6000:]
    assert out.count("No checkpoint is written") == 3
    assert out.count("holds no DeepSpeed checkpoint ('latest' names none)") == 3
    assert "did not reach rebuild_world" not in out  # no survivor waited for the rank that left
    assert "saved in" not in out and "Traceback" not in out
    written = sorted(p.name for p in refused_job.out_dir.iterdir())
    assert not [n for n in written if n.startswith("global_step") or n == "latest"], written
