"""Steps redone on a rebuilt world in the HF Trainer (``guard_trainer(recover=True)``) and in an
Accelerate loop (``recovering_step``): 3 real gloo ranks under torchrun, CPU, one launch.

Launches (tests/workers/hf_recover_worker.py): one launch, 3 ranks under torchrun, its arguments ``a``
``b`` ``c`` the parts it runs, in order, on the group HF's ``TrainingArguments`` made (its default
``ddp_timeout``, 1,800 s, never lowered by hand):
``a``: a tiny BERT through the Trainer with 2 micro-batches per step, fault-free and then with rank 2
    stalled at step 2 until ranks 0-1 failed (their DDP collective ran past ncclguard's 3 s
    ``collective_timeout``); every rank redoes step 2 in generation 1.
``b``: an Accelerate loop, fault-free and then the same stall; step 2 redone in generation 2.
``c``: the Trainer with ``allow_shrink=True`` and a reporting watchdog, rank 2 asleep for good from the
    start of step 2: the survivors finish as a world of 2 and rank 2 is fenced (exit 0).
The pure parts run in this process: bad input, a step redone in a world of one, re-sharding a
``DistributedSampler``.

The launch is a drill (`make drills`). What stays in the suite: a step of the Trainer redone and logged
(tests/integrations/test_hf_recover.py, in one process), the Trainer recovering on real ranks with
``TrainingArguments``' defaults (tests/watching/test_verdict_multirank.py, ``hf``: a rank asleep for good, the
survivors finish as a world of 2) and a killed rank redone on the rebuilt world, healed and bit-equal
(tests/integrations/test_hf_bitequal_multirank.py, ``ddp``); a stall past the step bound redone bit-equal on
the same engine (tests/recovery/test_recovering_multirank.py, ``stall``) and through ``recovering_step``, past a
3 s bound (tests/integrations/test_accelerate_accumulate_multirank.py); a rank left behind fenced with status 0
(tests/recovery/test_fence_multirank.py, ``left_behind``).
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.timeout(400)  # past each launch's own hang guard

K = 2  # the step that fails (hf_recover_worker.K)
HF_DDP_TIMEOUT_S = 1800.0  # TrainingArguments' default, left on the live group
RECOVER_KEYS = {
    "ncclguard_recover_s",
    "ncclguard_recover_generation",
    "ncclguard_recover_world_size",
    "ncclguard_recover_attempts",
    "ncclguard_recover_failed_ranks",
}


@pytest.fixture(scope="module")
def job():
    # Three parts, three 3 s step bounds, a 6 s commit and a 24 s rebuild in C (the survivors wait
    # both out for rank 2), then rank 2's fence (3 s of silent peers, 4 s of grace): 70-90 s under
    # load (4 CPU burners on 2 cores). Hang guard: over 3x that. A rank that aborts, or one the
    # guard ends, dumps every thread's Python stack into launch.log (the harness's faulthandler).
    return run_ranks("hf_recover_worker", 3, "a", "b", "c", timeout_s=300)


def recover_entries(history: list[dict]) -> list[dict]:
    return [e for e in history if any("recover" in k for k in e)]


# A drill (`make drills`): what stays in the suite is in the module doc (``a``).
@pytest.mark.drill
@pytest.mark.multirank
def test_the_trainer_redoes_a_stalled_step_on_generation_1_and_ends_bit_equal(job):
    for r in range(3):
        res = job[r]
        assert res["group_timeout_s"] == HF_DDP_TIMEOUT_S  # the live group kept HF's default
        a = res["a"]
        assert a["stalled"] == (1 if r == 2 else 0)
        assert (a["global_step"], a["generation"], a["world"]) == (5, 1, [r, 3])
        (rec,) = a["recoveries"]
        assert {k: rec[k] for k in ("step", "ncclguard_recover_generation", "ncclguard_recover_world_size")} == {
            "step": K,
            "ncclguard_recover_generation": 1,
            "ncclguard_recover_world_size": 3,
        }
        assert rec["ncclguard_recover_attempts"] == 2
        # Ranks 0-1 timed out waiting for rank 2; every rank reads the same verdict.
        assert {0, 1} <= {int(x) for x in _ranks(rec["ncclguard_recover_failed_ranks"])}
        (logged,) = recover_entries(a["log_history"])
        assert set(logged) == RECOVER_KEYS | {"step", "epoch"} and logged["step"] == K
        assert logged["ncclguard_recover_generation"] == 1
        # The redone step is the fault-free run's step: same losses logged, same parameters.
        assert _losses(a["log_history"]) == _losses(a["ref_log_history"])
        assert recover_entries(a["ref_log_history"]) == []  # the fault-free run, guarded too, recovered nothing
        assert a["equal_across_ranks"] is True
        assert a["equal_to_reference"] is True
    assert len({job[r]["a"]["recoveries"][0]["ncclguard_recover_failed_ranks"] for r in range(3)}) == 1


# A drill (`make drills`): what stays in the suite is in the module doc (``b``).
@pytest.mark.drill
@pytest.mark.multirank
def test_an_accelerate_loop_redoes_a_stalled_step_on_the_next_generation(job):
    clean = [True, 1, None, [[True, []]]]
    for r in range(3):
        b = job[r]["b"]
        assert b["ref_results"] == [[True, 1, 1, [[True, []]]]] * 5
        results = b["results"]
        assert [x[:2] for x in results] == [[True, 1], [True, 1], [True, 2], [True, 1], [True, 1]]
        assert [x[2] for x in results] == [1, 1, 2, 2, 2]  # generation 1 came from part A
        redone = results[K][3]
        assert redone[0][0] is False and {0, 1} <= set(redone[0][1]) and redone[1] == [True, []]
        assert all(x[3] == clean[3] for i, x in enumerate(results) if i != K)
        (rec,) = b["recoveries"]
        assert (rec["step"], rec["ncclguard_recover_generation"], rec["ncclguard_recover_world_size"]) == (5 + K, 2, 3)
        assert b["equal_across_ranks"] is True
        assert b["equal_to_reference"] is True  # bit for bit, the fault-free run's parameters
        assert b["accelerate"] == [r, 3]


# A drill (`make drills`): what stays in the suite is in the module doc (``c``).
@pytest.mark.drill
@pytest.mark.multirank
def test_a_rank_asleep_for_good_is_left_behind_and_the_survivors_finish_as_a_world_of_2(job):
    for r in (0, 1):
        c = job[r]["c"]
        assert (c["global_step"], c["generation"], c["world"]) == (7, 3, [r, 2])
        (rec,) = c["recoveries"]
        assert (rec["step"], rec["ncclguard_recover_generation"], rec["ncclguard_recover_world_size"]) == (K, 3, 2)
        assert 2 in _ranks(rec["ncclguard_recover_failed_ranks"])  # named: it never came
        (logged,) = recover_entries(c["log_history"])
        assert logged["ncclguard_recover_world_size"] == 2 and logged["step"] == K
        assert c["equal_across_ranks"] is True
        # Steps 0-2 on 3 ranks; from the redone step 2 on, Accelerate's state says 2 ranks at once,
        # the data loader keeps its 3-way shard to the end of the epoch (step 3) and is
        # re-sharded 2 ways from the next epoch (steps 4-6: 4 steps an epoch).
        assert [(s["step"], s["world"], s["accelerate"], s["args_world_size"], s["shard"]) for s in c["steps"]] == [
            (0, [r, 3], [r, 3], 3, [r, 3]),
            (1, [r, 3], [r, 3], 3, [r, 3]),
            (2, [r, 3], [r, 3], 3, [r, 3]),
            (3, [r, 2], [r, 2], 2, [r, 3]),
            (4, [r, 2], [r, 2], 2, [r, 2]),
            (5, [r, 2], [r, 2], 2, [r, 2]),
            (6, [r, 2], [r, 2], 2, [r, 2]),
        ]
    # Rank 2 never left step 2: no part C result, and the left-behind fence ended it with status 0
    # (every rank's exit code is checked by run_ranks), so torchrun ended the job.
    assert "c" not in job[2] and job[2]["b"]["equal_across_ranks"] is True
    assert "left behind: the job went on to generation 3" in job.output


def _ranks(text: str) -> set[int]:
    """'0-2' or '0,2' or '2' as a set of ranks (rank_ranges' spelling)."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _losses(history: list[dict]) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in history if "loss" in e]
