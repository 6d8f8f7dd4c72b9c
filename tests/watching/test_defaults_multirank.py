"""Every default, a rank asleep for good, the full world back: real gloo ranks under torchrun, each under
its supervisor (``--restarts=1``, as ``ncclguard run --ncclguard-restarts 1`` runs it) with
``NCCLGUARD_AUTO=1``, and nothing else set: no timeout, no ``heal``, no ``allow_shrink``. Under
restarts the engine heals by default (``RecoveryOptions.heal``): the waiting ranks agree the rank is
stuck (or it judges itself), its supervisor ends it at once and restarts it, the new process rejoins
in its old place and is healed from a live peer, and training ends on 3 ranks with equal parameters.
No healthy rank is acted on. Rank side: tests/workers/defaults_worker.py:

``loop`` 3 ranks: ``RecoveringStep(module, opt, scheduler=...)`` over a 2.05M-parameter BERT with its
    default dropout and shuffled data; launch rank 2 asleep for good at step 12 (after the warm-up).
``hf`` 3 ranks: the HF Trainer with ``guard_trainer(trainer, recover=True)``; launch rank 2 asleep for
    good at the start of global step 3 (before the warm-up: the 30 s judge bound).
``accelerate`` 3 ranks: the ``loop`` as the Accelerate page writes it, ``Accelerator()`` first, then
    ``recovering_step(accelerator, model, optimizer, scheduler=schedule)``; launch rank 2 asleep for good at
    step 12.
``lightning`` 3 ranks: that BERT as a LightningModule, ``Trainer(callbacks=[NcclGuardCallback(recover=True)])``
    with Lightning's defaults (its fit makes the group: the callback is imported before, as its page
    writes it); launch rank 2 asleep for good at global step 12.

The loops and the Trainer make their process group before they import ncclguard, as their docs write them: the
restarted process stands in all the same (the start-up hook), never waits in the job's first world.

The same fault with ``allow_shrink=True`` (a world of 2): tests/watching/test_verdict_multirank.py.

Every launch here is a drill (`make drills`; the long form with statistics: benchmarks/stuck_drill.py, each
stack 20 times). What keeps each capability in `make test`: the ``loop`` launch itself, with the NCCL
stand-in's variable added, in tests/recovery/test_nccl_stand_in_multirank.py (its stuck test: the same worker,
ranks, supervisors and defaults); the rule the ``loop`` of four ranks stopped checks, on its numbers, in
tests/watching/test_progress_evidence.py, and a SIGSTOPped rank judged from ``/proc`` on real ranks in
tests/watching/test_verdict_multirank.py; the verdict through the Trainer's and Accelerate's adapters in
tests/watching/test_verdict_multirank.py (``hf``); a restarted rank healed from a live peer inside the Trainer,
Accelerate and Lightning in tests/integrations/test_hf_bitequal_multirank.py (``ddp``) and
tests/integrations/test_heal_frameworks_multirank.py; each test below names its own.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.multirank

DEFAULTS = ["--restarts=1"]  # what ncclguard run --ncclguard-restarts 1 runs each rank under


def _env(tmp: str) -> dict[str, str]:
    # The watchdog as ncclguard run starts it, every setting at its default but where incidents go.
    return {"NCCLGUARD_AUTO": "1", "NCCLGUARD_WATCHDOG_INCIDENT_DIR": tmp}


def _group_first_and_the_restart_stood_in(job: dict, asleep: int = 2, world: int = 3) -> None:
    """Every life made its group before ncclguard was imported; the first lives made the job's world,
    the restarted process the stand-in world of one (it then joined the survivors' world)."""
    for r in [*range(world), 10 + asleep]:
        assert job[r]["order"]["ncclguard_first"] is False, (r, job[r]["order"])
        assert job[r]["order"]["group"] == ([0, 1] if r >= 10 else [r, world]), (r, job[r]["order"])


def _acted_on_the_sleeper_only(job: dict, asleep: int = 2, world: int = 3) -> None:
    """Whoever acted (a waiting rank once the others agreed, or the sleeper on itself) acted on the
    sleeper, and only once it was stuck; a healthy rank judged stuck by one rank alone waited for an
    agreement that never came (``awaiting``) and was never acted on."""
    for r in [*(x for x in range(world) if x != asleep), 10 + asleep]:
        events = job[r].get("events", [])
        acted = [e for e in events if e["what"] in ("acted", "self-asked", "self-fenced", "asked", "ended")]
        assert all(e["rank"] == asleep and e["state"] == "stuck" for e in acted), (r, events)
        assert all(e["restart"] for e in acted if e["what"] == "acted"), (r, events)  # its supervisor restarts it


@pytest.fixture(scope="module")
def loop_job(tmp_path_factory):
    # About 30 s here: 12 steps (the judge bound learned at its 10 s floor), the stall judged ~10 s
    # into its step, a cold restart (torch and transformers imported again), a heal. Hang guard 240 s,
    # under the 300 s step bound that would otherwise end the survivors' wait first.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("defaults_worker", 3, "loop", timeout_s=240, supervise=DEFAULTS, env=_env(where))


# A drill (`make drills`): the same launch with the NCCL stand-in's variable added stays in the suite
# (tests/recovery/test_nccl_stand_in_multirank.py::test_a_stuck_rank_under_ddp_is_ended_released_by_abort_and_healed_over_the_side_group_bit_equal:
# the rank asleep agreed stuck, ended by its supervisor, restarted, healed, every step on the full world, bit-equal).
@pytest.mark.drill
def test_a_loop_with_every_default_ends_on_its_full_world_after_a_rank_asleep_for_good(loop_job):
    """RecoveringStep(module, opt, scheduler=...) and nothing else; a 2.05M-parameter BERT, shuffled data."""
    ASLEEP, STEPS = loop_job[0]["plan"]
    for r in (0, 1):
        res = loop_job[r]
        assert res["heal"] is True  # on by default under the supervisor's restarts
        rows = [(x["step"], x["ok"], x["attempts"], x["size"]) for x in res["results"]]
        assert rows == [(s, True, 2 if s == ASLEEP else 1, 3) for s in range(STEPS)], rows
        assert res["final"] == [r, 3, 1]
        # The redo went on well within the bound (the stall's step began before it), far below the 300 s step bound.
        redo = res["results"][ASLEEP]
        assert redo["ended"] - loop_job[2]["stall_at"] < 100, redo
    assert loop_job[2]["life"] == 0 and [x["step"] for x in loop_job[2]["results"]] == list(range(ASLEEP))
    back = loop_job[12]
    assert back["life"] == 1 and back["resume_step"] == ASLEEP
    assert [(x["step"], x["ok"], x["size"]) for x in back["results"]] == [(s, True, 3) for s in range(ASLEEP, STEPS)]
    assert back["final"] == [2, 3, 1]
    # One world, one state: the healed rank holds the survivors' parameters, bit for bit.
    assert loop_job[0]["digest"] == loop_job[1]["digest"] == back["digest"]
    assert sorted(x["healed"] for x in (loop_job[0]["results"][ASLEEP], loop_job[1]["results"][ASLEEP])) == [
        "bystander",
        "source",
    ]
    _acted_on_the_sleeper_only(loop_job)
    _group_first_and_the_restart_stood_in(loop_job)


@pytest.fixture(scope="module")
def stopped_job(tmp_path_factory):
    # About 45 s here: the loop on 4 ranks, launch rank 2 SIGSTOPped at step 12 (its heartbeats stop
    # too), judged from /proc ~10 s into its step, a cold restart, a heal. Hang guard 240 s.
    where = str(tmp_path_factory.mktemp("incidents"))
    env = {**_env(where), "DRILL_FAULT": "stopped"}
    return run_ranks("defaults_worker", 4, "loop", timeout_s=240, supervise=DEFAULTS, env=env)


# A drill (`make drills`): the rule it checks (only the peers furthest behind are judged) stays in the suite on
# this launch's numbers (tests/watching/test_progress_evidence.py::test_only_the_peers_furthest_behind_are_judged_a_peer_between_may_wait_for_them),
# a SIGSTOPped rank judged from /proc on real ranks in tests/watching/test_verdict_multirank.py (``stuck``).
@pytest.mark.drill
def test_a_loop_of_four_ranks_ends_on_its_full_world_after_a_rank_stopped_and_no_healthy_rank_is_judged(stopped_job):
    """The loop above on 4 ranks, launch rank 2 stopped for good (SIGSTOP: its heartbeats stop with it).
    Rank 0 waits in DDP's broadcast of the buffers, relayed through rank 2; ranks 1 and 3 go on into the
    backward: rank 0 is behind them, ahead of rank 2. Judged by its count alone, ranks 1 and 3 agreed on
    it before its own vote was in its heartbeat, and its supervisor killed it (1 launch of 3 before the
    verdict judged only the peers furthest behind; benchmarks/stuck_drill.py --ranks 4 --fault stopped)."""
    ASLEEP, STEPS = stopped_job[0]["plan"]
    for r in (0, 1, 3):
        rows = [(x["step"], x["ok"], x["attempts"], x["size"]) for x in stopped_job[r]["results"]]
        assert rows == [(s, True, 2 if s == ASLEEP else 1, 4) for s in range(STEPS)], (r, rows)
        assert stopped_job[r]["final"] == [r, 4, 1]
    # No rank judged another than the stopped one: not even "awaiting" an agreement.
    judged = [(r, e["what"], e["rank"]) for r in (0, 1, 3) for e in stopped_job[r]["events"]]
    assert {j for _, what, j in judged if what in ("awaiting", "acted")} == {2}, judged
    back = stopped_job[12]
    assert back["resume_step"] == ASLEEP and back["final"] == [2, 4, 1]
    assert len({stopped_job[r]["digest"] for r in (0, 1, 3, 12)}) == 1
    _acted_on_the_sleeper_only(stopped_job, world=4)
    _group_first_and_the_restart_stood_in(stopped_job, world=4)


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    # About 50 s here: the stall before the judge bound's warm-up (its 30 s default), a cold restart
    # importing transformers again, a heal. Hang guard 240 s.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("defaults_worker", 3, "hf", timeout_s=240, supervise=DEFAULTS, env=_env(where))


# A drill (`make drills`): the verdict through guard_trainer with TrainingArguments' defaults stays in the suite in
# tests/watching/test_verdict_multirank.py::test_the_hf_trainer_with_every_default_goes_on_without_a_rank_asleep_for_good,
# a restarted Trainer rank healed from a live peer in tests/integrations/test_hf_bitequal_multirank.py (``ddp``), and
# the judge bound's 30 s default before the warm-up in tests/watching/test_learned_progress.py.
@pytest.mark.drill
def test_the_hf_trainer_with_every_default_ends_on_its_full_world_after_a_rank_asleep_for_good(hf_job):
    """guard_trainer(trainer, recover=True) and TrainingArguments' defaults, as the issue ran it: a rank
    asleep for good at the start of step 3; the Trainer finishes max_steps on 3 ranks, within 60 s of
    the stall here (the hang guard of the assertion is 3x that)."""
    HF_ASLEEP, HF_STEPS = hf_job[0]["plan"]
    stall = hf_job[2]["stall_at"]
    for r in (0, 1, 12):
        res = hf_job[r]
        assert res["heal"] is True and res["global_step"] == HF_STEPS, res
        assert res["final"] == [r % 10, 3, 1]
        assert res["train_end"] - stall < 180, res
    for r in (0, 1):
        [rec] = hf_job[r]["recoveries"]
        assert rec["step"] == HF_ASLEEP and rec["world_size"] == 3, rec
    assert hf_job[12]["life"] == 1 and hf_job[12]["recoveries"] == []
    assert hf_job[0]["digest"] == hf_job[1]["digest"] == hf_job[12]["digest"]
    _acted_on_the_sleeper_only(hf_job)
    _group_first_and_the_restart_stood_in(hf_job)


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory):
    # About 35 s here, as the loop: 12 steps, the stall judged ~10 s into its step, a cold restart, a
    # heal. Hang guard 240 s, under the 300 s step bound.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("defaults_worker", 3, "accelerate", timeout_s=240, supervise=DEFAULTS, env=_env(where))


# A drill (`make drills`): the verdict through recovering_step stays in the suite in
# tests/watching/test_verdict_multirank.py::test_an_accelerate_loop_with_every_default_goes_on_without_a_rank_asleep_for_good,
# a restarted rank healed inside an Accelerate loop in tests/integrations/test_heal_frameworks_multirank.py, and
# scheduler= for a step that heals in tests/recovery/test_recovery_keywords.py.
@pytest.mark.drill
def test_an_accelerate_loop_with_every_default_ends_on_its_full_world_after_a_rank_asleep_for_good(accelerate_job):
    """The loop as the Accelerate page writes it: Accelerator() first, then recovering_step(accelerator,
    model, optimizer, scheduler=schedule) and nothing else; the BERT of the loop above, its warm-up
    schedule stepped by the loop. Without scheduler=, the healed rank's schedule started again and
    its parameters differed from the survivors' at the end (tests/recovery/test_recovery_keywords.py)."""
    ASLEEP, STEPS = accelerate_job[0]["plan"]
    for r in (0, 1):
        res = accelerate_job[r]
        assert res["heal"] is True  # on by default under the supervisor's restarts
        rows = [(x["step"], x["ok"], x["attempts"], x["size"]) for x in res["results"]]
        assert rows == [(s, True, 2 if s == ASLEEP else 1, 3) for s in range(STEPS)], rows
        assert res["final"] == [r, 3, 1] and res["processes"] == [r, 3]  # Accelerate's view: the full world
        assert res["results"][ASLEEP]["ended"] - accelerate_job[2]["stall_at"] < 100
    back = accelerate_job[12]
    assert back["life"] == 1 and back["resume_step"] == ASLEEP
    assert [(x["step"], x["ok"], x["size"]) for x in back["results"]] == [(s, True, 3) for s in range(ASLEEP, STEPS)]
    assert back["final"] == [2, 3, 1] and back["processes"] == [2, 3]
    assert accelerate_job[0]["digest"] == accelerate_job[1]["digest"] == back["digest"]
    _acted_on_the_sleeper_only(accelerate_job)
    _group_first_and_the_restart_stood_in(accelerate_job)


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory):
    # About 55 s here: Lightning's start, 12 steps, the stall judged ~10 s into its step, a cold restart
    # (torch, transformers and Lightning imported again), a heal. Hang guard 240 s, 4x that.
    where = str(tmp_path_factory.mktemp("incidents"))
    return run_ranks("defaults_worker", 3, "lightning", timeout_s=240, supervise=DEFAULTS, env=_env(where))


# A drill (`make drills`): a restarted rank healed from a live peer inside a Lightning fit with its defaults stays in
# the suite in tests/integrations/test_heal_frameworks_multirank.py; the verdict, its supervisor's restart and the
# heal under every default (the engine the callback runs) in the loop's stand-in launch (see the loop's test).
@pytest.mark.drill
def test_a_lightning_fit_with_every_default_ends_on_its_full_world_after_a_rank_asleep_for_good(lightning_job):
    """Trainer(callbacks=[NcclGuardCallback(recover=True)]) with Lightning's defaults (DDP on gloo, its
    sampler), the BERT of the loop above, AdamW and a warm-up schedule from configure_optimizers."""
    ASLEEP, STEPS = lightning_job[0]["plan"]
    stall = lightning_job[2]["stall_at"]
    for r in (0, 1, 12):
        res = lightning_job[r]
        assert res["heal"] is True and res["global_step"] == STEPS, res
        assert res["final"] == [r % 10, 3, 1]
    for r in (0, 1):
        assert lightning_job[r]["recoveries"] == [{"step": ASLEEP, "world_size": 3}]
        assert lightning_job[r]["step_ends"][str(ASLEEP + 1)] - stall < 100  # the redone step, far under 300 s
    assert lightning_job[12]["life"] == 1 and lightning_job[12]["recoveries"] == []
    assert lightning_job[0]["digest"] == lightning_job[1]["digest"] == lightning_job[12]["digest"]
    # Every event beyond a wait or a report is about the sleeper: judged stuck, or (a rank that learnt of
    # it from the death notice its supervisor posted once it had ended it) released as dead.
    acted = [e for r in (0, 1, 12) for e in lightning_job[r]["events"] if e["what"] not in ("awaiting", "busy")]
    assert acted and all(e["rank"] == 2 for e in acted), acted
    for e in acted:
        assert e["state"] in (("stuck", "dead") if e["what"] == "released" else ("stuck",)), e
    _acted_on_the_sleeper_only(lightning_job)
