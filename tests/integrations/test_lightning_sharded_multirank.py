"""NcclGuardCallback(recover=True, heal=True) on a Lightning fit with ModelParallelStrategy (FSDP2 applied
in configure_model): 3 gloo ranks under torchrun, each under its supervisor with a warm spare. A stalled
step is redone on a world whose module was sharded again from each rank's shards; a killed rank comes
back from its buddy's in-memory snapshot, every rank goes back to that snapshot's step, and the fit
ends bit-equal to a fault-free one; the module holds 2.1M parameters with dropout. Rank side:
tests/workers/lightning_sharded_worker.py.

Without ranks: the strategies Lightning itself refuses on the CPU (FSDPStrategy, DeepSpeedStrategy),
and what the callback refuses before any step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from harness import run_ranks

from ncclguard.integrations.lightning.recovery import check_recoverable

pytestmark = pytest.mark.timeout(480)  # past each launch's own hang guard

STEPS, STALL_AT, KILL_AT, SNAPSHOT = (
    6,
    1,
    3,
    2,
)  # the worker's; snapshots every 2 steps: the newest at the kill is of step 2
SUPERVISE = ["--restarts=1", "--warm-spare", "--preload=lightning.pytorch"]


@pytest.fixture(scope="module")
def job():
    # A refused fit, a reference fit, then a fit with a 9 s stall and a SIGKILL: 50-95 s here, loaded (3 runs).
    return run_ranks("lightning_sharded_worker", 3, supervise=SUPERVISE, timeout_s=400)


@pytest.mark.multirank
def test_a_stalled_step_is_redone_and_a_killed_rank_heals_from_its_buddy_bit_equal(job):
    assert "exited -9; restart 1 of 1" in job.output and "restart 1: the warm spare (pid " in job.output
    life0 = json.loads((job.out_dir / "life0-rank1.json").read_text())
    for r in range(3):
        res = job[r]
        first = life0 if r == 1 else res
        digest = {step: d for step, _, d in first["reference_seen"]}  # this rank's batch at each step, fault-free
        assert [s for s, _, _ in first["reference_seen"]] == list(range(STEPS))
        # Every training_step saw the batch the fault-free fit saw at that step: after the rollback too
        # (the loader set up again and its batches up to the loop's position drawn and dropped).
        assert all(d == digest[step] for step, _, d in res["seen"])
        assert res["global_step"] == STEPS
        assert res["lr"] == first["reference_lr"] == 0.05 * 0.5**3  # the scheduler, in the snapshots too
        assert res["sharded"] == ["DTensor"]
        assert res["snapshot_every"] == SNAPSHOT
        assert res["world"] == [r, 3, 2]
        assert res["equal_to_reference"] is True  # full parameters and Adam's full state, bit for bit
    for r in (0, 2):
        res = job[r]
        # Step 1 ran twice (the redo in generation 1), step 3 once before the kill; then every rank
        # went back to the snapshot of step 2 and ran on from there in generation 2.
        assert [s[:2] for s in res["seen"]] == [[0, 0], [1, 0], [1, 1], [2, 1], [3, 1]] + [
            [s, 2] for s in range(2, STEPS)
        ]
        assert res["recoveries"] == [[STALL_AT, 2, 1, []]]
        # The engine went back to SNAPSHOT (the batches seen above); the step Lightning began there consumed it.
        assert res["rewind_to"] is None and res["resume_step"] is None
    back = job[1]
    assert back["life"] == 1 and back["resume_step"] == SNAPSHOT
    assert [s[:2] for s in back["seen"]] == [[s, 2] for s in range(SNAPSHOT, STEPS)]
    assert [s[:2] for s in life0["seen"]] == [[0, 0], [1, 0], [1, 1], [2, 1], [3, 1]]


@pytest.mark.multirank
def test_a_configure_model_guarded_by_a_flag_is_refused_when_fit_starts(job):
    for r in (0, 2):
        text = job[r]["flag_guard_refusal"]
        assert text.startswith("NcclGuardCallback(recover=True): configure_model, run again on fresh unsharded")
        assert "net.0.weight is sharded live, not in the copy" in text and "isinstance(self.net, FSDPModule)" in text


# --- without ranks ----------------------------------------------------------------------------------


def test_lightning_refuses_its_fsdp_and_deepspeed_strategies_on_the_cpu():
    """What docs/reference/integrations-lightning.md says: Lightning 2.6 runs these two on CUDA only, so nothing
    here can run them."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    with pytest.raises(ValueError, match="The strategy `fsdp` requires a GPU accelerator"):
        Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), logger=False)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(), logger=False)
    with pytest.raises(RuntimeError, match="The DeepSpeed strategy is only supported on CUDA GPUs"):
        trainer.strategy.setup_environment()


def test_the_callback_refuses_fsdp1_deepspeed_tensor_parallel_and_a_shrink_with_fsdp2():
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    module = SimpleNamespace(automatic_optimization=True)
    for strategy in (FSDPStrategy(), DeepSpeedStrategy()):
        with pytest.raises(ValueError, match=f"does not redo steps under {type(strategy).__name__}: Lightning 2.6"):
            check_recoverable(SimpleNamespace(strategy=strategy), module)
    tp = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 \\(tensor parallelism is not re-applied\\)"):
        check_recoverable(SimpleNamespace(strategy=tp), module)
    fsdp2 = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="allow_shrink=True cannot go with ModelParallelStrategy"):
        check_recoverable(SimpleNamespace(strategy=fsdp2), module, allow_shrink=True)
    check_recoverable(SimpleNamespace(strategy=fsdp2), module)  # what recover=True accepts
