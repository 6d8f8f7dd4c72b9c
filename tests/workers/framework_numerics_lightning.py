"""The ``lightning`` part of tests/workers/framework_numerics_worker.py: the NaN check on Lightning's DDP wrapper.

``Trainer(accelerator="cpu", devices=3, strategy=DDPStrategy(process_group_backend="gloo"))`` makes the
group; three fits in a row from the same start (numerics_worker's 956,042-parameter classifier with
dropout, its parameters named as there; AdamW; the same data, sharded by the DistributedSampler
Lightning inserts, not shuffled: every fit sees the same batches), each under
``NcclGuardCallback(recover=True, on_nonfinite=...)``, STEPS optimizer steps:

1. ``off``: ``on_nonfinite="off"``: no hook, DDP's own path (the reference);
2. ``clean``: ``on_nonfinite="redo"``, no fault: the check on Lightning's wrapper;
3. ``redo``: the same, rank 1's loss times NaN at step K in the first attempt only (``training_step``);
4. ``flipped``: ``replica_check_every=EVERY``, no NaN; once step FLIP_AFTER is applied, one bit of one
   element of rank 2's ``fc2.weight`` flipped (in ``on_train_batch_end``): the next step's check names
   rank 2, heals it from rank 0 and redoes the step.

Each step's ``StepResult`` is read where the adapter settles it (the engine's transactions, wrapped).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from framework_numerics_hf import EVERY, FLIP_AFTER, STEPS, K, Said, recorded, replicas_seen
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from rankkit import fault_fired, put
from torch.utils.data import DataLoader, TensorDataset


class Model(LightningModule):
    """numerics_worker's Net (its layers, in its order, under its names); rank 1's loss times NaN at
    step K in the step's first attempt (``fault``)."""

    def __init__(self, fault: bool) -> None:
        from numerics_worker import Net

        super().__init__()
        torch.manual_seed(1234)
        net = Net()
        self.fc1, self.fc2, self.fc3, self.head, self.drop = net.fc1, net.fc2, net.fc3, net.head, net.drop
        self.fault, self.tries_at_k = fault, 0
        # The strategy's DDP wrapper (its teardown unwraps the module after fit), in a list: not a submodule.
        self.wrapper: list[Any] = [None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from numerics_worker import Net

        return Net.forward(self, x)  # type: ignore[arg-type]  # the same layers under the same names

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.wrapper[0] = self.trainer.strategy.model
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if self.trainer.global_step == K:
            self.tries_at_k += 1
            if self.fault and dist.get_rank() == 1 and self.tries_at_k == 1:
                fault_fired(f"a NaN loss at step {K}")
                loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class FlipAfter(Callback):
    """Rank 2 flips one bit of its ``fc2.weight`` once step FLIP_AFTER is applied."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        from replicas_worker import BIT, flip

        if trainer.global_step == FLIP_AFTER + 1 and dist.get_rank() == 2:
            flip(pl_module, BIT)  # type: ignore[arg-type]  # Net's fc2, under its name


def data() -> DataLoader:
    from numerics_worker import BATCH, CLASSES, FEATURES

    g = torch.Generator().manual_seed(99)
    n = BATCH * STEPS * 3
    x, y = torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def lightning_run(base: int, policy: str, fault: bool, every: int | None = None) -> dict[str, Any]:
    """One fit from the same start; the engine's step numbers start at ``base`` (they grow across fits);
    with ``every``, replicas checked that often and rank 2's bit flipped."""
    from numerics_worker import flat

    from ncclguard.integrations.lightning import NcclGuardCallback

    checks = {} if every is None else {"replica_check_every": every}
    guard = NcclGuardCallback(watchdog=False, recover=True, collective_timeout=30, on_nonfinite=policy, **checks)
    assert guard.recovery is not None
    results: list[dict[str, Any]] = []
    recorded(guard.recovery.engine, results, base)
    model = Model(fault)
    trainer = Trainer(
        accelerator="cpu",
        devices=3,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        max_steps=STEPS,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[guard] if every is None else [guard, FlipAfter()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.environ["NCCLGUARD_TEST_OUT"],
    )
    trainer.fit(model, data())
    engine = guard.recovery.engine
    check = engine.numerics.check
    return {
        "carries": check is not None and check.carries(model.wrapper[0]),
        "results": results,
        "seen": [[s.step - base, s.ranks, s.finite_ranks, s.action] for s in engine.numerics.seen],
        "replicas_seen": replicas_seen(engine, base),
        "global_step": trainer.global_step,
        "tries_at_k": model.tries_at_k,
        "params": flat(model),
    }


def lightning() -> None:
    from numerics_worker import same_everywhere

    said = Said()
    logging.getLogger("ncclguard").addHandler(said)
    off = lightning_run(0, "off", fault=False)  # its strategy makes the group (gloo)
    put("off", {k: v for k, v in off.items() if k != "params"})
    said.lines.clear()
    clean = lightning_run(100, "redo", fault=False)
    put("clean", {k: v for k, v in clean.items() if k != "params"})
    put("clean_said", [line for line in said.lines if "non-finite" in line or "not checked for NaN" in line])
    redo = lightning_run(200, "redo", fault=True)
    put("redo", {k: v for k, v in redo.items() if k != "params"})
    put("clean_equal_to_off", torch.equal(clean["params"], off["params"]))
    put("redo_equal_to_off", torch.equal(redo["params"], off["params"]))
    put("redo_same_everywhere", same_everywhere(redo["params"]))
    flipped = lightning_run(300, "redo", fault=False, every=EVERY)
    put("flipped", {k: v for k, v in flipped.items() if k != "params"})
    put("flipped_equal_to_off", torch.equal(flipped["params"], off["params"]))
    put("flipped_same_everywhere", same_everywhere(flipped["params"]))
    dist.barrier()
