"""Sharded state survives a lost rank: FSDP2 ranks killed and restored from the in-memory snapshots
their buddies hold, bit-equal to a fault-free run, on real gloo ranks under ncclguard's launcher
with a restart policy. The model holds 2.2M float32 parameters (four Linear layers 1024 wide, with
dropout), Adam and an LR schedule: a size where a bound with fixed slack no longer hides a bug.

Launches (tests/workers/sharded_heal_worker.py), spawn, one restart for a rank killed by SIGKILL:
``kill`` 3 ranks, a snapshot every 2 steps, two kept: a fault-free FSDP2 run of 6 steps (the reference), then
    the same run, numbered on from 6, in which rank 1 SIGKILLs itself inside its take of step 10; that take
    commits nowhere, step 10 fails, the survivors roll back to the committed snapshot of step 8, the restarted
    rank gets its shards from its buddy (rank 2), every rank ends bit-equal to the reference; then a replica
    that does not fit rank 1's module is refused on every rank at its manifest, and a damaged replica makes
    every rank fall back to the step before, bit-equal to the reference's state there.
``host`` 4 ranks on two simulated hosts of 2 (torchrun's per-node variables set by the worker), a snapshot
    every step, the watchdog on (``NCCLGUARD_AUTO``) with the node tier on, the same two runs: ranks 2 and 3,
    the whole second host (and its node's store), SIGKILL themselves at step 9; restarted, they get their
    shards from ranks 0 and 1, every rank redoes step 9 with no rollback and ends bit-equal to the
    reference, its rounds through the tier. A drill (`make drills`; its test says what stays in the suite).
``twice`` 3 ranks, one host, a snapshot every step, two restarts: rank 1 SIGKILLs itself at step 9; its first
    restart SIGKILLs itself inside its restore, its replica received; the survivors' restore fails at its
    death notice, the world is rebuilt again, the second restart is restored, every rank redoes step 9 at
    its third attempt and ends bit-equal to the reference.
``ring`` 4 ranks, one host, a snapshot every 2 steps: the ``kill`` run with rank 3 dying inside its take of
    step 10. Rank 3's buddies fail at once; rank 1, no buddy of it, waits in the take's agreement for a
    rank that never comes, up to twice the take's deadline, until the launcher's death notice ends its
    wait; every rank ends bit-equal to the reference. Its job is a user's: a BERT classifier of
    2.05M parameters from ``transformers.BertConfig`` (default dropout), each encoder layer sharded, AdamW,
    a warm-up schedule, bf16 autocast, clipping at norm 1.0 and shuffled data (``DistributedSampler``).
"""

from __future__ import annotations

import re

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(450)]  # past each launch's own hang guard

STEPS, K, BASE = 6, 3, 6  # the worker's: the faulty run's steps are BASE + step, the host's kill at step K
KILL_TAKE = 4  # the worker's: kill, rank 1 dies in its take of step BASE + 4


@pytest.fixture(scope="module")
def kill_job():
    # Two runs of 6 steps on 3 ranks, a SIGKILL, a restart that imports torch again, a rollback.
    return run_ranks("sharded_heal_worker", 3, "kill", launcher="spawn", restarts=1, restart_on=[-9], timeout_s=360)


@pytest.fixture(scope="module")
def ring_job():
    # Two runs of 6 steps on 4 ranks and a restart: 10-20 s here (70 s when rank 1 waited out the take).
    return run_ranks("sharded_heal_worker", 4, "ring", launcher="spawn", restarts=1, restart_on=[-9], timeout_s=360)


@pytest.fixture(scope="module")
def twice_job():
    # Two runs of 6 steps on 3 ranks, two restarts of rank 1 (each imports torch again), two rebuilds.
    return run_ranks("sharded_heal_worker", 3, "twice", launcher="spawn", restarts=2, restart_on=[-9], timeout_s=360)


@pytest.fixture(scope="module")
def host_job():
    # The watchdog as NCCLGUARD_AUTO starts it, the node tier on: each host's LOCAL_RANK 0 serves its
    # node's store, which dies with the second host and is served again by its restart.
    tier = {"NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_NODE_TIER": "on", "NCCLGUARD_WATCHDOG_HEARTBEAT_S": "1"}
    return run_ranks(
        "sharded_heal_worker", 4, "host", launcher="spawn", restarts=1, restart_on=[-9], timeout_s=360, env=tier
    )


def clean(step: int, generation: int) -> dict:
    return {"step": step, "ok": True, "attempts": 1, "generation": generation, "rewound_to": None, "error": None}


PHASES = ["agree", "apply", "check", "fetch"]  # Restored.timings


def restore_parts(nbytes: int) -> dict:
    return {"names": PHASES, "within": True, "bytes": nbytes}


def test_a_rank_killed_in_a_take_leaves_the_committed_snapshots_and_every_rank_ends_bit_equal(kill_job):
    assert [(r.rank, r.count, r.returncode) for r in kill_job.restarts] == [(1, 1, -9)]
    # Takes at BASE, BASE+2, BASE+4: the one of BASE+4 never committed, so the newest everyone holds is BASE+2.
    back, failed = BASE + KILL_TAKE - 2, BASE + KILL_TAKE
    sent = kill_job[1]["restore_parts"]["bytes"]  # rank 1's replica, as rank 2 sent it and rank 1 received it
    assert sent > 8 << 20  # its shards of 2.2M parameters with Adam's moments: far over a fresh model's bound
    assert kill_job[1]["restore_parts"] == restore_parts(sent)
    for r, role in ((0, "survivor"), (2, "holder")):  # rank 1's replica is on rank 2 (one host: the next rank)
        res = kill_job[r]
        assert res["reference_results"] == [clean(s, 0) for s in range(STEPS)]
        steps = res["results"]
        assert steps[:KILL_TAKE] == [clean(BASE + s, 0) for s in range(KILL_TAKE)]
        assert steps[KILL_TAKE] == {
            "step": failed,
            "ok": False,
            "attempts": 1,
            "generation": 1,
            "rewound_to": back,  # every rank went back to the snapshot, the loop with it
            "error": None,
            "restored": {"ok": True, "role": role, "step": back, "rolled_back": True, "holders": {"1": 2}},
            "restore_parts": restore_parts(sent if role == "holder" else 0),
            # where the rolled-back step's seconds went (StepResult.timings)
            "timings": ["attempt", "commit", "heal", "rebuild", "rewrap"],
        }
        assert steps[KILL_TAKE + 1 :] == [clean(s, 1) for s in range(back, BASE + STEPS)]
    res = kill_job[1]
    assert (res["life"], res["resume_step"]) == (1, back)
    assert res["restored"] == {"ok": True, "role": "receiver", "step": back, "rolled_back": False, "holders": {"1": 2}}
    assert res["results"] == [clean(s, 1) for s in range(back, BASE + STEPS)]
    for r in range(3):
        assert kill_job[r]["final"] == [r, 3, 1]
        assert kill_job[r]["every"] == 2
        if r != 1:  # the reference run: a snapshot at steps 0, 2 and 4, and the seconds the loop paid for them
            assert kill_job[r]["reference_takes"] == [3, True, 0]  # and no take lost
        assert kill_job[r]["equal_to_reference"] is True  # full parameters and Adam's state, bit for bit


def test_a_snapshot_that_does_not_fit_the_module_is_refused_on_every_rank_and_nothing_is_copied(kill_job):
    # After the run every rank keeps two snapshots: each is refused at its manifest. The take after the
    # restore is forced (the redo of step 8 takes none: step 9), then every 2 steps: 9 and 11.
    older, newest = kill_job[0]["held"]
    assert (older, newest) == (BASE + KILL_TAKE - 1, BASE + STEPS - 1)
    for r, role in ((0, "survivor"), (1, "receiver"), (2, "holder")):
        refused = kill_job[r]["refused"]
        assert (refused["ok"], refused["role"], refused["refused_ranks"]) == (False, role, [1])
        assert refused["error"].startswith(f"rank(s) 1 refused the snapshot of step {older}")
        assert refused["error"].endswith(f"(step(s) [{older}, {newest}] refused))")
    # rank 1's shard of the first layer (1024 rows over 3 ranks), against the other module's whole weight
    assert "p:0.weight is float32[342, 64] in the replica and float32[9, 64] here" in kill_job[1]["refused"]["error"]
    assert kill_job[1]["untouched"] is True


def test_a_damaged_replica_makes_every_rank_fall_back_to_the_step_before(kill_job):
    older, newest = kill_job[0]["held"]
    for r, role, rolled in ((0, "survivor", True), (1, "receiver", False), (2, "holder", True)):
        if r != 1:
            assert kill_job[r]["held"] == [older, newest]
        damaged = kill_job[r]["damaged"]
        assert damaged == {
            "ok": True,
            "role": role,
            "step": older,
            "rolled_back": rolled,
            "holders": {"1": 2},
            "error": None,
        }
        assert kill_job[r]["equal_to_reference_at_back"] is True  # the state of that step, bit for bit
        # The same replica holding NaN with a digest that matches: refused by its numbers, the same fallback.
        poisoned = kill_job[r]["poisoned"]
        assert {k: v for k, v in poisoned.items() if k != "held"} == {**damaged, "step": poisoned["held"][0]}
        assert kill_job[r]["equal_to_reference_after_poison"] is True and kill_job[r]["finite"] is True
    assert "rank 2's replica of step" in kill_job.output and "holds NaN or Inf in" in kill_job.output


# A drill (`make drills`): a whole host lost and restored from the replicas the other host holds stays in the suite
# through the Trainer on ZeRO-3 (tests/integrations/test_hf_bitequal_multirank.py, the ``host`` launch: two
# simulated hosts of 2, both of the second killed at once), on the same placement (unit-tested in
# tests/recovery/test_snapshots.py::test_two_hosts_put_each_replica_on_the_other_host_at_the_same_place); an FSDP2
# rank restored from its buddy's replica, in this module's kill launch.
@pytest.mark.drill
def test_a_whole_host_lost_is_restored_from_the_replicas_on_the_other_host(host_job):
    assert sorted((r.rank, r.count, r.returncode) for r in host_job.restarts) == [(2, 1, -9), (3, 1, -9)]
    holders = {"2": 0, "3": 1}  # host 0 holds host 1's replicas: rank 2's on rank 0, rank 3's on rank 1
    for r in (2, 3):
        got = host_job[r]["restore_parts"]["bytes"]
        assert got > 0 and host_job[r]["restore_parts"] == restore_parts(got)
    for r in (0, 1):
        res = host_job[r]
        assert res["reference_results"] == [clean(s, 0) for s in range(STEPS)]
        # One a step, the seconds the loop paid for them, and no take lost.
        assert res["reference_takes"] == [STEPS, True, 0]
        assert res["results"][:K] == [clean(BASE + s, 0) for s in range(K)]
        # A snapshot every step: the survivors' live state is the snapshot of step BASE+K; they redo it.
        assert res["results"][K] == {
            "step": BASE + K,
            "ok": True,
            "attempts": 2,
            "generation": 1,
            "rewound_to": None,
            "error": None,
            "restored": {"ok": True, "role": "holder", "step": BASE + K, "rolled_back": False, "holders": holders},
            # each holder sent its source's replica: the bytes its receiver got
            "restore_parts": restore_parts(host_job[r + 2]["restore_parts"]["bytes"]),
        }
        assert res["results"][K + 1 :] == [clean(s, 1) for s in range(BASE + K + 1, BASE + STEPS)]
    for r in (2, 3):
        res = host_job[r]
        assert (res["life"], res["resume_step"]) == (1, BASE + K)
        assert res["restored"] == {
            "ok": True,
            "role": "receiver",
            "step": BASE + K,
            "rolled_back": False,
            "holders": holders,
        }
        assert res["results"][0]["step"] == BASE + K and res["results"][0]["ok"] is True
        assert res["results"][1:] == [clean(s, 1) for s in range(BASE + K + 1, BASE + STEPS)]
    for r in range(4):
        assert host_job[r]["final"] == [r, 4, 1]
        assert host_job[r]["every"] == 1
        assert host_job[r]["equal_to_reference"] is True
    # The takes' agreements, the commits and the meeting went through the node tier: met in their node's
    # store (carried or read there) once its watchdog linked, by itself before (store/tier_round.py). The
    # restarted ranks' 3 steps come before their new watchdogs link: by themselves.
    # A line a keeper and world: ranks 0 and 1 three (the reference's keeper, the run's in worlds 0 and 1),
    # ranks 2 and 3 two in their first life, one in their second.
    assert host_job.output.count("snapshots: the takes' agreements through the node tier, 2 nodes") == 12
    for r in range(4):
        tier = host_job[r]["tier"]
        # Ranks 0 and 1: the reference's 12 rounds (a take and a commit a step), 14 of the run and its rebuild's
        # meeting. Ranks 2 and 3, restarted:
        # the takes and commits of 3 steps (their first life's count went with it).
        assert sum(tier.values()) == (26 if r < 2 else 2 * K), (r, tier)
        assert tier["fell_back"] == 0 and (tier["carried"] + tier["waited"] >= 1 or r >= 2), (r, tier)
    # The survivors' waits read the death notices through their node's store (store/deaths.py, relay_deaths):
    # its window's key is there, in the store rank 0's process serves.
    assert host_job[0]["relayed"] is True


def test_a_rank_dead_in_a_take_ends_every_survivors_wait_at_its_death_notice_not_at_the_deadline(ring_job):
    assert [(r.rank, r.count, r.returncode) for r in ring_job.restarts] == [(3, 1, -9)]
    failed = {
        r: re.search(rf"\[rank {r}\] RecoveringStep: step 10's snapshot failed: (.*)", ring_job.output)
        for r in range(3)
    }
    assert all(failed.values()), ring_job.output[-3000:]
    # rank 1 is no buddy of rank 3: its swap went through, and its launcher's notice ended its wait in
    # the take's agreement, nothing else. The ranks named with 3 are those whose word had not reached the
    # store when the notice ended the wait: usually none, once in a fresh-clone CI run "[1, 2, 3]".
    ended = r"the take's agreement: rank\(s\) \[(?:\d, )*3\] did not come \(rank 3: its process died \(pid"
    assert re.search(ended, failed[1].group(1)), failed[1].group(1)
    for r in range(3):  # nobody waited out the take's deadline (gloo: a wait that timed out closes its pair)
        assert "deadline passed" not in failed[r].group(1) and "Application timeout" not in failed[r].group(1)
    back = BASE + KILL_TAKE - 2  # the take of step 10 committed nowhere: back to step 8's
    for r in range(4):
        res = ring_job[r]
        assert res["final"] == [r, 4, 1]
        assert res["equal_to_reference"] is True  # full parameters and Adam's state, bit for bit
        if r != 3:  # the survivors' fault-free run first: no rebuild, a snapshot at steps 0, 2 and 4, none lost
            assert res["reference_results"] == [clean(s, 0) for s in range(STEPS)]
            assert res["reference_takes"] == [3, True, 0]
            assert [(x["step"], x["ok"], x["rewound_to"]) for x in res["results"] if not x["ok"]] == [(10, False, back)]
    assert (ring_job[3]["life"], ring_job[3]["resume_step"]) == (1, back)


def test_a_restart_that_dies_inside_its_restore_is_restarted_again_restored_and_every_rank_ends_bit_equal(twice_job):
    """The first restart of rank 1 dies with its replica received, before it answers: the survivors'
    restore fails at its death notice (it used to end the step with a falsy result), is no redo on
    that world, and the next commit rebuilds it with the second restart, which gets its shards from
    rank 2; step 9 is redone at its third attempt, in generation 2, with no rollback."""
    assert [(r.rank, r.count, r.returncode) for r in twice_job.restarts] == [(1, 1, -9), (1, 2, -9)]
    got = twice_job[1]["restore_parts"]["bytes"]
    assert got > 8 << 20 and twice_job[1]["restore_parts"] == restore_parts(got)
    for r, role in ((0, "survivor"), (2, "holder")):
        res = twice_job[r]
        assert res["reference_results"] == [clean(s, 0) for s in range(STEPS)]
        assert res["reference_takes"] == [STEPS, True, 0]  # a snapshot every step, none lost
        assert res["results"][:K] == [clean(BASE + s, 0) for s in range(K)]
        assert res["results"][K] == {
            "step": BASE + K,
            "ok": True,
            "attempts": 3,
            "generation": 2,
            "rewound_to": None,
            "error": None,
            "restored": {"ok": True, "role": role, "step": BASE + K, "rolled_back": False, "holders": {"1": 2}},
            "restore_parts": restore_parts(got if role == "holder" else 0),
        }
        assert res["results"][K + 1 :] == [clean(s, 2) for s in range(BASE + K + 1, BASE + STEPS)]
    res = twice_job[1]
    assert (res["life"], res["resume_step"], res["died_in_restore"]) == (2, BASE + K, str(BASE + K))
    assert res["restored"] == {
        "ok": True,
        "role": "receiver",
        "step": BASE + K,
        "rolled_back": False,
        "holders": {"1": 2},
    }
    assert res["results"][0]["step"] == BASE + K and res["results"][0]["ok"] is True
    assert res["results"][1:] == [clean(s, 2) for s in range(BASE + K + 1, BASE + STEPS)]
    for r in range(3):
        assert twice_job[r]["final"] == [r, 3, 2]
        assert twice_job[r]["equal_to_reference"] is True  # full parameters and Adam's state, bit for bit
