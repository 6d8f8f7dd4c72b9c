"""Rank side of tests/integrations/test_lightning_sharded_multirank.py: ``NcclGuardCallback(recover=True, heal=True)``
on a Lightning fit with ``ModelParallelStrategy`` (FSDP2 applied in ``configure_model``), 3 gloo ranks
under torchrun, each under its supervisor (``python -m ncclguard.supervise --restarts=1 --warm-spare``).

Every first life starts with the refusal of a ``configure_model`` guarded by a flag (it would not
shard fresh copies after a rebuild): ``fit`` raises on every rank when it starts, before any step.

Every first life fits the reference (no ncclguard, the same seed and data), then the same fit with the
callback and two faults: at step 1 rank 2 stalls 9 s in ``training_step`` (3x the step bound; the
others time out in FSDP2's collectives): every rank shards the module again on the rebuilt world
from its own shards and redoes step 1. At step 3 rank 1 SIGKILLs itself; its supervisor's warm spare
runs this script again (``NCCLGUARD_RESTART_COUNT=1``), which fits with the callback only: its
Lightning sets up on the stand-in world, joins the survivors' rebuild as its fit loop starts, shards
its module on the joined world and takes its shards, Adam's and the fit loop's state and its
generators from the replica its buddy (rank 2) holds. The newest snapshot (one every 2 steps) is of
step 2, so the survivors go back to it too, and every rank enters the fit loop again at step 2.
Every rank records what each ``training_step`` ran (the step, the world generation, a digest of its
batch) and, at the end, the full parameters and Adam's full state (gathered), which must be
bit-equal to the reference's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from rankkit import put
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import ncclguard
from ncclguard.integrations.lightning import NcclGuardCallback

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
ME = int(os.environ["RANK"])  # the launch rank: a restarted process keeps it
rankkit.rank = lambda: ME
LIFE = ncclguard.restart_count()
WORLD, STEPS = 3, 6
STALL_AT, STALLER, STALL_S = 1, 2, 9.0
KILL_AT, VICTIM = 3, 1
WIDTH = 1024
BOUND_S = 3.0  # collective_timeout: 3x under the stall
REJOIN_S = 120.0  # hang guard: the survivors' rebuild waits this long for the restarted rank


class Net(LightningModule):
    def __init__(self, faults: bool = False, flag_guard: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(  # 2.1M parameters: a replica three times a fresh rank's state
            torch.nn.Linear(4, WIDTH),
            torch.nn.Tanh(),
            torch.nn.Dropout(0.2),  # the generators must be restored for the runs to be equal
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.Tanh(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.Tanh(),
            torch.nn.Linear(WIDTH, 1),
        )
        self.faults, self.flag_guard, self.sharded_once = faults, flag_guard, False
        self.tries: dict[int, int] = {}
        self.seen: list[list[Any]] = []  # [step, generation, batch digest] of each training_step run

    def configure_model(self) -> None:
        # Lightning asks configure_model to be idempotent; the guard looks at the module itself.
        if isinstance(self.net, FSDPModule) or (self.flag_guard and self.sharded_once):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.sharded_once = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        self.tries[step] = self.tries.get(step, 0) + 1
        x, y = batch
        self.seen.append([step, ncclguard.recovery.generation(), float(x.sum())])
        if self.faults and self.tries[step] == 1:
            if step == STALL_AT and ME == STALLER:
                rankkit.fault_fired(f"stall at step {step}")
                time.sleep(STALL_S)
            if step == KILL_AT and ME == VICTIM and LIFE == 0:
                rankkit.fault_fired(f"SIGKILL at step {step}")
                put("seen", self.seen)
                (OUT / f"life0-rank{ME}.json").write_text(json.dumps(rankkit._results))
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.05, betas=(0.8, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Stop(Callback):
    """Ends a fit at its start: for the refusal check, which needs no step."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        raise RuntimeError("the refusal was expected before this")


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(WORLD * STEPS * 4, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=4)


def trainer(callbacks: list[Callback]) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_steps=STEPS,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def full_state(model: Net, opt: torch.optim.Optimizer) -> torch.Tensor:
    """The full parameters and Adam's full state, gathered over the current world."""

    def full(t: torch.Tensor) -> torch.Tensor:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[operator]
        return t.detach().reshape(-1).double()

    parts = [full(p) for p in model.parameters()]
    for p in model.parameters():
        parts += [full(v) for _, v in sorted(opt.state[p].items())]
    return torch.cat(parts)


def refused_flag_guard() -> str:
    """A configure_model guarded by a flag: refused when fit starts, before any step."""
    try:
        seed_everything(0, workers=False)
        trainer([NcclGuardCallback(watchdog=False, recover=True), Stop()]).fit(Net(flag_guard=True), data())
    except ValueError as exc:
        return str(exc)
    return "not refused"


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    put("life", LIFE)
    reference = None
    if LIFE == 0:
        put("flag_guard_refusal", refused_flag_guard())
        seed_everything(0, workers=False)
        ref_model, ref_trainer = Net(), trainer([])
        ref_trainer.fit(ref_model, data())
        put("reference_seen", ref_model.seen)
        put("reference_lr", ref_trainer.optimizers[0].param_groups[0]["lr"])
        reference = full_state(ref_model, ref_trainer.optimizers[0])
    guard = NcclGuardCallback(
        watchdog=False,
        recover=True,
        heal=True,
        collective_timeout=BOUND_S,
        commit_timeout=60,
        rebuild_timeout=REJOIN_S,
        snapshot_every=2,
    )
    seed_everything(0, workers=False)
    model, fit = Net(faults=True), trainer([guard])
    fit.fit(model, data())
    engine = guard.recovery.engine
    put("seen", model.seen)
    put("global_step", fit.global_step)
    put("lr", fit.optimizers[0].param_groups[0]["lr"])
    put("recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in guard.recoveries])
    put("resume_step", engine.resume_step)
    put("rewind_to", engine.rewind_to)
    put("snapshot_every", engine.keeper.k if engine.keeper is not None else None)
    put("sharded", sorted({type(p).__name__ for p in model.parameters()}))
    put("world", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    mine = full_state(model, fit.optimizers[0])
    ref = reference if reference is not None and ME == 0 else torch.zeros_like(mine)
    dist.broadcast(ref, src=0)  # a restarted rank never ran the reference: rank 0's copy
    put("equal_to_reference", torch.equal(mine, ref))
    rankkit.done()


if __name__ == "__main__":
    main()
