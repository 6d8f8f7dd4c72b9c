"""Rank side of tests/integrations/test_heal_frameworks_multirank.py: a killed rank, restarted by its supervisor
(``python -m ncclguard.supervise --restarts 1 --warm-spare``) under torchrun, heals inside a
framework. Usage: ``heal_frameworks_worker.py accelerate|hf|lightning``.

Every rank trains STEPS steps with the framework's defaults; at step K launch rank 1 SIGKILLs
itself. Its supervisor posts the death (the survivors' commit settles without waiting for it) and
a warm spare runs this script again with ``NCCLGUARD_RESTART_COUNT=1``: the framework makes its
process group (a stand-in until the join), the recovery's join point joins the survivors' rebuild
and receives a live peer's state, and every rank redoes step K. At the end the ranks compare their
parameters (and, where the framework has them, the optimizer's state) bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import rankkit
import torch
import torch.distributed as dist
from rankkit import put

import ncclguard

OUT = Path(os.environ["NCCLGUARD_TEST_OUT"])
ME = int(os.environ["RANK"])  # the launch rank: a restarted process keeps it
LIFE = ncclguard.restart_count()
STEPS, K, VICTIM = 6, 3, 1
BOUND_S = 3.0  # collective_timeout: a survivor gloo leaves waiting fails its step by then
REJOIN_S = 120.0  # hang guard: the survivors' rebuild waits this long for the restarted rank
rankkit.rank = lambda: ME


def die_here(step: int, results: list[Any]) -> None:
    """Launch rank 1's first life dies at step K: its results so far are saved first."""
    if step == K and ME == VICTIM and LIFE == 0:
        rankkit.fault_fired(f"SIGKILL at step {step}")
        put("results", results)
        put("life", LIFE)
        (OUT / f"life0-rank{ME}.json").write_text(json.dumps(rankkit._results, default=str))
        os.kill(os.getpid(), signal.SIGKILL)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + ME)
    return torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 1, generator=g, dtype=torch.float64)


def flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def equal_across_ranks(mine: torch.Tensor) -> bool:
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], t) for t in everyone)


def optimizer_state(opt: Any) -> torch.Tensor:
    parts = [v for s in opt.state_dict()["state"].values() for k, v in sorted(s.items()) if torch.is_tensor(v)]
    return flat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def accelerate() -> None:
    from accelerate import Accelerator

    from ncclguard.integrations.accelerate import recovering_step

    accelerator = Accelerator(cpu=True)  # makes the process group (a restarted rank's: a stand-in)

    def prepared() -> tuple[torch.nn.Module, Any, Any]:
        # 0.16M float64 parameters, 1.3 MB of gradients: DDP's rebuilt layout has 2 buckets.
        torch.manual_seed(7)
        layers = [torch.nn.Linear(4, 400), torch.nn.Tanh(), torch.nn.Linear(400, 400), torch.nn.Tanh()]
        module = torch.nn.Sequential(*layers, torch.nn.Linear(400, 1)).double()
        return module, *accelerator.prepare(module, torch.optim.Adam(module.parameters(), lr=0.001))

    if LIFE == 0:  # the same loop with no fault and no ncclguard first (a restarted process skips it)
        reference, ref_model, ref_opt = prepared()
        for step in range(STEPS):
            x, y = batch(step)
            ref_opt.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(ref_model(x), y))
            ref_opt.step()
    module, model, opt = prepared()
    stepper = recovering_step(
        accelerator, model, opt, heal=True, collective_timeout=BOUND_S, commit_timeout=60, rebuild_timeout=REJOIN_S
    )
    results: list[Any] = []
    for step in range(stepper.resume_step or 0, STEPS):
        x, y = batch(step)

        def step_fn(m: torch.nn.Module, step: int = step, x: Any = x, y: Any = y) -> None:
            die_here(step, results)
            accelerator.backward(torch.nn.functional.mse_loss(m(x), y))

        res = stepper(step_fn, step=step)
        results.append([step, res.ok, res.attempts, res.generation, any(c.early for c in res.commits)])
    healed = stepper.healed
    put("results", results)
    put("life", LIFE)
    put("resume_step", stepper.resume_step)
    put("healed", None if healed is None else [healed.ok, healed.role, healed.step])
    put("recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in stepper.recoveries])
    put("world", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    put("params_equal_across_ranks", equal_across_ranks(flat(module.parameters())))
    put("optimizer_equal_across_ranks", equal_across_ranks(optimizer_state(opt)))
    if LIFE == 0:  # DDP's default buckets: every rank's new wrapper took the survivors' layout
        put("params_equal_to_reference", torch.equal(flat(module.parameters()), flat(reference.parameters())))


def hf() -> None:
    from hf_parts import Dataset, tiny_bert  # the HF tests' tiny dataset and model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ncclguard.integrations.hf import find_guard, guard_trainer

    class Killer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            die_here(state.global_step, [])

    args = TrainingArguments(  # HF's defaults, on the CPU with gloo: ddp_timeout stays 1,800 s
        output_dir=str(OUT / "hf"),
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=Dataset(96, seed=96), callbacks=[Killer()])
    guard_trainer(
        trainer,
        recover=True,
        heal=True,
        watchdog=False,
        collective_timeout=BOUND_S,
        commit_timeout=60,
        rebuild_timeout=REJOIN_S,
    )
    trainer.train()
    recovery = find_guard(trainer).recovery
    put("life", LIFE)
    put("global_step", trainer.state.global_step)
    put("losses", [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e])
    put("recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in recovery.recoveries])
    put("logged", [e for e in trainer.state.log_history if "ncclguard_recover_s" in e])
    put("world", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    put("params_equal_across_ranks", equal_across_ranks(flat(trainer.model.parameters())))
    put("optimizer_equal_across_ranks", equal_across_ranks(optimizer_state(trainer.optimizer)))
    put("lr", trainer.lr_scheduler.get_last_lr())


def lightning() -> None:
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ncclguard.integrations.lightning import NcclGuardCallback

    class Net(LightningModule):
        def __init__(self, guarded: bool = True) -> None:
            super().__init__()
            self.guarded = guarded  # False: the reference fit, with no fault and no ncclguard
            torch.manual_seed(0)
            # 0.4M parameters, 1.7 MB of gradients: DDP's rebuilt layout has 2 buckets (the first of 1 MiB).
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 640),
                torch.nn.BatchNorm1d(640),
                torch.nn.Tanh(),
                torch.nn.Dropout(0.3),
                torch.nn.Linear(640, 640),
                torch.nn.Tanh(),
                torch.nn.Linear(640, 1),
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            step = self.trainer.global_step
            x, y = batch
            if self.guarded:
                die_here(step, [])
                batches.append([step, torch.equal(x, xs[order[4 * step : 4 * step + 4]])])
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(3 * STEPS * 4, 4, generator=gen)
    data = DataLoader(TensorDataset(xs, xs.sum(1, keepdim=True).tanh()), batch_size=4)
    batches: list[list[Any]] = []  # [step, the batch is the one of this step] of each training_step
    # Lightning's own sampler for a training loader: DistributedSampler(shuffle=True, seed=0), epoch 0
    # (lightning/pytorch/trainer/connectors/data_connector.py, _get_distributed_sampler).
    order = list(DistributedSampler(TensorDataset(xs), num_replicas=3, rank=ME, shuffle=True, seed=0))

    def fit(model: Net, callbacks: list[Any]) -> Any:
        trainer = Trainer(  # Lightning's defaults: the DDP strategy on gloo for devices=3 on the CPU
            accelerator="cpu",
            devices=3,
            max_steps=STEPS,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
        return trainer

    if LIFE == 0:  # the same fit with no fault and no ncclguard first (a restarted process skips it)
        reference = Net(guarded=False)
        fit(reference, [])
    guard = NcclGuardCallback(
        watchdog=False,
        recover=True,
        heal=True,
        collective_timeout=BOUND_S,
        commit_timeout=60,
        rebuild_timeout=REJOIN_S,
    )
    model = Net()
    trainer = fit(model, [guard])
    if LIFE == 0:  # DDP's default buckets: the new wrappers took the old ones' layout
        put("params_equal_to_reference", torch.equal(flat(model.parameters()), flat(reference.parameters())))
    put("life", LIFE)
    put("global_step", trainer.global_step)
    put("recoveries", [[r.step, r.attempts, r.generation, r.healed_ranks] for r in guard.recoveries])
    put("lr", trainer.optimizers[0].param_groups[0]["lr"])
    put("batches", batches)
    put("world", [dist.get_rank(), dist.get_world_size(), ncclguard.recovery.generation()])
    put("params_equal_across_ranks", equal_across_ranks(flat(model.parameters())))
    put("optimizer_equal_across_ranks", equal_across_ranks(optimizer_state(trainer.optimizers[0])))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    {"accelerate": accelerate, "hf": hf, "lightning": lightning}[sys.argv[1]]()
    rankkit.done()


if __name__ == "__main__":
    main()
