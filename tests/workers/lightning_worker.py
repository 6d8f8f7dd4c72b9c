"""Rank side of tests/integrations/test_lightning_multirank.py: a real ``lightning.pytorch.Trainer`` on 2 gloo ranks.

Usage: ``lightning_worker.py watch|guard``. torchrun starts the ranks; Lightning's DDP strategy
(``accelerator="cpu"``, ``devices=2``, gloo) joins them. A tiny regression model, 6 training
steps, validation every 2 steps (2 batches), ``NcclGuardCallback`` on every rank.

- ``watch``: the watchdog alone (``hang_timeout_s=1.5``, ``heartbeat_s=0.3``). (1) At the first
  validation rank 1 is slow in ``validation_step`` while rank 0 goes back to training, into DDP's
  gradient all_reduce; (2) at the checkpoint of step 4 rank 0 is slow after the save (an upload,
  say) while rank 1 waits in the barrier that follows it. Each slow rank goes on once the
  watchdog's report of its incident is merged (bounded).
- ``guard``: ``eval_timeout_s=2``. At the first validation rank 1 stalls for 30 s in
  ``validation_step`` (its metric is logged with ``sync_dist=True``, so rank 0 blocks in the
  epoch-end reduction). The validation is skipped on both ranks by the deadline; training and the
  later validations go on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import rankkit
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from rankkit import put
from torch.utils.data import DataLoader, TensorDataset

import ncclguard
from ncclguard.integrations.lightning import NcclGuardCallback
from ncclguard.recording.phase import current_phase

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
HEARTBEAT_S = 0.3
HANG_S = 1.5
EVAL_TIMEOUT_S = 2.0
STALL_S = 30.0  # far past the deadline: only the guard can end it in time
BOUND_S = 20.0  # how long a slow rank waits at most for the watchdog's report
STEPS, VAL_EVERY = 6, 2
SLOW_EVAL_PHASE, SLOW_SAVE_PHASE = "eval step=2 > batch=0", "train step=4 > save step=4"


def reported(culprit_phase: str) -> bool:
    """A merged report on disk names a culprit in ``culprit_phase`` (this rank, slow there)."""
    for path in (OUT / "incidents").glob("*/incident.json"):
        try:
            culprits = json.loads(path.read_text())["culprits"]
        except (OSError, ValueError, KeyError):  # being written
            continue
        if any(c["phase"] == culprit_phase for c in culprits):
            return True
    return False


class Regression(LightningModule):
    def __init__(self, scenario: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.scenario = scenario
        self.stalls: list[float] = []
        self.training_flags: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.training_flags.append(self.training)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        first = self.global_step == VAL_EVERY and batch_idx == 0 and self.global_rank == 1
        if first and self.scenario == "watch":
            rankkit.fault_fired("slow in a validation step")
            self.stalls.append(time.time())
            rankkit.when(lambda: reported(SLOW_EVAL_PHASE), BOUND_S).wait(BOUND_S)  # MARK: slow-eval
            self.stalls.append(time.time())  # [start, end] of the slow part
        elif first and self.scenario == "guard":
            rankkit.fault_fired("stall in a validation step")
            self.stalls.append(time.time())
            time.sleep(STALL_S)  # MARK: stall
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # guard: the reduction is a collective on the default group, which the guard bounds.
        self.log("val_loss", loss, sync_dist=self.scenario == "guard")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowUpload(Callback):
    """Rank 0 does slow work of its own after the save of step 4 (inside ``save_checkpoint``)."""

    def __init__(self) -> None:
        self.started: list[float] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 4:
            rankkit.fault_fired("a slow upload after the save")
            self.started.append(time.time())
            rankkit.when(lambda: reported(SLOW_SAVE_PHASE), BOUND_S).wait(BOUND_S)  # MARK: upload
            self.started.append(time.time())  # [start, end] of the slow part


class Probe(Callback):
    """Records the phase and watchdog the ranks see from inside the training loop."""

    def __init__(self) -> None:
        self.phases: list[str] = []
        self.watchdog_running: list[bool] = []
        self.incidents: list[dict] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.watchdog_running.append(ncclguard.current_watchdog() is not None)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.phases.append(current_phase())

    def on_fit_end(self, trainer, pl_module) -> None:  # before the callbacks' teardown
        watchdog = ncclguard.current_watchdog()
        self.incidents = watchdog.incidents if watchdog is not None else None


def loader(rank: int, seed: int, n: int) -> DataLoader:
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(n, 8, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    scenario = sys.argv[1]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank = int(os.environ["RANK"])
    if scenario == "watch":
        guard = NcclGuardCallback(
            # peer_timeout_s: liveness is not under test; a busy 2-core machine may delay a beat.
            watchdog={
                "heartbeat_s": HEARTBEAT_S,
                "hang_timeout_s": HANG_S,
                "peer_timeout_s": 15,
                "incident_dir": OUT / "incidents",
            }
        )
    else:
        # A watchdog too, with a hang timeout past the deadline: the guard ends the stall first.
        guard = NcclGuardCallback(
            eval_timeout_s=EVAL_TIMEOUT_S,
            watchdog={"heartbeat_s": 0.5, "hang_timeout_s": 20, "incident_dir": OUT / "incidents"},
        )
    probe, upload = Probe(), SlowUpload()
    callbacks = [guard, probe]
    if scenario == "watch":
        callbacks += [upload, ModelCheckpoint(dirpath=OUT / f"ckpt{rank}", every_n_train_steps=4, save_top_k=-1)]
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        max_steps=STEPS,
        val_check_interval=VAL_EVERY,
        limit_val_batches=2,
        num_sanity_val_steps=1 if scenario == "guard" else 0,  # guard: the sanity check runs guarded too
        callbacks=callbacks,
        logger=CSVLogger(OUT / "logs", name=scenario, version=0),
        enable_checkpointing=scenario == "watch",
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(scenario)
    trainer.fit(model, loader(rank, 100, 64), loader(rank, 200, 8))
    put("global_step", trainer.global_step)
    put("digest", digest(model))
    put("stalls", model.stalls)
    put("upload_started", upload.started)
    put("training_flags", model.training_flags)
    put("phases", probe.phases)
    put("watchdog_running", probe.watchdog_running)
    put("watchdog_after_fit", ncclguard.current_watchdog() is not None)
    put("skipped", [dataclasses.asdict(skip) for skip in guard.skipped])
    report = guard.last_eval_report
    put("last_report_ok", None if report is None else report.ok)
    put("callback_metrics", {k: float(v) for k, v in trainer.callback_metrics.items()})
    put("incidents", probe.incidents)
    rankkit.done()


if __name__ == "__main__":
    sys.exit(main())
