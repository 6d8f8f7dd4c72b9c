"""CommittedEngineStep on a real DeepSpeed ZeRO-2 engine: 2 gloo ranks on CPU under ncclguard's
launcher (torchrun would stop the second rank as soon as the first exits 75). Rank side:
tests/workers/deepspeed_commit_worker.py.

A failed step ends in ``engine.save_checkpoint`` and exit 75 on every rank; a restart loads the
checkpoint (the state before the failed step) and ends bit-equal to a run without the fault.
With ``rebuild_engine`` (ZeRO-2 and ZeRO-3, under torchrun: nothing exits) the failed step is redone
in process on a new engine, with no disk, and the run ends bit-equal to one without the fault.

Launches (tests/workers/deepspeed_commit_worker.py), each 2 ranks; a step's collectives bounded at 3 s:
``fail`` spawn: steps 0-1 commit; at step 2 rank 1 stalls 9 s before its forward, rank 0 times out in ZeRO's
    gradient reduction; both ranks save a checkpoint of the state before step 2 and exit 75.
``resume`` spawn: a new engine loads that checkpoint and trains steps 2-4; a second engine trains 0-4 without
    a fault, to compare with bit for bit.
``memory`` torchrun, stages ``2,3``: the same stall at step 2, redone in process on an engine rebuilt from
    another seed and given the old one's state; losses and full parameters equal a fault-free engine's.
``memory-kill`` spawn: ZeRO-2 with ``rebuild_engine``, rank 1 SIGKILLed at step 2: no world can be rebuilt
    without it, so rank 0 exits 75 and writes no checkpoint.
"""

from __future__ import annotations

import pytest
from harness import run_ranks

from ncclguard.integrations.deepspeed import EX_TEMPFAIL, CommittedEngineStep

pytestmark = pytest.mark.timeout(600)
K, STEPS = 2, 5


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ds-ckpt")
    # 9 s stall, 3 s timeouts, the rebuild and the save: 40 s here with DeepSpeed's start-up, at
    # load 3 (the op build is cached by make install). Hang guard: over 3x that.
    failed = run_ranks(
        "deepspeed_commit_worker",
        2,
        "fail",
        str(ckpt),
        launcher="spawn",
        timeout_s=240,
        expect_rc={0: EX_TEMPFAIL, 1: EX_TEMPFAIL},
    )
    resumed = run_ranks("deepspeed_commit_worker", 2, "resume", str(ckpt), launcher="spawn", timeout_s=240)
    return failed, resumed, ckpt


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ds-none")
    # Two stages, each a 9 s stall, a 3 s timeout, the rebuild and a new engine: 25 s alone here.
    return run_ranks("deepspeed_commit_worker", 2, "memory", str(ckpt), "2,3", timeout_s=240)


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_with_rebuild_engine_a_failed_step_is_redone_in_process_on_a_new_engine_bit_equal(memory, stage):
    for r in (0, 1):
        res = memory[r]
        (recovered,) = res[f"z{stage}.recoveries"]  # one failed step, recovered once
        assert recovered["ncclguard_recover_attempts"] == 2
        assert recovered["ncclguard_recover_generation"] == (1 if stage == 2 else 2)
        assert recovered["ncclguard_recover_failed_ranks"] == "0-1"
        assert res[f"z{stage}.new_engine"] is True  # built by rebuild_engine, from another seed
        assert res[f"z{stage}.global_steps"] == STEPS
        assert res[f"z{stage}.losses"] == res[f"z{stage}.reference_losses"]  # dropout included
        assert res[f"z{stage}.digest"] == res[f"z{stage}.reference_digest"]  # full parameters and buffers
        assert res["checkpoint_files"] == []  # no disk
    assert memory[0][f"z{stage}.losses"] != memory[1][f"z{stage}.losses"]  # each rank its own batches
    assert "a new engine in world generation" in memory.output


@pytest.mark.multirank
def test_with_rebuild_engine_a_killed_rank_ends_the_survivor_with_75_and_no_checkpoint(tmp_path):
    # Rank 1 is killed at step 2: no world without it (no shrink), and rank 0's partition alone is
    # no checkpoint. 12 s alone here (5 s commit and rebuild timeouts); hang guard well over 3x.
    job = run_ranks(
        "deepspeed_commit_worker",
        2,
        "memory-kill",
        str(tmp_path),
        launcher="spawn",
        timeout_s=240,
        expect_rc={0: EX_TEMPFAIL, 1: -9},
    )
    assert job[0]["global_steps_before_failed_step"] == K and "not_exited" not in job[0]
    assert "ranks [1] did not reach rebuild_world within 5 s" in job.output
    assert "Exiting 75; the launcher restarts from your last checkpoint" in job.output
    assert "a new engine in world generation" not in job.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multirank
def test_a_failed_step_ends_in_a_checkpoint_and_exit_75_on_every_rank(jobs):
    failed, _, ckpt = jobs
    assert failed.returncodes == {0: 75, 1: 75}  # also required by run_ranks
    for r in (0, 1):
        assert failed[r]["global_steps_before_failed_step"] == K
        assert "not_exited" not in failed[r]
        assert failed[r]["ddp_adapter_refused"].startswith(
            "RecoveringStep cannot wrap this module again after a rebuild: it is a DeepSpeed engine"
        )
    assert (ckpt / "latest").read_text() == f"global_step{K}"
    files = sorted(p.name for p in (ckpt / f"global_step{K}").iterdir())
    assert files == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    out = failed.output
    assert out.count("CommittedEngineStep: checkpoint global_step2 saved in") == 2
    assert "rebuild_world: generation 1" in out


@pytest.mark.multirank
def test_the_restart_resumes_from_the_step_before_the_failure_and_ends_bit_equal(jobs):
    failed, resumed, _ = jobs
    for r in (0, 1):
        res = resumed[r]
        assert res["loaded"] is True and res["global_steps_loaded"] == K
        assert res["digest_loaded"] == failed[r]["digest_before_failed_step"]  # nothing of the failed step
        assert res["global_steps_resumed"] == STEPS
        assert res["resumed_run"] == [[True] * (STEPS - K), 0, 0]  # each step applied, none redone, no rebuild
        assert res["digest_resumed"] == res["digest_reference"]  # bit for bit, Adam state included
    assert resumed[0]["digest_resumed"] == resumed[1]["digest_resumed"]


class NotAnEngine:
    pass


class Engine:
    """The calls CommittedEngineStep checks for, with a given accumulation (no DeepSpeed needed)."""

    def __init__(self, gas: int) -> None:
        self.gas = gas

    def backward(self, loss): ...
    def step(self): ...
    def save_checkpoint(self, *a, **k): ...
    def gradient_accumulation_steps(self) -> int:
        return self.gas


@pytest.mark.parametrize(
    "engine, kwargs, error, text",
    [
        (NotAnEngine(), {"checkpoint_dir": "/x"}, TypeError, "needs a DeepSpeed engine"),
        (Engine(4), {"checkpoint_dir": "/x"}, ValueError, "gradient_accumulation_steps=1, got 4"),
        (Engine(1), {"checkpoint_dir": ""}, ValueError, "checkpoint_dir must be a directory path"),
        (Engine(1), {"checkpoint_dir": "/x", "exit_code": 0}, ValueError, "exit_code must be an int from 1 to 255"),
        (Engine(1), {"checkpoint_dir": "/x", "commit_timeout": -1}, ValueError, "commit_timeout"),
        (Engine(1), {"checkpoint_dir": "/x", "rebuild_engine": 3}, TypeError, "rebuild_engine must build"),
        (Engine(1), {"checkpoint_dir": "/x", "rebuild_engine": Engine, "max_attempts": 1}, ValueError, "at least 2"),
        (Engine(1), {"checkpoint_dir": "/x", "rebuild_engine": Engine}, TypeError, "DeepSpeedState needs a DeepSpeed"),
    ],
)
def test_bad_arguments_are_refused_before_any_step(engine, kwargs, error, text):
    with pytest.raises(error, match=text):
        CommittedEngineStep(engine, **kwargs)
