"""The NCCL path on CPU: recovery under the NCCL stand-in (``NCCLGUARD_NCCL_STAND_IN=1``,
``ncclguard/backend_rules.py``), where a gloo world obeys NCCL's rules: ncclguard's own transfers
refuse a CPU tensor on the device group, nothing releases a survivor by its sockets, and a release
or the step bound aborts the groups (the stand-in cutting its sockets first, as NCCL's abort fails
an op in flight). The same scenarios as on gloo, with the stand-in's env added and nothing else:

``stuck`` tests/workers/defaults_worker.py ``loop``, 3 ranks under torchrun and their supervisors,
    every default, a 2.05M-parameter BERT under RecoveringStep's DDP: launch rank 2 asleep for good at
    step 12. The waiting ranks agree it is stuck, its supervisor ends it, the restarted process is
    healed over the side gloo group, and the three end bit-equal on the full world. (Here the
    survivors' DDP op fails when the ended rank's sockets close, as gloo's do, before any release
    looks: a release, if one comes, must be an abort.)
``held`` tests/workers/held_worker.py: rank 2 SIGKILLed at step 4 while rank 0 waits on live rank 1
    in a pair group's all_reduce; the survivors' release aborts (never a plain cut), rank 0's op
    fails, the step is redone on the full world and the three end equal.
``stall`` tests/workers/recovering_worker.py ``stall`` then ``fsdp2``, one launch, the two scenarios on the
    same process group. First DDP, a 6 s step bound, rank 2 asleep 10 s in step 2; no watchdog. The
    bound's timer aborts the groups (NCCL's step bound; on gloo the groups' own timeout would be
    lowered instead), every rank redoes step 2 on a rebuilt world (generation 1), bit-equal to the
    fault-free run. Then the same with the module sharded by FSDP2 and Adam, from generation 1 where
    the first left the world: redone in generation 2 on a module sharded again.
``fsdp2`` tests/workers/sharded_heal_worker.py ``kill``: FSDP2 on 3 ranks, rank 1 SIGKILLed inside
    its snapshot take; restored from its buddy's replica, every rank bit-equal to the fault-free run.

What the stand-in cannot show (a dead peer fails a gloo op at once, where NCCL over NVLink or
InfiniBand waits for the abort; CUDA streams; NCCL's own error handling) is in docs/nccl.md.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(540)]  # past each launch's own hang guard

STAND_IN = {"NCCLGUARD_NCCL_STAND_IN": "1"}


@pytest.fixture(scope="module")
def stuck_job(tmp_path_factory):
    # As tests/watching/test_defaults_multirank.py's loop launch (about 30-50 s here). Hang guard 240 s.
    where = str(tmp_path_factory.mktemp("incidents"))
    env = {**STAND_IN, "NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_INCIDENT_DIR": where}
    return run_ranks("defaults_worker", 3, "loop", timeout_s=240, supervise=["--restarts=1"], env=env)


@pytest.fixture(scope="module")
def held_job():
    # As tests/recovery/test_held_release_multirank.py's launch (30-60 s here). Hang guard 240 s.
    env = {**STAND_IN, "NCCLGUARD_AUTO": "1"}
    return run_ranks("held_worker", 3, timeout_s=240, supervise=["--restarts=1"], env=env)


@pytest.fixture(scope="module")
def stall_job():
    # As tests/recovery/test_recovering_multirank.py's first launch, its stall and fsdp2 scenarios only
    # (27 s here; they were two launches of 16-17 s). Hang guard: the two launches' 240 s, summed.
    return run_ranks("recovering_worker", 3, "stall", "fsdp2", timeout_s=480, env=STAND_IN)


@pytest.fixture(scope="module")
def fsdp2_job():
    # As tests/recovery/test_sharded_heal_multirank.py's kill launch. Hang guard 360 s.
    return run_ranks(
        "sharded_heal_worker", 3, "kill", launcher="spawn", restarts=1, restart_on=[-9], timeout_s=360, env=STAND_IN
    )


def _released_by_abort(job, ranks) -> list[dict]:
    """The survivors' release events: each aborted its groups, and cut no socket but its own (the
    stand-in's emulation of NCCL's abort, counted under its own rank)."""
    events = [e for r in ranks for e in job[r].get("events", []) if e["what"] == "released"]
    for r in ranks:
        for e in (e for e in job[r].get("events", []) if e["what"] == "released"):
            assert e["aborted"], e  # the groups aborted: NCCL's release
            assert set(e["cut"]) <= {str(r)}, e  # never the gloo release's per-peer cut
    return events


def test_a_stuck_rank_under_ddp_is_ended_released_by_abort_and_healed_over_the_side_group_bit_equal(stuck_job):
    asleep, steps = stuck_job[0]["plan"]
    for r in (0, 1):
        res = stuck_job[r]
        rows = [(x["step"], x["ok"], x["attempts"], x["size"]) for x in res["results"]]
        assert rows == [(s, True, 2 if s == asleep else 1, 3) for s in range(steps)], rows
        assert res["final"] == [r, 3, 1]
        # The heal's CPU state went over the side gloo group: the device group carries none.
        assert res["results"][asleep]["lane"] == "side gloo", res["results"][asleep]
        assert all(x["lane"] is None for x in res["results"] if x["step"] != asleep)
    back = stuck_job[12]
    assert (back["life"], back["resume_step"], back["lane"]) == (1, asleep, "side gloo")
    assert [(x["step"], x["ok"], x["size"]) for x in back["results"]] == [(s, True, 3) for s in range(asleep, steps)]
    assert stuck_job[0]["digest"] == stuck_job[1]["digest"] == back["digest"]
    for r in (0, 1, 12):  # only the sleeper was acted on
        acted = [e for e in stuck_job[r].get("events", []) if e["what"] in ("acted", "self-asked", "asked", "ended")]
        assert all(e["rank"] == 2 and e["state"] == "stuck" for e in acted), acted
    _released_by_abort(stuck_job, (0, 1))  # none is needed here (see the module doc); any is an abort
    # Its group was made by the script before recovery started, with torchrun's NCCL error handling for
    # its workers (1: on real NCCL a survivor of a peer's death is ended with it, seen on an H200,
    # docs/nccl.md): every process's engine says so and what to set; the groups made from then on get 2.
    said = "recovery on NCCL: the world's NCCL group was made with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (torchrun"
    # Ranks 0-2; not the restarted process: its engine starts in the stand-in world of one and sets the
    # variables before it makes its group in the survivors' world.
    assert stuck_job.output.count(said) == 3, stuck_job.output[-3000:]


def test_a_survivor_held_by_a_live_peer_is_released_by_an_abort_and_the_full_world_comes_back(held_job):
    r0, r1, r2 = held_job[0], held_job[1], held_job[12]
    assert (r0["life"], r1["life"], r2["life"]) == (0, 0, 1)
    # Rank 0's op on the pair group failed: the stand-in's abort (it never completes otherwise).
    assert r0["held"]["error"] is not None, r0["held"]
    for r in (r0, r1):
        steps = {s["step"]: s for s in r["results"]}
        assert sorted(steps) == list(range(8))
        redo = steps[4]
        assert (redo["ok"], redo["attempts"], redo["size"], redo["generation"]) == (True, 2, 3, 1), redo
        assert all(s["ok"] and s["attempts"] == 1 for k, s in steps.items() if k != 4)
    assert [r0["final"], r1["final"], r2["final"]] == [[0, 3, 1], [1, 3, 1], [2, 3, 1]]
    assert r0["equal_across_ranks"] and r1["equal_across_ranks"] and r2["equal_across_ranks"]
    assert r2["lane"] == "side gloo"  # the restarted rank's heal: never CPU tensors on the device group
    released = _released_by_abort(held_job, (0, 1))
    assert released, {r: held_job[r]["events"] for r in (0, 1)}
    assert all((e["rank"], e["state"]) == (2, "dead") for e in released), released


# The launch's scenario and the generation its fault-free run is on: fsdp2 starts where stall left the
# world (its redone step 2 on generation 1), so its own fault-free run is on 1 and its redone step on 2.
@pytest.mark.parametrize(("scenario", "start"), [("stall", 0), ("fsdp2", 1)], ids=["stall", "fsdp2"])
def test_a_step_past_its_bound_is_aborted_by_the_timer_and_redone_bit_equal(scenario, start, stall_job):
    """DDP, then FSDP2 (full parameters and Adam's state compared)."""
    k = 2  # the worker's stalled step
    for r in range(3):
        res = stall_job[r][scenario]
        # The fault-free run first: every step at its first attempt, no rebuild.
        assert [(s["ok"], s["attempts"], s["generation"]) for s in res["reference_results"]] == [(True, 1, start)] * 5
        steps = res["results"]
        assert [s["ok"] for s in steps] == [True] * 5 and [s["attempts"] for s in steps] == [1, 1, 2, 1, 1]
        assert steps[k]["generation"] == start + 1 and steps[k]["commits"] == [[False, [0, 1, 2]], [True, []]], steps[k]
        assert res["equal_to_reference"] is True and res["equal_across_ranks"] is True
        assert res["final"] == [r, 3]
        # The bound acted by its timer's abort, not by a lowered gloo timeout.
        assert res["step_bound"] == {"aborted": 1, "lowered": 0}, res["step_bound"]


def test_an_fsdp2_rank_killed_in_its_take_is_restored_from_its_buddy_bit_equal(fsdp2_job):
    assert [(r.rank, r.count, r.returncode) for r in fsdp2_job.restarts] == [(1, 1, -9)]
    assert fsdp2_job[1]["restored"]["ok"] is True and fsdp2_job[1]["restored"]["role"] == "receiver"
    for r in range(3):
        assert fsdp2_job[r]["final"] == [r, 3, 1]
        assert fsdp2_job[r]["equal_to_reference"] is True  # full parameters and Adam's state, bit for bit
    for r in (0, 2):  # the survivors' fault-free run: no rebuild, a snapshot at steps 0, 2 and 4, none lost
        refs = fsdp2_job[r]["reference_results"]
        assert [(s["ok"], s["attempts"], s["generation"]) for s in refs] == [(True, 1, 0)] * 6
        assert fsdp2_job[r]["reference_takes"] == [3, True, 0]
