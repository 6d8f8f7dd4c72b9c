"""NcclGuardCallback(recover=True) on a real ``lightning.pytorch.Trainer``: 3 gloo ranks under
torchrun, CPU, DDP, a step's collectives bounded at 3 s by the callback's ``collective_timeout`` (the
group keeps the strategy's 60 s). Rank side: tests/workers/lightning_recover_worker.py.

``redo``: a plain Lightning fit, then the same fit with a stall (rank 2, 9 s) at step 2 and an
exception (rank 1) at step 4: both steps are redone on every rank on a rebuilt world, and the run
ends bit-equal to the plain one (a drill, `make drills`: the same faults at the same steps, with the
same checks, stay in the suite in ``accumulate``, and the recovery's metrics in the logger in
``shrink``). ``shrink``: with ``allow_shrink=True`` rank 2 is stuck for good
at step 2; ranks 0-1 finish as a world of 2, rank 2 is left out and exits 0. ``accumulate``: with
``accumulate_grad_batches=3``, a stall in a window's first micro-batch and an exception in another's
second (both under DDP's ``no_sync``): each whole window is redone, bit-equal to the plain fit with
the same accumulation. The argument checks run without ranks.
"""

from __future__ import annotations

import csv

import pytest
from harness import HEALTH_KEY, run_ranks

from ncclguard.integrations.lightning import NcclGuardCallback
from ncclguard.integrations.lightning.recovery import check_recoverable

STEPS = 6
LR = 0.01  # the worker's SGD


@pytest.fixture(scope="module")
def redo():
    # Two fits, a 9 s stall and a 3 s timeout: 50 s here at load 3. Hang guard: over 3x that.
    return run_ranks("lightning_recover_worker", 3, "redo", timeout_s=240)


@pytest.fixture(scope="module")
def shrink():
    # 3 s timeout, 8 s commit, 8 s rebuild, then rank 2 wakes and leaves: 60 s here at load 3.
    return run_ranks("lightning_recover_worker", 3, "shrink", timeout_s=240)


@pytest.fixture(scope="module")
def accumulate():
    # Two fits of 6 windows of 3 micro-batches, a 9 s stall and a 3 s timeout: 35 s here alone.
    return run_ranks("lightning_recover_worker", 3, "accumulate", timeout_s=240)


def metric_rows(job, name: str) -> list[dict[str, str]]:
    path = job.out_dir / "logs" / name / "version_0" / "metrics.csv"
    return [row for row in csv.DictReader(path.open()) if row.get("ncclguard_recover_attempts")]


# A drill (`make drills`): the stall at step 2 and the exception at step 4 redone on every rank, the optimizer, the
# LR scheduler, the epoch's loss and BatchNorm's buffers as in the plain fit, bit-equal, stay in the suite in the
# accumulation test below (windows of 3 micro-batches); the recovery's metrics in the CSV logger, in the shrink test.
@pytest.mark.drill
@pytest.mark.multirank
def test_failed_steps_are_redone_on_every_rank_and_the_run_ends_bit_equal_to_a_plain_one(redo):
    for r in range(3):
        res = redo[r]
        ref, got = res["reference"], res["faulty"]
        assert ref["seen"] == [[s, 0, 3] for s in range(STEPS)]
        # Step 2 ran twice (the redo in generation 1), step 4 twice (generation 2); nothing else.
        assert got["seen"] == [[0, 0, 3], [1, 0, 3], [2, 0, 3], [2, 1, 3], [3, 1, 3], [4, 1, 3], [4, 2, 3], [5, 2, 3]]
        assert [(x["step"], x["attempts"], x["generation"], x["world_size"]) for x in got["recoveries"]] == [
            (2, 2, 1, 3),
            (4, 2, 2, 3),
        ]
        assert [x["failed_ranks"] for x in got["recoveries"]] == [[0, 1, 2], [0, 1, 2]]
        assert got["recoveries"][0]["elapsed_s"] >= 9.0  # the redo waited for the stalled rank
        # The optimizer and the per-step LR scheduler stepped once per step, as in the plain run.
        assert got["global_step"] == ref["global_step"] == STEPS
        assert got["before_optimizer_step"] == ref["before_optimizer_step"] == STEPS
        assert got["lr"] == ref["lr"] == pytest.approx(LR * 0.9**STEPS, rel=1e-12)
        # The failed tries' logged losses are not in the epoch mean: the same float as the plain run's.
        assert got["train_loss_epoch"] == ref["train_loss_epoch"]
        assert {k: v for k, v in got["recover_metrics"].items() if k != "ncclguard_recover_s"} == {
            "ncclguard_recover_attempts": 2.0,
            "ncclguard_recover_generation": 2.0,
            "ncclguard_recover_world_size": 3.0,
        }
        assert got["trainer_ranks"] == [r, 3]
        assert res["params_equal_to_reference"] is True  # bit for bit
        assert res["buffers_equal_to_reference"] is True  # BatchNorm statistics restored before each redo
        assert res["equal_across_ranks"] is True
        assert res["final"] == [r, 3, 2]
    rows = metric_rows(redo, "redo")  # rank 0's CSVLogger
    assert [
        (row["step"], row["ncclguard_recover_generation"], row["ncclguard_recover_world_size"]) for row in rows
    ] == [
        ("2", "1.0", "3.0"),
        ("4", "2.0", "3.0"),
    ]


@pytest.mark.multirank
def test_with_allow_shrink_the_survivors_finish_as_a_world_of_two(shrink):
    for r in (0, 1):
        got = shrink[r]["faulty"]
        assert got["seen"] == [[0, 0, 3], [1, 0, 3], [2, 0, 3], [2, 1, 2], [3, 1, 2], [4, 1, 2], [5, 1, 2]]
        ((step, attempts, gen, size, failed),) = [
            (x["step"], x["attempts"], x["generation"], x["world_size"], x["failed_ranks"]) for x in got["recoveries"]
        ]
        assert (step, attempts, gen, size, failed) == (2, 2, 1, 2, [0, 1, 2])
        assert got["global_step"] == got["before_optimizer_step"] == STEPS
        assert got["trainer_ranks"] == [r, 2]  # Lightning's rank and world size follow the shrink
        assert got["recover_metrics"]["ncclguard_recover_world_size"] == 2.0
        assert shrink[r]["equal_across_ranks"] is True
        assert shrink[r]["final"] == [r, 2, 1]
    stuck = shrink[2]
    # It woke after ranks 0-1 were done and never came back from fit: the callback ended it with
    # status 0 (run_ranks requires torchrun's status 0, which needs every rank's). Nothing else saved
    # but what rankkit adds to every rank's results (its world generation, its faults).
    assert {k: v for k, v in stuck.items() if k != HEALTH_KEY} == {"woke_after_survivors": True}
    assert stuck[HEALTH_KEY]["faults"] == ["stuck at step 2"]
    assert [(row["step"], row["ncclguard_recover_world_size"]) for row in metric_rows(shrink, "shrink")] == [
        ("2", "2.0")
    ]


@pytest.mark.multirank
def test_with_gradient_accumulation_the_whole_window_is_redone_and_the_run_ends_bit_equal(accumulate):
    windows = [[s, m] for s in range(STEPS) for m in range(3)]
    for r in range(3):
        res = accumulate[r]
        ref, got = res["reference"], res["faulty"]
        assert [x[:2] for x in ref["micro_seen"]] == windows
        # Step 2: its 3 micro-batches in generation 0 (rank 2 slept in the first), then all 3 again in
        # generation 1. Step 4: rank 1 raised in the second, so its third never ran; all 3 again in generation 2.
        first_try_4 = [[4, 0, 1], [4, 1, 1]] + ([] if r == 1 else [[4, 2, 1]])
        assert got["micro_seen"] == (
            [[s, m, 0] for s in range(3) for m in range(3)]
            + [[2, m, 1] for m in range(3)]
            + [[3, m, 1] for m in range(3)]
            + first_try_4
            + [[s, m, 2] for s in (4, 5) for m in range(3)]
        )
        assert [(x["step"], x["attempts"], x["generation"], x["world_size"]) for x in got["recoveries"]] == [
            (2, 2, 1, 3),
            (4, 2, 2, 3),
        ]
        assert got["recoveries"][0]["elapsed_s"] >= 9.0  # the redo waited for the stalled rank
        assert got["global_step"] == ref["global_step"] == STEPS
        assert got["before_optimizer_step"] == ref["before_optimizer_step"] == STEPS  # one step per window
        assert got["lr"] == ref["lr"] == pytest.approx(LR * 0.9**STEPS, rel=1e-12)
        assert got["train_loss_epoch"] == ref["train_loss_epoch"]  # the failed windows' logged losses are out
        assert res["params_equal_to_reference"] is True  # bit for bit: every micro-batch's gradient redone
        assert res["buffers_equal_to_reference"] is True
        assert res["equal_across_ranks"] is True
        assert res["final"] == [r, 3, 2]


# --- without ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"recover": 1}, TypeError, "recover must be a bool"),
        ({"recover": True, "allow_shrink": "yes"}, TypeError, "allow_shrink must be True or False"),
        ({"recover": True, "commit_timeout": 0}, ValueError, "commit_timeout must be a positive duration"),
        ({"recover": True, "rebuild_timeout": -1}, ValueError, "rebuild_timeout must be a positive duration"),
        ({"recover": True, "collective_timeout": 0}, ValueError, "collective_timeout must be a positive duration"),
        ({"recover": True, "max_attempts": 0}, ValueError, "max_attempts must be an int of at least 1"),
        ({"recover": True, "left_out": "stay"}, ValueError, "left_out must be 'exit' or 'raise'"),
        ({"allow_shrink": True}, ValueError, "allow_shrink needs recover=True"),
    ],
)
def test_bad_recover_arguments_are_refused_when_the_callback_is_built(kwargs, error, text):
    with pytest.raises(error, match=text):
        NcclGuardCallback(**kwargs)


def tiny(manual: bool = False):
    import torch
    from lightning.pytorch import LightningModule

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)
            self.automatic_optimization = not manual
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def trainer(**kwargs):
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_a_strategy_other_than_ddp_is_refused_in_setup_before_the_first_step():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    model = tiny()
    fit = trainer(devices=1, callbacks=[NcclGuardCallback(watchdog=False, recover=True)])
    with pytest.raises(
        ValueError, match="under the DDP strategy or ModelParallelStrategy \\(FSDP2\\) only, got SingleDeviceStrategy"
    ):
        fit.fit(model, DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2))
    assert model.steps == 0


def test_manual_optimization_is_refused_and_gradient_accumulation_is_accepted():
    # Checked on a DDP trainer that is built but not fitting: no process group in this process.
    with pytest.raises(ValueError, match="automatic_optimization=False"):
        check_recoverable(trainer(devices=1, strategy="ddp"), tiny(manual=True))
    check_recoverable(trainer(devices=1, strategy="ddp"), tiny())  # what recover=True accepts
    check_recoverable(trainer(devices=1, strategy="ddp", accumulate_grad_batches=2), tiny())
