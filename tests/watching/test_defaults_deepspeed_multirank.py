"""Every default, DeepSpeed ZeRO-2, a rank asleep for good, the full world back: 3 real gloo ranks
under torchrun, each under its supervisor (``--restarts=1``, as ``ncclguard run
--ncclguard-restarts 1`` runs it) with ``NCCLGUARD_AUTO=1``, and nothing else set. The loop is
docs/recovery.md's: ``CommittedEngineStep(engine, checkpoint_dir=..., rebuild_engine=make)``, no
timeout, no ``heal``, no ``snapshot_every``. Under restarts the engine heals by default: the rank is
judged stuck (by the waiting ranks, whose wait is in ZeRO's gradient reduction on DeepSpeed's copy of
the world group, or by itself), its supervisor ends it at once and restarts it, the new process
joins, every rank builds a new engine, the restarted rank takes its partitions from its buddy's
in-memory snapshot, every rank goes back to that snapshot's step, and training ends on 3 ranks with
equal parameters. No healthy rank is acted on. Rank side: tests/workers/defaults_ds_worker.py.
The same fault in a DDP loop and the HF Trainer: tests/watching/test_defaults_multirank.py.

A drill (`make drills`; the long form: benchmarks/stuck_drill.py --stacks deepspeed). What stays in the suite: the
verdict, the supervisor's restart and the heal with every default in the loop under the NCCL stand-in
(tests/recovery/test_nccl_stand_in_multirank.py, its stuck test); a killed ZeRO-3 rank of ``CommittedEngineStep``
restored from its buddy's snapshot, bit-equal, in tests/integrations/test_deepspeed_heal_multirank.py; the verdict's
reading of DeepSpeed's copy of the world group in tests/watching/test_progress_evidence.py
(``test_world_groups_lists_every_copy_of_the_world_with_its_number``, and the choice on numbers).
"""

from __future__ import annotations

import re

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

DEFAULTS = ["--restarts=1"]  # what ncclguard run --ncclguard-restarts 1 runs each rank under
# The supervisor's line when it ends a rank on a stuck verdict (ncclguard/supervise/judge.py).
ENDED = re.compile(r"ncclguard\.supervise: launch rank (\d+) \(pid (\d+), at [^\n]*?\) is stuck: ([^;\n]*); SIGKILL")


def _acted_on_the_sleeper_only(job, asleep: int = 2) -> None:
    """Whoever acted (a waiting rank once the others agreed, or the sleeper on itself) acted on the
    sleeper, and only once it was stuck; no healthy rank was judged stuck, nor acted on."""
    for r in (0, 1, 10 + asleep):
        events = job[r].get("events", [])
        acted = [e for e in events if e["what"] in ("acted", "self-asked", "self-fenced", "asked", "ended")]
        assert all(e["rank"] == asleep and e["state"] == "stuck" for e in acted), (r, events)
        assert all(e["restart"] for e in acted if e["what"] == "acted"), (r, events)  # its supervisor restarts it
        assert all(e["rank"] == asleep for e in events if e["state"] == "stuck"), (r, events)


@pytest.fixture(scope="module")
def ds_job(tmp_path_factory):
    # 35-40 s here (2 cores, shared): 12 steps of ~0.1 s (the judge bound learned at its 10 s floor),
    # the stall judged ~10-14 s into its step, a cold restart (torch and DeepSpeed imported again), a
    # restore from the buddy's snapshot; every rank finished 19-22 s after the stall. Hang guard 240 s,
    # under the 300 s step bound that would otherwise end the survivors' wait first.
    where = str(tmp_path_factory.mktemp("incidents"))
    env = {"NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_INCIDENT_DIR": where}
    return run_ranks("defaults_ds_worker", 3, timeout_s=240, supervise=DEFAULTS, env=env)


# A drill (`make drills`): what stays in the suite is in the module doc.
@pytest.mark.drill
def test_a_deepspeed_loop_with_every_default_ends_on_its_full_world_after_a_rank_asleep_for_good(ds_job):
    """CommittedEngineStep(engine, checkpoint_dir=..., rebuild_engine=make) and nothing else; ZeRO-2,
    a 2.11M-parameter model with dropout; launch rank 2 asleep for good in its step function at step ASLEEP."""
    ASLEEP, STEPS = ds_job[0]["plan"]
    stall = ds_job[2]["stall_at"]
    back = ds_job[12]
    # The snapshot every rank went back to: the newest committed one at the stall (the first two steps
    # always take one; then every K steps, K chosen to cost at most 2% of the step time: step 1 here).
    rewound = back["resume_step"]
    assert 1 <= rewound <= ASLEEP, back
    for r in (0, 1):
        res = ds_job[r]
        assert res["heal"] is True  # on by default under the supervisor's restarts, with rebuild_engine
        rows = [(x["step"], x["applied"], x["rewound_to"], x["size"]) for x in res["results"]]
        assert rows == [
            *[(s, True, None, 3) for s in range(ASLEEP)],
            (ASLEEP, False, rewound, 3),
            *[(s, True, None, 3) for s in range(rewound, STEPS)],
        ], rows
        assert res["global_steps"] == STEPS  # DeepSpeed's counter came back with the snapshot
        assert res["final"] == [r, 3, 1]
        # The failed step ended well within the bound, far below the 300 s step bound.
        assert res["results"][ASLEEP]["ended"] - stall < 100, res["results"][ASLEEP]
        assert res["end"] - stall < 120, res["end"] - stall
    # The replica of rank 2's partitions came from its buddy; the other survivor only went back.
    assert sorted(ds_job[r]["results"][ASLEEP]["restored"] for r in (0, 1)) == ["holder", "survivor"]
    sleeper = ds_job[2]
    assert sleeper["life"] == 0 and [x["step"] for x in sleeper["results"]] == list(range(ASLEEP))
    assert back["life"] == 1 and back["heal"] is True
    assert back["healed"] == {"role": "receiver", "step": rewound}
    assert [(x["step"], x["applied"], x["rewound_to"], x["size"]) for x in back["results"]] == [
        (s, True, None, 3) for s in range(rewound, STEPS)
    ]
    assert back["global_steps"] == STEPS and back["final"] == [2, 3, 1]
    # One world, one state: the restored rank holds the survivors' parameters, bit for bit.
    assert ds_job[0]["digest"] == ds_job[1]["digest"] == back["digest"]
    # Its supervisor ended the sleeper, once, on a stuck verdict (its own or its peers' agreed one),
    # and restarted it; nobody else was ended.
    [(origin, pid, why)] = ENDED.findall(ds_job.output)
    assert (origin, pid) == ("2", str(sleeper["pid"])), ds_job.output[-4000:]
    assert why in (
        "it judged itself stuck (asked by launch rank 2)",
        "its peers agreed it is stuck (asked by launch rank 0)",
        "its peers agreed it is stuck (asked by launch rank 1)",
    ), why
    assert f"ncclguard.supervise: the rank (pid {sleeper['pid']}) exited -9; restart 1 of 1" in ds_job.output
    assert ds_job.output.count("; restart 1 of 1") == 1
    _acted_on_the_sleeper_only(ds_job)
    # deepspeed.init_distributed made the group before ncclguard was imported, in every life: the
    # restarted process's was the stand-in world of one (the start-up hook), never the job's first world.
    for r in (0, 1, 2, 12):
        assert ds_job[r]["order"] == {"ncclguard_first": False, "group": [0, 1] if r >= 10 else [r, 3]}, r
