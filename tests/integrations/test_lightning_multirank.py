"""NcclGuardCallback on a real ``lightning.pytorch.Trainer``: 2 gloo ranks under torchrun, CPU, DDP.

tests/workers/lightning_worker.py trains a tiny regression model for 6 steps with validation
every 2 steps. ``watch``: the watchdog alone names a rank slow in its validation, then a rank slow
after a checkpoint save. ``guard``: with ``eval_timeout_s`` a validation stalled on one rank is
skipped on both by the deadline and training goes on. The pure helpers are checked without ranks.
"""

from __future__ import annotations

import csv
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from harness import run_ranks
from pydantic import ValidationError

from ncclguard import WatchdogConfig
from ncclguard.integrations.lightning import NcclGuardCallback, timeout_problems, watchdog_config
from ncclguard.recording.phase import current_phase

HANG_S = 1.5  # as in the worker
EVAL_TIMEOUT_S = 2.0
STALL_S = 30.0
BOUND_S = 20.0
WORKER = "lightning_worker.py"


def mark(name: str) -> int:
    source = (Path(__file__).parents[1] / "workers" / WORKER).read_text().splitlines()
    (line,) = [i + 1 for i, text in enumerate(source) if text.endswith(f"# MARK: {name}")]
    return line


@pytest.fixture(scope="module")
def watch():
    return run_ranks("lightning_worker", 2, "watch", timeout_s=240)


@pytest.fixture(scope="module")
def guard():
    return run_ranks("lightning_worker", 2, "guard", timeout_s=240)


def incidents(job) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((job.out_dir / "incidents").glob("*/incident.json"))]


def incident_of(job, culprit_phase: str) -> dict:
    """The one incident whose culprit is in ``culprit_phase`` (on a loaded machine a slow
    collective elsewhere, at start-up say, may be an incident too: hang_timeout_s is 1.5 s)."""
    (inc,) = [i for i in incidents(job) if [c["phase"] for c in i["culprits"]] == [culprit_phase]]
    return inc


@pytest.mark.multirank
def test_a_rank_slow_in_validation_is_named_while_the_other_waits_in_lightnings_next_collective(watch):
    first = incident_of(watch, "eval step=2 > batch=0")
    (culprit,) = first["culprits"]
    assert (culprit["rank"], culprit["why"], culprit["phase"]) == (1, "behind", "eval step=2 > batch=0")
    assert culprit["site"].endswith(f"{WORKER}:{mark('slow-eval')}")
    assert first["victims"] == [0]
    (finding,) = first["findings"]
    # Lightning 2.6 broadcasts a SIGTERM flag from rank 0 before every training batch: rank 0,
    # back in training, waits there (a Python collective) before it reaches DDP's all_reduce.
    assert (finding["kind"], finding["op"], finding["phase"]) == ("desync", "broadcast", "train step=2")
    assert finding["site"].endswith("lightning/pytorch/loops/training_epoch_loop.py:265")
    slow_since, slow_until = watch[1]["stalls"]
    # Reported after the hang timeout, while rank 1 was still slow (it waits for this report).
    assert slow_since + HANG_S <= first["written_at"] <= slow_until < slow_since + BOUND_S


@pytest.mark.multirank
def test_a_rank_slow_after_a_checkpoint_save_is_named_in_its_save_phase(watch):
    second = incident_of(watch, "train step=4 > save step=4")
    (culprit,) = second["culprits"]
    assert (culprit["rank"], culprit["phase"]) == (0, "train step=4 > save step=4")
    assert culprit["site"].endswith(f"{WORKER}:{mark('upload')}")
    (finding,) = second["findings"]
    # The barrier Trainer.save_checkpoint ends with, on the rank that did not write.
    assert (finding["op"], finding["waiting"]) == ("barrier", [1])
    assert finding["site"].endswith("lightning/pytorch/strategies/ddp.py:303")
    slow_since, slow_until = watch[0]["upload_started"]
    assert slow_since + HANG_S <= second["written_at"] <= slow_until < slow_since + BOUND_S


@pytest.mark.multirank
def test_with_the_watchdog_alone_training_finishes_and_the_callback_cleans_up(watch):
    for r in (0, 1):
        res = watch[r]
        assert res["global_step"] == 6 and res["skipped"] == []
        assert res["watchdog_running"] == [True] * 6 and res["watchdog_after_fit"] is False
        assert len(res["incidents"]) >= 2  # this rank took part in both (see above)
    assert watch[0]["digest"] == watch[1]["digest"]
    # The validation phase, as the ranks saw it from inside a validation batch.
    assert watch[0]["phases"] == ["eval step=2", "eval step=4", "eval step=6"]


@pytest.mark.multirank
def test_a_stalled_validation_is_skipped_on_every_rank_by_the_deadline(guard):
    for r in (0, 1):
        res = guard[r]
        (skip,) = res["skipped"]
        assert skip["step"] == 2
        # Not before the deadline, and long before rank 1's 30 s stall would have ended (the
        # guard's bound is the deadline plus the verdict's grace, max(2, timeout/20) s; measured
        # times are in docs/reference/integrations-lightning.md).
        assert EVAL_TIMEOUT_S <= skip["elapsed_s"] < STALL_S / 2
        # The guard gets what is left of the 2 s deadline when it starts (1.99 s on a loaded machine),
        # never more; how much is left depends on how fast the machine got there, so no lower bound.
        left = re.search(r"rank 1: DeadlineExceeded: the evaluation ran past its ([0-9.]+) s deadline", skip["reason"])
        assert left is not None and 0.0 < float(left.group(1)) <= 2.0, skip["reason"]
        assert res["callback_metrics"]["eval/evaluation_failed"] == 1.0


@pytest.mark.multirank
def test_after_a_skip_training_reaches_max_steps_and_later_validations_run(guard):
    for r in (0, 1):
        res = guard[r]
        assert res["global_step"] == 6
        assert res["training_flags"] == [True] * 6  # train mode restored after the interrupted run
        assert res["incidents"] == [] and res["watchdog_after_fit"] is False
        assert res["last_report_ok"] is True  # the validation at step 6 went through the guard
    assert guard[0]["digest"] == guard[1]["digest"]
    # The sanity check went through the guard too; rank 1 was interrupted inside the first
    # validation after it, so it saw only the two later ones.
    assert guard[0]["phases"] == ["sanity_check step=0", "eval step=2", "eval step=4", "eval step=6"]
    assert guard[1]["phases"] == ["sanity_check step=0", "eval step=4", "eval step=6"]
    # The synced val_loss of the last validation is the same on both ranks.
    assert guard[0]["callback_metrics"]["val_loss"] == guard[1]["callback_metrics"]["val_loss"]
    rows = list(csv.DictReader((guard.out_dir / "logs" / "guard" / "version_0" / "metrics.csv").open()))
    failed = [(row["step"], row["eval/evaluation_failed"]) for row in rows if row["eval/evaluation_failed"]]
    assert failed == [("2", "1.0")]
    assert [row["step"] for row in rows if row["val_loss"]] == ["3", "5"]


# --- pure helpers, no ranks -----------------------------------------------------------------------


def test_watchdog_argument_forms():
    assert watchdog_config(False) is None
    assert watchdog_config(None) == WatchdogConfig() == watchdog_config(True)
    given = WatchdogConfig(heartbeat_s=1, hang_timeout_s=4)
    assert watchdog_config(given) is given
    assert watchdog_config({"heartbeat_s": 1, "hang_timeout_s": 4}) == given
    with pytest.raises(TypeError, match="watchdog must be a WatchdogConfig"):
        watchdog_config("on")
    with pytest.raises(ValidationError, match="must be > heartbeat_s"):
        NcclGuardCallback(watchdog={"hang_timeout_s": 5})


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), ("soon", TypeError)])
def test_eval_timeout_is_checked_when_the_callback_is_built(bad, error):
    with pytest.raises(error):
        NcclGuardCallback(eval_timeout_s=bad)
    assert NcclGuardCallback(eval_timeout_s=timedelta(minutes=2)).eval_timeout_s == 120.0


def test_timeout_problems_name_what_is_not_below_the_group_timeout():
    assert timeout_problems(1800, 600, 300) == []
    assert timeout_problems(None, 9999, 9999) == []  # the strategy's timeout is unknown
    (eval_problem,) = timeout_problems(600, 600, 300)
    assert eval_problem.startswith("evaluation deadline (600 s) is not below the process-group timeout (600 s)")
    (hang_problem,) = timeout_problems(600, None, 900)
    assert hang_problem.startswith("watchdog hang timeout (900 s) is not below the process-group timeout")


def fit_alone(callback: NcclGuardCallback, seen: list) -> object:
    """A 2-step fit in this process (one device, no process group), recording what a step sees."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    import ncclguard

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            seen.append((current_phase(), ncclguard.current_watchdog()))
            return self.net(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            seen.append((current_phase(), ncclguard.current_watchdog()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.ones(4, 2)), batch_size=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data, data)
    return trainer


def test_alone_the_watchdog_runs_from_setup_to_teardown_and_the_wrapping_is_undone(tmp_path):
    import ncclguard

    seen: list = []
    settings = {"heartbeat_s": 0.2, "hang_timeout_s": 5, "incident_dir": tmp_path}
    callback = NcclGuardCallback(eval_timeout_s=30, watchdog=settings)
    trainer = fit_alone(callback, seen)
    phases = [p for p, _ in seen]
    assert phases == ["train step=0", "train step=1", "eval step=2 > batch=0"]
    assert all(w is not None for _, w in seen) and len({id(w) for _, w in seen}) == 1
    assert ncclguard.current_watchdog() is None and callback.watchdog is None
    assert "save_checkpoint" not in vars(trainer)
    assert "run" not in vars(trainer.fit_loop.epoch_loop.val_loop)
    assert callback.last_eval_report.ok and callback.skipped == []
    assert current_phase() == ""


def test_alone_a_watchdog_started_by_the_user_is_used_and_left_running(tmp_path):
    import ncclguard

    mine = ncclguard.start_watchdog(heartbeat_s=0.2, hang_timeout_s=5, incident_dir=tmp_path)
    try:
        seen: list = []
        callback = NcclGuardCallback()
        fit_alone(callback, seen)
        assert {id(w) for _, w in seen} == {id(mine)}
        assert callback.watchdog is None and ncclguard.current_watchdog() is mine
    finally:
        mine.stop()
