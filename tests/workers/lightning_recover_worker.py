"""Rank side of tests/integrations/test_lightning_recover_multirank.py: ``NcclGuardCallback(recover=True)`` on a
real ``lightning.pytorch.Trainer``, 3 gloo ranks under torchrun, CPU, DDP (the strategy's group timeout
60 s, never lowered by hand; the callback's ``collective_timeout`` bounds a step's collectives at 3 s).

Usage: ``lightning_recover_worker.py redo|shrink|accumulate``. A model of 0.4M parameters with BatchNorm (buffers DDP
broadcasts) and Dropout (the RNG), SGD with momentum and a StepLR scheduler, 6 steps; Lightning
inserts its DistributedSampler.

- ``redo``: first a plain Lightning fit (no ncclguard), the reference; then the same fit from the
  same start with ``recover=True`` and two faults: at step 2 rank 2 stalls 9 s in
  ``training_step`` (3x the step bound: ranks 0-1 time out in DDP's collectives), at step 4
  rank 1 raises in ``training_step``. Every rank must redo both steps on a rebuilt world and end
  bit-equal to the reference.
- ``shrink``: ``recover=True, allow_shrink=True``; at step 2 rank 2 is stuck until ranks 0-1 are
  done. They go on as a world of 2; rank 2 then finds itself left out and exits 0.
- ``accumulate``: as ``redo`` with ``accumulate_grad_batches=3`` (a step is a window of 3
  micro-batches, the first two under DDP's ``no_sync``): at step 2 rank 2 stalls 9 s in the
  window's first micro-batch (no collective in it: the others wait at the third's gradient
  all_reduce), at step 4 rank 1 raises in the second. Every rank redoes the whole window of both
  steps on a rebuilt world and ends bit-equal to the plain fit with the same accumulation.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import rankkit
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from rankkit import put
from torch.utils.data import DataLoader, TensorDataset

from ncclguard.integrations.lightning import NcclGuardCallback
from ncclguard.recovery.rebuild import generation

rankkit.rank = lambda: int(os.environ["RANK"])  # a rebuild renumbers; faults and files go by launch rank
OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
ME = int(os.environ["RANK"])
BOUND_STEP_S = 3.0  # NcclGuardCallback's collective_timeout
STALL_S = 9.0  # 3x the step bound
STEPS = 6
WIDTH = 640


class Net(LightningModule):
    def __init__(self, faults: dict[int, str], accumulate: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 0.4M parameters, 1.7 MB of gradients: DDP's rebuilt layout has 2 buckets (the first of 1 MiB).
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, WIDTH),
            torch.nn.BatchNorm1d(WIDTH),
            torch.nn.Tanh(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.Tanh(),
            torch.nn.Linear(WIDTH, 1),
        )
        self.faults = faults  # by step, or (accumulate > 1) by step * accumulate + micro-batch
        self.accumulate = accumulate
        self.tries: dict[int, int] = {}
        self.seen: list[list[int]] = []  # [step, generation, world size] of each training_step run
        self.micro_seen: list[list[int]] = []  # [step, micro-batch, generation] of each run

    def training_step(self, batch, batch_idx):
        step, micro = self.trainer.global_step, batch_idx % self.accumulate
        where = step if self.accumulate == 1 else step * self.accumulate + micro
        self.tries[where] = self.tries.get(where, 0) + 1
        self.seen.append([step, generation(), dist.get_world_size()])
        self.micro_seen.append([step, micro, generation()])
        if self.tries[where] == 1:
            fault = self.faults.get(where)
            if fault is not None:
                rankkit.fault_fired(f"{fault} at step {step}")
            if fault == "stall":
                time.sleep(STALL_S)
            elif fault == "raise":
                raise RuntimeError(f"rank {ME}: a bad batch at step {step}")
            elif fault == "stuck":
                stuck_until_survivors_done()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)  # the epoch mean must not count a failed try
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Counts(Callback):
    """Counts optimizer steps as Lightning runs them (once each, if nothing is applied twice)."""

    def __init__(self) -> None:
        self.before_optimizer_step = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before_optimizer_step += 1


def stuck_until_survivors_done() -> None:
    store, deadline = rankkit._job_store(), time.monotonic() + 200
    keys = ["rankkit/survivors-done-0", "rankkit/survivors-done-1"]
    while time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.2)
    put("woke_after_survivors", store.check(keys))
    rankkit.save()  # the engine's left-out policy ends this rank with status 0; torchrun's status 0 shows it


def data(accumulate: int = 1) -> DataLoader:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3 * STEPS * accumulate * 4, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=4)


def flat(tensors) -> torch.Tensor:
    return torch.cat([torch.zeros(0, dtype=torch.float64)] + [t.detach().reshape(-1).double() for t in tensors])


def fit(
    name: str, faults: dict[int, str], callback: NcclGuardCallback | None, accumulate: int = 1
) -> tuple[Net, Trainer, Counts]:
    model, counts = Net(faults, accumulate), Counts()
    trainer = Trainer(
        accelerator="cpu",
        devices=3,
        # DDP's defaults (find_unused_parameters=False): its buckets are rebuilt after the first
        # step, and a re-wrapped DDP is given the old ones (docs/reference/recovery-mechanism.md,
        # "Bit-equality and DDP's buckets").
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[c for c in (callback, counts) if c is not None],
        logger=CSVLogger(OUT / "logs", name=name, version=0) if callback is not None else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data(accumulate))
    return model, trainer, counts


def results(model: Net, trainer: Trainer, counts: Counts, guard: NcclGuardCallback | None) -> dict:
    return {
        "global_step": trainer.global_step,
        "before_optimizer_step": counts.before_optimizer_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "seen": model.seen,
        "micro_seen": model.micro_seen,
        "train_loss_epoch": float(trainer.callback_metrics["train_loss_epoch"]),
        "recoveries": [asdict(r) for r in guard.recoveries] if guard is not None else None,
        "recover_metrics": {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("ncclguard_recover_")
        },
        "trainer_ranks": [trainer.global_rank, trainer.world_size],
    }


def equal_across_ranks(mine: torch.Tensor) -> bool:
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone)


def redo() -> None:
    reference, ref_trainer, ref_counts = fit("reference", {}, None)
    put("reference", results(reference, ref_trainer, ref_counts, None))
    guard = NcclGuardCallback(
        watchdog=False, recover=True, collective_timeout=BOUND_STEP_S, commit_timeout=30, rebuild_timeout=30
    )
    faults = {2: "stall"} if ME == 2 else {4: "raise"} if ME == 1 else {}
    model, trainer, counts = fit("redo", faults, guard)
    put("faulty", results(model, trainer, counts, guard))
    # Bit for bit: the parameters, and this rank's BatchNorm statistics (its own batches since
    # DDP's last broadcast of rank 0's buffers, so they differ across ranks but not across runs).
    put("params_equal_to_reference", torch.equal(flat(model.parameters()), flat(reference.parameters())))
    put("buffers_equal_to_reference", torch.equal(flat(model.buffers()), flat(reference.buffers())))
    put("equal_across_ranks", equal_across_ranks(flat(model.parameters())))
    put("final", [dist.get_rank(), dist.get_world_size(), generation()])
    rankkit.done()


def accumulate() -> None:
    acc = 3
    reference, ref_trainer, ref_counts = fit("reference", {}, None, acc)
    put("reference", results(reference, ref_trainer, ref_counts, None))
    guard = NcclGuardCallback(
        watchdog=False, recover=True, collective_timeout=BOUND_STEP_S, commit_timeout=30, rebuild_timeout=30
    )
    # Step 2's first micro-batch (no_sync) on rank 2, step 4's second (no_sync) on rank 1.
    faults = {2 * acc + 0: "stall"} if ME == 2 else {4 * acc + 1: "raise"} if ME == 1 else {}
    model, trainer, counts = fit("accumulate", faults, guard, acc)
    put("faulty", results(model, trainer, counts, guard))
    put("params_equal_to_reference", torch.equal(flat(model.parameters()), flat(reference.parameters())))
    put("buffers_equal_to_reference", torch.equal(flat(model.buffers()), flat(reference.buffers())))
    put("equal_across_ranks", equal_across_ranks(flat(model.parameters())))
    put("final", [dist.get_rank(), dist.get_world_size(), generation()])
    rankkit.done()


def shrink() -> None:
    guard = NcclGuardCallback(
        watchdog=False,
        recover=True,
        allow_shrink=True,
        collective_timeout=BOUND_STEP_S,
        commit_timeout=8,
        rebuild_timeout=8,
    )
    model, trainer, counts = fit("shrink", {2: "stuck"} if ME == 2 else {}, guard)
    put("left_out_rank_came_back", True)  # never on rank 2: the callback ends it
    put("faulty", results(model, trainer, counts, guard))
    put("equal_across_ranks", equal_across_ranks(flat(model.parameters())))
    put("final", [dist.get_rank(), dist.get_world_size(), generation()])
    rankkit.save()
    rankkit.announce(f"survivors-done-{ME}")
    rankkit.done()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    {"redo": redo, "shrink": shrink, "accumulate": accumulate}[sys.argv[1]]()
