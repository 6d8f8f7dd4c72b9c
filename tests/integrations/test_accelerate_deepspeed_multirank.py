"""An Accelerate loop with the DeepSpeed plugin under ``recovering_step(..., rebuild=..., heal=True)``:
on 3 real gloo ranks under ncclguard's launcher, a failed ZeRO-3 step redone on a new engine, a killed
rank restored from its buddy's in-memory snapshot, every rank bit-equal to Accelerate's own loop
without a fault; ZeRO-2 redone and its preemption checkpoint resumed; a ZeRO-3 accumulation window
redone whole. The model holds 2.1M parameters with dropout. Rank side:
tests/workers/accelerate_deepspeed_worker.py. What is refused is checked in process, before any step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_ranks

STEPS, RAISE, KILL = 7, 1, 5
BACK = KILL - 1


@pytest.fixture(scope="module")
def job():
    # Two ZeRO-3 runs of 7 steps on 3 ranks (a raise redone, a SIGKILL, a restart that imports torch,
    # Accelerate and DeepSpeed again, a rollback), two ZeRO-2 runs of 3 steps, two ZeRO-3 runs of 2
    # accumulation windows of a tiny BERT: 48-72 s here under a load of 3-4 (two cores;
    # worker's "seconds": about 36 s, 5 s, 14 s). Hang guard: 420 s.
    return run_ranks("accelerate_deepspeed_worker", 3, launcher="spawn", restarts=1, restart_on=[-9], timeout_s=420)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_zero3_a_raise_is_redone_and_a_killed_rank_heals_from_its_buddy_bit_equal(job):
    assert [(r.rank, r.count, r.returncode) for r in job.restarts] == [(1, 1, -9)]
    reference = job[0]["reference"]
    for r in range(3):
        res = job[r]
        assert len(res["reference_losses"]) == STEPS and res["reference"] == reference
        assert res["world"] == [r, 3, 2]  # two rebuilds: the raise, the kill
        assert res["digest"] == reference  # the full gathered parameters, bit for bit
        assert res["global_steps"] == STEPS  # DeepSpeed's own count, restored with the partitions
        assert res["lr"] == res["reference_lr"]  # the config's WarmupLR, inside the engine (still warming up)
        # This rank's loss at each step it ran, as in the fault-free run (Dropout's draws included);
        # the restarted process ran from the snapshot's step.
        assert res["losses"] == res["reference_losses"][BACK if r == 1 else 0 :]
    for r in (0, 2):
        res = job[r]
        assert res["results"] == (
            [[0, True, 1, None, 0], [RAISE, True, 2, None, 1]]
            + [[s, True, 1, None, 1] for s in range(RAISE + 1, KILL)]
            + [[KILL, False, 1, BACK, 2]]
            + [[s, True, 1, None, 2] for s in range(BACK, STEPS)]
        )
        assert res["recoveries"] == [[RAISE, 2, 1, []]]
        assert res["healed"] is None and res["resume_step"] is None
    back = job[1]
    assert back["life"] == 1 and back["resume_step"] == BACK
    assert back["healed"] == ["receiver", BACK, True]
    assert back["results"] == [[s, True, 1, None, 2] for s in range(BACK, STEPS)]
    assert "snapshots: every rank is back at step 4 (rank 1 receiver" in job.output


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_zero2_and_accumulation_redo_a_failed_step_bit_equal_and_the_preemption_checkpoint_resumes(job):
    for r in range(3):
        res = job[r]
        assert res["z2_digest"] == res["z2_reference"]
        assert res["z2_losses_equal"] is True
        assert res["z2_results"] == [[0, True, 1, None, 2], [1, True, 2, None, 3], [2, True, 1, None, 3]]
        # accelerator.save_state wrote step-3; a step moved the weights; load_state brought them back.
        assert res["z2_resume"] == ["step-3", True, True]
    # ZeRO-3, gradient_accumulation_steps=2: rank 1 raised in window 1's first micro-batch; the
    # window's second micro-batch committed it, failed, and the window ran again whole on a new engine.
    for r in range(3):
        res = job[r]
        assert res["acc_results"] == [
            [0, True, 1, None, 3, True],
            [1, True, 1, None, 3, False],
            [2, True, 1, None, 3, True],
            [3, True, 2, None, 4, False],
        ]
        assert res["acc_digest"] == res["acc_reference"]
        assert res["acc_losses_equal"] is True
        assert res["acc_global_steps"] == 2  # one engine step per window
    assert job[0]["refused_scheduler"].startswith(
        "recovering_step with the DeepSpeed plugin cannot carry a LambdaLR that Accelerate steps outside the engine"
    )
    assert 'the config\'s "scheduler" section or with DummyScheduler' in job[0]["refused_scheduler"]


# --- what is refused, in process: no process group, no prepare, no step ---------------------------


def _config(stage: int = 2, gas: Any = 1, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **zero},
    }


@pytest.fixture
def ds_accelerator(monkeypatch):
    """Makes Accelerators with the DeepSpeed plugin in this process, from a fresh Accelerate state,
    and leaves none behind (the state, the variable the plugin sets, transformers' ZeRO-3 flag)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        unset_hf_deepspeed_config()

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # monkeypatch restores what was there
    reset()

    def make(config: dict[str, Any], **kw: Any) -> Any:
        reset()
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), **kw)

    yield make
    reset()


def _module_and_optimizer() -> tuple[torch.nn.Module, Any]:
    from accelerate.utils import DummyOptim

    module = torch.nn.Linear(4, 1)
    return module, DummyOptim(module.parameters())


@pytest.mark.parametrize(
    ("config", "options", "said"),
    [
        (_config(stage=0), {}, ['ZeRO stage 0: set "zero_optimization": {"stage": 1}', "without the plugin (DDP"]),
        (_config(offload_optimizer={"device": "nvme"}), {}, ["offload_optimizer to NVMe", "offload to cpu or none"]),
        (_config(zero_hpz_partition_size=2), {}, ["hpZ", "zero_hpz_partition_size to 1"]),
        (_config(), {"allow_shrink": True}, ["allow_shrink=True cannot go on with DeepSpeed ZeRO", "heal=True"]),
        (
            _config(gas=2),
            {"heal": True},
            [
                "heal=True with the DeepSpeed plugin needs gradient_accumulation_steps=1, got 2",
                "Use heal=False (a failed window is still redone whole",
            ],
        ),
    ],
    ids=["stage0", "nvme", "hpz", "shrink", "heal-accumulation"],
)
def test_what_the_deepspeed_stepper_cannot_recover_is_refused_before_any_step(ds_accelerator, config, options, said):
    from ncclguard.integrations.accelerate import recovering_step

    acc = ds_accelerator(config)
    module, opt = _module_and_optimizer()
    with pytest.raises(ValueError) as refused:
        recovering_step(acc, module, opt, rebuild=_module_and_optimizer, **options)
    for words in said:
        assert words in str(refused.value)
    assert not torch.distributed.is_initialized()  # refused before any process group or engine


def test_heal_with_accumulation_asked_of_the_accelerator_is_refused_too(ds_accelerator):
    from ncclguard.integrations.accelerate import recovering_step

    acc = ds_accelerator(_config(gas="auto"), gradient_accumulation_steps=3)
    with pytest.raises(
        ValueError, match="heal=True with the DeepSpeed plugin needs gradient_accumulation_steps=1, got 3"
    ):
        recovering_step(acc, *_module_and_optimizer(), rebuild=_module_and_optimizer, heal=True)


def test_a_model_ncclguard_cannot_build_afresh_needs_rebuild(ds_accelerator):
    from ncclguard.integrations.accelerate import recovering_step

    acc = ds_accelerator(_config())
    with pytest.raises(ValueError) as refused:
        recovering_step(acc, *_module_and_optimizer())
    assert "here the model is a Linear" in str(refused.value)
    assert "Pass rebuild=lambda: (model, optimizer)" in str(refused.value)
    with pytest.raises(TypeError, match="rebuild must build and return"):
        recovering_step(acc, *_module_and_optimizer(), rebuild="model.pt")
    with pytest.raises(TypeError, match="the DeepSpeedEngine accelerator.prepare returned, or the torch.nn.Module"):
        recovering_step(acc, "model", None, rebuild=_module_and_optimizer)


def test_the_ddp_stepper_sends_a_deepspeed_accelerator_to_recovering_step(ds_accelerator):
    from ncclguard.integrations.accelerate.recovery import AcceleratorRecoveringStep

    acc = ds_accelerator(_config())
    with pytest.raises(ValueError, match=r"the DeepSpeed plugin: call recovering_step\(accelerator, model, optimizer"):
        AcceleratorRecoveringStep(acc, *_module_and_optimizer())
